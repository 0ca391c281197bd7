"""Node impersonation during a real job (issue 11, must-show 1).

A party with a valid CA-signed *cluster* certificate that is no part of the job connects
to every daemon of a 3-cluster testbed (in-process executors). After each plan is
published and after every round it sends forged, well-formed updates under the
predictable message ids (job/round/kind/src/dst) of the round about to run and of the one
just run, for every edge of the job's routing matrix, each to the cluster holding its
target, before the genuine senders; and a final model to the scheduler's daemon right
after the genuine one reached it (before the driver takes it). Every forgery is refused
with a logged reason, every round runs, and the job ends with exactly the model of the
same job run undisturbed.
"""

from __future__ import annotations

import hashlib
import re
import threading
from typing import Any

import numpy as np
import pytest
import trio
from libp2p.abc import IHost
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from safetensors.numpy import load as st_load

from fabricd._streams import read_message_exact
from proto.codec import frame
from proto.ids import PROTOCOL_UPDATE
from proto.job import JobSpec
from proto.messages import UpdateAck, UpdateHeader
from proto.rounds import RoundRecord
from proto.routing import RoutingMatrix
from scheduler.run.driver import Driver, JobResult
from scheduler.run.mesh import BridgeChannel
from scheduler.testbed import LocalTestbed
from tests.fabricd._harness import cli_inprocess
from tests.fabricd._hostile import certificate_for, hello, peer_info, raw_host
from worker import payload as wire
from worker.executor.graph import DOWN, FINAL, UP
from worker.executor.transport import message_id

pytestmark = pytest.mark.slow
ROUNDS = 3
INTRUDER = "intruder"
SCHEDULER = "scheduler"


def spec(job_id: str) -> JobSpec:
    return JobSpec.from_dict({
        "job": {"id": job_id, "seed": 11},
        "data": {"number_of_clients": 6},
        "training": {"federated_learning_rounds": ROUNDS, "number_of_epochs": 1},
        "topology": {"kind": "star"},
        "aggregation": {"name": "fedavg"},
        "placement": {"strategy": "round_robin", "max_materialized": 2}})


class Forger:
    """The intruder: one raw libp2p host, a member of the federation, not of the job."""

    def __init__(self, host: IHost, peers: dict[str, ID], token: trio.lowlevel.TrioToken,
                 tensors: dict[str, np.ndarray]) -> None:
        self.host = host
        self.peers = peers
        self.token = token
        self.tensors = tensors  # a model of the job's shapes, values of the forger's choice
        #: (target cluster, message id, the daemon's ack) of every forgery
        self.acks: list[tuple[str, str, UpdateAck]] = []
        self._lock = threading.Lock()

    def forge_rounds(self, job_id: str, routing: RoutingMatrix, rounds: list[int],
                     only_to: str | None = None) -> None:
        """From a driver thread: forge every edge's update of ``rounds`` (blocking)."""
        forged = []
        for r in rounds:
            for u, v, _ in routing.edges():
                for src, dst in ((routing.node_name(u), routing.node_name(v)),
                                 (routing.node_name(v), routing.node_name(u))):
                    target = routing.cluster_of(dst)
                    if only_to is None or target == only_to:
                        kind = UP if routing.parent_of(src) == dst else DOWN
                        forged.append((target, r, kind, src, dst))
        trio.from_thread.run(self._send_all, job_id, forged, trio_token=self.token)

    def forge_final(self, job_id: str, node: str) -> None:
        """From a driver thread: a final model from ``node`` for the scheduler's daemon."""
        trio.from_thread.run(self._send_all, job_id, [(SCHEDULER, 0, FINAL, node, SCHEDULER)],
                             trio_token=self.token)

    async def _send_all(self, job_id: str, forged: list[tuple[str, int, str, str, str]]) -> None:
        async with trio.open_nursery() as nursery:
            for item in forged:
                nursery.start_soon(self._send, job_id, *item)

    async def _send(self, job_id: str, target: str, r: int, kind: str, src: str, dst: str) -> None:
        body = wire.encode({k: -3.0 * v + 1.0 for k, v in self.tensors.items()}, kind=kind,
                           samples=10_000)
        mid = message_id(job_id, r, kind, src, dst)
        header = UpdateHeader(job_id=job_id, round=r, source_node=src, target_node=dst,
                              message_id=mid, tensor_count=len(self.tensors), byte_length=len(body),
                              sha256=hashlib.sha256(body).digest())
        stream = await self.host.new_stream(self.peers[target], [PROTOCOL_UPDATE])  # type: ignore[list-item]
        await stream.write(frame(header) + body)
        with trio.fail_after(30):
            ack = await read_message_exact(stream, 1 << 16)
        await stream.close()
        assert isinstance(ack, UpdateAck), ack
        with self._lock:
            self.acks.append((target, mid, ack))


class WatchedChannel(BridgeChannel):
    """The scheduler's channel, keeping the routing matrix of every plan it publishes and
    letting the forger strike right after a cluster accepted one, and right after the
    genuine final model reached the scheduler's daemon (before the driver takes it)."""

    def __init__(self, socket_path: str, job_id: str, forger: Forger | None) -> None:
        super().__init__(socket_path, job_id=job_id)
        self.forger = forger
        self.routing: RoutingMatrix | None = None

    def request(self, cluster_id: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        reply = super().request(cluster_id, body, timeout)
        if body.get("kind") == "job.plan":
            self.routing = RoutingMatrix.from_bytes(bytes(body["routing"]))
            if self.forger is not None:  # before any round runs on this plan
                nxt = int(body.get("next_round", 1))
                self.forger.forge_rounds(str(body["job_id"]), self.routing, [nxt],
                                         only_to=cluster_id)
        if body.get("kind") == "job.model" and "node" in reply and self.forger is not None:
            self.forger.forge_final(str(body["job_id"]), str(reply["node"]))
        return reply


def run(tb: LocalTestbed, clusters: Any, job: JobSpec, forger: Forger | None) -> JobResult:
    channel = WatchedChannel(tb.bridge_socket("scheduler"), job.job_id, forger)

    def after_round(record: RoundRecord, total: int) -> None:
        if forger is not None and channel.routing is not None and record.round < total:
            # the next round's ids before its genuine senders, and the finished round's again
            forger.forge_rounds(job.job_id, channel.routing, [record.round + 1, record.round])

    driver = Driver(job, clusters, channel, backend="inprocess", timeout=300,
                    progress=after_round)
    try:
        return driver.run()
    finally:
        driver.close()
        channel.close()


@pytest.mark.trio
async def test_forged_updates_are_refused_and_the_model_is_the_undisturbed_one(three_clusters: Any) -> None:
    tb, clusters = three_clusters
    calm = await trio.to_thread.run_sync(lambda: run(tb, clusters, spec("imp-calm"), None))
    assert calm.model is not None
    assert [r.round for r in calm.summary.rounds] == list(range(1, ROUNDS + 1))

    intruder = create_new_key_pair()
    cert = certificate_for(intruder, tb.root / "ca", INTRUDER, "cluster")
    targets = {cid: peer_info(await trio.to_thread.run_sync(
        lambda c=cid: cli_inprocess("id", "--config", str(tb.configs[c]))["addrs"][0]))
        for cid in [*tb.cluster_ids, SCHEDULER]}
    async with raw_host(intruder) as host:
        for info in targets.values():
            await host.connect(info)
            assert (await hello(host, info.peer_id, cert)).accepted
        forger = Forger(host, {cid: info.peer_id for cid, info in targets.items()},
                        trio.lowlevel.current_trio_token(), dict(st_load(calm.model)))
        job = spec("imp-attacked")
        attacked = await trio.to_thread.run_sync(lambda: run(tb, clusters, job, forger))

    # every round ran, and the model is exactly the undisturbed run's
    assert [r.round for r in attacked.summary.rounds] == list(range(1, ROUNDS + 1))
    assert all(r.participants == 6 for r in attacked.summary.rounds)
    # tensor by tensor, to the last bit (the safetensors header may list them in another order)
    expected, got = st_load(calm.model), st_load(attacked.model or b"")
    assert expected.keys() == got.keys()
    for name in expected:
        assert expected[name].dtype == got[name].dtype and np.array_equal(expected[name], got[name]), name
    # every forgery of every round was refused, each naming the genuine placement
    to_nodes = [(t, mid, ack) for t, mid, ack in forger.acks if t != SCHEDULER]
    assert {int(mid.split("/")[1]) for _, mid, _ in to_nodes} == set(range(1, ROUNDS + 1))
    assert len({(t, mid) for t, mid, _ in to_nodes}) >= ROUNDS * 12  # 6 up + 6 down a round
    for target, mid, ack in to_nodes:
        assert ack.status == "rejected", (target, mid, ack)
        assert f"update from cluster {INTRUDER!r} claims source node" in ack.reason, ack.reason
        assert "places it on cluster" in ack.reason, ack.reason
    # and so was the final model it sent the scheduler's daemon in place of the genuine one
    final = [(mid, ack) for t, mid, ack in forger.acks if t == SCHEDULER]
    assert [mid for mid, _ in final] == [f"{job.job_id}/0/final/server/scheduler"], final
    assert final[0][1].status == "rejected", final
    assert f"cluster {INTRUDER!r} is not one of the clusters of job {job.job_id!r}" in final[0][1].reason
    logs = {cid: (tb.root / f"{cid}.log").read_text(errors="replace")
            for cid in [*tb.cluster_ids, SCHEDULER]}
    for target, mid, _ in forger.acks:
        assert re.search(rf"event=update\.rejected .*message_id={re.escape(mid)} .*"
                         rf"(claims source node|is not one of the clusters)", logs[target]), (target, mid)
