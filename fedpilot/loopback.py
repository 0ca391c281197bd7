"""All clusters' executors in this process, joined without daemons (fast tests only).

The scheduler's driver, the executors' control services, the round engine and the
hybrid transport are the production ones; only fabricd is replaced by direct calls,
with every control body passed through msgpack so nothing is shared by reference.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import msgpack

from scheduler.errors import JobFailed
from scheduler.run.driver import ClusterInfo

SCHEDULER = "scheduler"


class _Link:
    def __init__(self, mesh: LoopbackMesh, source: str) -> None:
        self.mesh = mesh
        self.source = source

    def send_update(self, *, target_cluster: str, job_id: str, round: int, source_node: str,
                    target_node: str, message_id: str, payload: bytes) -> None:
        from worker.executor.transport import DeliveryNotReady, RemoteSendError

        if target_cluster == SCHEDULER:
            with self.mesh.arrived:
                self.mesh.updates[(job_id, source_node)] = bytes(payload)
                self.mesh.arrived.notify_all()
            return
        service = self.mesh.services.get(target_cluster)
        if service is None:
            raise JobFailed(f"cluster {target_cluster} is not in the loopback mesh")
        # round 0 carries the final model's shares; rounds (and re-plan epochs) count >= 1
        counter = self.mesh.bytes_sent if round >= 1 else self.mesh.bytes_final
        with self.mesh.lock:
            counter[self.source] = counter.get(self.source, 0) + len(payload)
        try:
            service.deliver(job_id=job_id, round=round, source_node=source_node,
                            target_node=target_node, source_cluster=self.source,
                            payload=bytes(payload), message_id=message_id)
        except DeliveryNotReady as exc:  # what fabricd says: the sender retries it
            raise RemoteSendError(str(exc), retry=True) from exc


class LoopbackMesh:
    """A `ClusterChannel` whose clusters are ExecutorServices in this process."""

    def __init__(self, cluster_ids: list[str], make_runtime: Callable[[str], Any],
                 capacity: int = 0) -> None:
        from worker.executor.service import ExecutorService

        self.local_cluster = SCHEDULER
        self.lock = threading.Lock()
        self.arrived = threading.Condition()
        self.updates: dict[tuple[str, str], bytes] = {}
        self.bytes_sent: dict[str, int] = {}
        self.bytes_final: dict[str, int] = {}
        self.capacity = capacity
        self.services = {
            cid: ExecutorService(cluster_id=cid, make_runtime=make_runtime(cid),
                                 link=_Link(self, cid), round_timeout=120)
            for cid in cluster_ids
        }

    def clusters(self) -> list[ClusterInfo]:
        return [ClusterInfo(cid, f"loopback-{cid}", self.capacity) for cid in self.services]

    def send_update(self, *, target_cluster: str, job_id: str, round: int, source_node: str,
                    target_node: str, message_id: str, payload: bytes, timeout: float) -> None:
        """An update from the scheduler (a checkpoint's node state) to a cluster."""
        _Link(self, SCHEDULER).send_update(
            target_cluster=target_cluster, job_id=job_id, round=round, source_node=source_node,
            target_node=target_node, message_id=message_id, payload=payload)

    def take_update(self, job_id: str, source_node: str, timeout: float) -> bytes:
        with self.arrived:
            if not self.arrived.wait_for(lambda: (job_id, source_node) in self.updates, timeout):
                raise JobFailed(f"the update from node {source_node} of job {job_id} did not "
                                f"arrive within {timeout:.0f} s")
            return self.updates.pop((job_id, source_node))

    def request(self, cluster_id: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        service = self.services.get(cluster_id)
        if service is None:
            raise JobFailed(f"cluster {cluster_id} is not in the loopback mesh")
        wire = msgpack.unpackb(msgpack.packb(body, use_bin_type=True), raw=False)
        try:
            reply = service.handle(wire)
        except Exception as exc:  # what a daemon would return as a refusal, whatever it is
            raise JobFailed(f"cluster {cluster_id} refused {body.get('kind')}: "
                            f"{type(exc).__name__}: {exc}") from exc
        return dict(msgpack.unpackb(msgpack.packb(reply, use_bin_type=True), raw=False))
