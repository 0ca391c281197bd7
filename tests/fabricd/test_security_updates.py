"""Update admission on real daemons: node impersonation and slow-loris senders.

- Impersonation: a member (not placed by the job's routing matrix) sends first under
  the genuine sender's predictable message id. It is refused with a logged reason, the
  genuine update is delivered (not acked as a "duplicate"), and the executor receives
  exactly the genuine bytes.
- Slow-loris: two members open 64 MiB updates and drip one byte every few seconds; they
  are cut at the minimum rate, and a genuine 64 MiB update still arrives.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
import trio

from fabricd._streams import read_message_exact
from proto.bridge import (
    BridgeClient,
    ControlDelivery,
    ControlReply,
    Delivery,
    SendResult,
    SendUpdate,
)
from proto.codec import frame
from proto.control import JobPlan, plan_parts
from proto.ids import PROTOCOL_UPDATE
from proto.messages import UpdateAck, UpdateHeader
from proto.routing import RoutingMatrix
from tests.fabricd._harness import Node, bridge_status, connected_fast, wait_until
from tests.fabricd._hostile import hello, peer_info, raw_host
from tests.fabricd.test_security_control import Party

pytestmark = pytest.mark.slow


class Executor:
    """A bridge client taking every job's updates and control requests on one daemon."""

    def __init__(self, node: Any) -> None:
        self.client = BridgeClient(node.bridge_socket, role="executor",
                                   cluster_id=node.name, job_id="*", timeout=0.5)
        self.deliveries: list[tuple[Delivery, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                msg, payload = self.client.recv()
            except (TimeoutError, OSError):
                continue
            if isinstance(msg, Delivery):
                self.deliveries.append((msg, payload))
            elif isinstance(msg, ControlDelivery):
                self.client.send(ControlReply(request_id=msg.request_id, ok=True, body={}, reason=""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.client.close()


async def joined_with_executor(mesh: Any, name: str, edit: Callable[[str], str]) -> tuple[Node, Executor]:
    """A new member ``name`` (bootstrapping from a) with its cluster.toml passed through
    ``edit``, started and connected to a, and an Executor on it."""
    a = mesh.nodes["a"]
    node = await trio.to_thread.run_sync(lambda: mesh.add(name, [a.addr()], start=False))
    cfg = node.dir / "cluster.toml"
    cfg.write_text(edit(cfg.read_text()))
    await trio.to_thread.run_sync(lambda: (node.start(), node.wait_ready()))
    await trio.to_thread.run_sync(lambda: wait_until(lambda: name in connected_fast(a), timeout=60))
    return node, await trio.to_thread.run_sync(lambda: Executor(node))


def small_budget(text: str) -> str:
    """Updates of at most 80 MiB, 160 MiB in flight (a few 64 MiB updates fill it)."""
    text = re.sub(r"max_update_bytes = \d+", f"max_update_bytes = {80 << 20}", text)
    return re.sub(r"max_inflight_bytes = \d+", f"max_inflight_bytes = {160 << 20}", text)


def _send_update(node: Any, target: str, header: UpdateHeader, payload: bytes) -> SendResult:
    with BridgeClient(node.bridge_socket, role="executor", cluster_id=node.name,
                      job_id="sender", timeout=300) as client:
        reply, _ = client.request(SendUpdate(target_cluster=target, **{
            k: getattr(header, k) for k in ("job_id", "round", "source_node", "target_node", "message_id",
                                            "tensor_count", "byte_length", "sha256")}), payload)
    assert isinstance(reply, SendResult), reply
    return reply


def _header(job: str, mid: str, payload: bytes, src: str, dst: str) -> UpdateHeader:
    return UpdateHeader(job_id=job, round=1, source_node=src, target_node=dst, message_id=mid,
                        tensor_count=1, byte_length=len(payload), sha256=hashlib.sha256(payload).digest())


def _plan_bodies(job: str, routing: RoutingMatrix, form: str) -> list[dict[str, Any]]:
    """The job.plan as sent inline, or as job.plan.parts and a job.plan naming their digest
    (the daemon must learn the placement from those as well)."""
    data = routing.to_bytes()
    if form == "inline":
        return [{"kind": "job.plan", "job_id": job, "routing": data}]
    parts, digest = plan_parts(job, data)
    return [*(p.to_body() for p in parts),
            JobPlan(job, routing_sha256=digest, routing_size=len(data)).to_body()]


@pytest.mark.trio
@pytest.mark.parametrize("form", ["inline", "parts"])
async def test_a_member_cannot_send_under_another_nodes_message_id(mesh, form: str) -> None:
    a, b = mesh.nodes["a"], mesh.nodes["b"]
    await trio.to_thread.run_sync(lambda: wait_until(lambda: "b" in connected_fast(a), timeout=60))
    job = f"j-impersonate-{form}"
    # c0 lives on a, c1 on b; the server on b.
    routing = RoutingMatrix.from_edges(job_id=job, clusters=["a", "b"], num_clients=2,
                                       aggregators=["server"], node_cluster=[0, 1, 1],
                                       edges=[(0, 2), (1, 2)])
    mid = f"{job}/1/update/c0/server"
    genuine, forged = os.urandom(256 * 1024), os.urandom(256 * 1024)
    scheduler = Party(mesh.ca, f"sched-imp-{form}", "scheduler")
    liar = Party(mesh.ca, f"liar-imp-{form}", "cluster")
    executor = await trio.to_thread.run_sync(lambda: Executor(b))
    try:
        await trio.to_thread.run_sync(lambda: wait_until(
            lambda: any(c["job_id"] == "*" for c in bridge_status(b)["bridge_clients"]), 10))
        target = peer_info(b.addr())
        async with raw_host(scheduler.key_pair) as hs, raw_host(liar.key_pair) as hl:
            for party, host in ((scheduler, hs), (liar, hl)):
                party.host = host
                await host.connect(target)
                assert (await hello(host, target.peer_id, party.cert)).accepted
            for body in ({"kind": "job.start", "job_id": job}, *_plan_bodies(job, routing, form)):
                reply = await scheduler.send(target.peer_id, "s1", scheduler.seal(body))
                assert reply.ok, reply
            # The liar goes first, under the genuine sender's message id.
            stream = await hl.new_stream(target.peer_id, [PROTOCOL_UPDATE])
            await stream.write(frame(_header(job, mid, forged, "c0", "server")) + forged)
            with trio.fail_after(60):
                ack = await read_message_exact(stream, 1 << 16)
            await stream.close()
            assert isinstance(ack, UpdateAck) and ack.status == "rejected", ack
            assert "places it on cluster 'a'" in ack.reason, ack.reason
        result = await trio.to_thread.run_sync(
            lambda: _send_update(a, "b", _header(job, mid, genuine, "c0", "server"), genuine))
        assert result.ok and "duplicate" not in result.reason, result
        await trio.to_thread.run_sync(lambda: wait_until(lambda: executor.deliveries, timeout=30))
    finally:
        await trio.to_thread.run_sync(executor.close)
    delivered = [(d, p) for d, p in executor.deliveries if d.job_id == job]
    assert len(delivered) == 1, delivered
    assert delivered[0][0].source_cluster == "a" and delivered[0][1] == genuine
    assert re.search(rf"event=update\.rejected .*{job}.*places it on cluster", b.log())


@pytest.mark.trio
async def test_two_slow_loris_senders_do_not_starve_a_genuine_64_mib_update(mesh) -> None:
    a = mesh.nodes["a"]
    # A small in-flight budget: the two slow senders' declared 64 MiB each fill it.
    s, executor = await joined_with_executor(mesh, "slow", small_budget)
    job, size = "j-loris", 64 << 20
    target = peer_info(s.addr())
    drips: list[UpdateAck | None] = []
    # both declare their 64 MiB at once: each is cut a few seconds (the rate grace) after
    # its header, so on a loaded machine one set up late would find the other gone
    ready, go = [], trio.Event()

    async def loris(name: str) -> None:
        party = Party(mesh.ca, name, "cluster")
        async with raw_host(party.key_pair) as host:
            await host.connect(target)
            assert (await hello(host, target.peer_id, party.cert)).accepted
            stream = await host.new_stream(target.peer_id, [PROTOCOL_UPDATE])
            body = b"\0" * size
            ready.append(name)
            if len(ready) == 2:
                go.set()
            await go.wait()
            await stream.write(frame(_header(job, f"{job}/1/update/{name}/x", body, name, "x")))
            async with trio.open_nursery() as nursery:

                async def drip() -> None:
                    while True:
                        await stream.write(b"\0")
                        await trio.sleep(2.0)

                nursery.start_soon(drip)
                with trio.move_on_after(120):
                    drips.append(await read_message_exact(stream, 1 << 16))
                nursery.cancel_scope.cancel()

    genuine = os.urandom(size)
    try:
        await trio.to_thread.run_sync(lambda: wait_until(
            lambda: any(c["job_id"] == "*" for c in bridge_status(s)["bridge_clients"]), 10))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(loris, "loris-1")
            nursery.start_soon(loris, "loris-2")
            # Both hold their reservation before the genuine update starts.
            await trio.to_thread.run_sync(lambda: wait_until(
                lambda: bridge_status(s)["transfer"]["inflight_in_bytes"] >= 2 * size, timeout=60))
            result = await trio.to_thread.run_sync(
                lambda: _send_update(a, "slow", _header(job, f"{job}/1/update/g/x", genuine, "g", "x"), genuine))
        assert result.ok, result
        await trio.to_thread.run_sync(lambda: wait_until(
            lambda: any(p == genuine for _, p in executor.deliveries), timeout=60))
    finally:
        await trio.to_thread.run_sync(executor.close)
    assert len(drips) == 2 and all(isinstance(d, UpdateAck) and d.status == "rejected" for d in drips), drips
    assert all("minimum rate" in d.reason for d in drips if d is not None), drips
    assert re.search(r"event=update\.rejected .*too slow", s.log())
