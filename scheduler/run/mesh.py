"""The scheduler's door to the mesh: its own fabricd's bridge.

The scheduler runs a daemon with a `scheduler` certificate; this module talks to it
over the local bridge socket (no libp2p here). Control requests go to a cluster's
executor through both daemons; the sending daemon signs them with its scheduler
identity, and receiving daemons refuse job messages not signed by a scheduler.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

from proto.bridge import (
    BridgeClient,
    BridgeMessage,
    ControlResult,
    ControlSend,
    Delivery,
    DeliveryResult,
    Error,
    Hello,
    SendResult,
    SendUpdate,
    StatusReply,
    StatusRequest,
)
from proto.bridge_connection import BridgeConnection, Reply
from scheduler.errors import JobFailed
from scheduler.run.channel import ClusterInfo

log = logging.getLogger("fedpilot.scheduler")


def daemon_status(socket_path: str, timeout: float = 10.0) -> dict[str, Any]:
    """One status request to the daemon behind `socket_path`."""
    try:
        with BridgeClient(socket_path, role="cli", max_payload=0, timeout=timeout) as client:
            msg, _ = client.request(StatusRequest())
    except OSError as exc:
        raise JobFailed(f"cannot reach fabricd's bridge at {socket_path}: {exc} "
                        "(is the scheduler's daemon running?)") from exc
    if not isinstance(msg, StatusReply):
        raise JobFailed(f"fabricd at {socket_path} answered {msg.TYPE} to a status request")
    return dict(msg.status)


def wait_for_clusters(socket_path: str, *, expected: list[str] | None = None, minimum: int = 1,
                      timeout: float = 60.0) -> list[ClusterInfo]:
    """Clusters the scheduler's daemon sees connected, once `expected` (or `minimum`) are."""
    deadline = time.monotonic() + timeout
    seen: list[ClusterInfo] = []
    missing: list[str] = []
    while True:
        try:
            status = daemon_status(socket_path)
        except JobFailed:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)  # the daemon may still be starting
            continue
        seen = [ClusterInfo(str(c["cluster_id"]), str(c.get("peer_id", "")),
                            int(c.get("capacity", 0) or 0))
                for c in status.get("clusters", [])
                # ready = connected and its heartbeat announced a capacity to host clients
                if c.get("connected") and c.get("role", "cluster") == "cluster"
                and int(c.get("capacity") or 0) > 0]
        ids = {c.cluster_id for c in seen}
        if expected is not None:
            missing = [c for c in expected if c not in ids]
            if not missing:
                return sorted((c for c in seen if c.cluster_id in expected),
                              key=lambda c: c.cluster_id)
        elif len(seen) >= minimum:
            return sorted(seen, key=lambda c: c.cluster_id)
        if time.monotonic() > deadline:
            if expected is not None:
                raise JobFailed(f"cluster(s) {', '.join(missing)} did not join the mesh within "
                                f"{timeout:.0f} s (connected: {', '.join(sorted(ids)) or 'none'})")
            raise JobFailed(f"only {len(seen)} cluster(s) connected after {timeout:.0f} s; "
                            f"need {minimum}")
        time.sleep(0.25)


MAX_MODEL_BYTES = 1 << 40  # the final model arrives as an update stream of any size


class BridgeChannel:
    """`ClusterChannel` over the scheduler daemon's bridge (many requests in flight). It
    registers for `job_id`, so the job's final model, streamed by a cluster's executor to
    this daemon, is delivered here."""

    def __init__(self, socket_path: str, job_id: str = "") -> None:
        self.socket_path = socket_path
        self.local_cluster = str(daemon_status(socket_path).get("cluster_id", ""))
        self._updates: dict[tuple[str, str], bytes] = {}
        self._arrived = threading.Condition()
        self._ids = itertools.count(1)
        try:  # it answers each Delivery once stored, so a cluster hears its model arrived
            self._conn = BridgeConnection(
                socket_path, Hello(role="scheduler", job_id=job_id, answers_deliveries=True),
                max_payload=MAX_MODEL_BYTES, on_message=self._on_message,
                name="mesh-reader")
        except ConnectionError as exc:
            raise JobFailed(f"{exc} (is the scheduler's daemon running?)") from exc
        self._conn.start()

    def request(self, cluster_id: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        request_id = f"s{next(self._ids)}"
        msg = ControlSend(request_id=request_id, target_cluster=cluster_id, body=body)
        result = self._exchange(msg, ControlResult, request_id, timeout, b"",
                                late=f"cluster {cluster_id} did not answer {body.get('kind')}",
                                doing=f"talking to cluster {cluster_id}")
        if not result.ok:
            raise JobFailed(f"cluster {cluster_id} refused {body.get('kind')}: {result.reason}")
        return dict(result.body)

    def connected(self) -> dict[str, bool]:
        """Which clusters the scheduler's daemon sees connected now (mesh connection and
        fresh heartbeats): how a lost cluster is noticed in seconds."""
        status = daemon_status(self.socket_path, timeout=5.0)
        return {str(c["cluster_id"]): bool(c.get("connected"))
                for c in status.get("clusters", [])}

    def send_update(self, *, target_cluster: str, job_id: str, round: int, source_node: str,
                    target_node: str, message_id: str, payload: bytes, timeout: float) -> None:
        """Stream `payload` (a safetensors update) to `target_cluster`'s executor (a node
        state restored from a checkpoint); JobFailed unless its daemon took it."""
        msg = SendUpdate.for_payload(payload, target_cluster=target_cluster, job_id=job_id,
                                     round=round, source_node=source_node,
                                     target_node=target_node, message_id=message_id)
        result = self._exchange(msg, SendResult, message_id, timeout, payload,
                                late=f"update {message_id} to cluster {target_cluster} was "
                                     "not acknowledged",
                                doing=f"sending to cluster {target_cluster}")
        if not result.ok:
            raise JobFailed(f"cluster {target_cluster} did not take update {message_id}: "
                            f"{result.reason}")

    def _exchange(self, msg: BridgeMessage, reply: type[Reply], reply_id: str, timeout: float,
                  payload: bytes, *, late: str, doing: str) -> Reply:
        try:
            return self._conn.exchange(msg, reply, reply_id, timeout, payload)
        except TimeoutError:
            raise JobFailed(f"{late} within {timeout:.0f} s") from None
        except OSError as exc:
            raise JobFailed(f"lost the scheduler's daemon while {doing}: {exc}") from exc

    def take_update(self, job_id: str, source_node: str, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        with self._arrived:
            while (job_id, source_node) not in self._updates:
                left = deadline - time.monotonic()
                if left <= 0 or self._conn.closed.is_set():
                    raise JobFailed(f"the update from node {source_node} of job {job_id} did "
                                    f"not reach the scheduler within {timeout:.0f} s")
                self._arrived.wait(min(left, 1.0))
            return self._updates.pop((job_id, source_node))

    def _on_message(self, msg: BridgeMessage, payload: bytes) -> None:
        if isinstance(msg, Delivery):
            with self._arrived:
                self._updates[(msg.job_id, msg.source_node)] = payload
                self._arrived.notify_all()
            try:
                self._conn.send(DeliveryResult(message_id=msg.message_id,
                                               source_cluster=msg.source_cluster,
                                               ok=True, reason=""))
            except OSError as exc:  # the daemon is gone: the next read says so
                log.error("event=delivery_answer_lost message=%s reason=%s",
                          msg.message_id, exc)
        elif isinstance(msg, Error):
            log.error("event=bridge_error reason=%s", msg.reason)

    def close(self) -> None:
        """Close the bridge and join its reader."""
        self._conn.close()
