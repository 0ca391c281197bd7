"""Small updates over the data plane between real daemons (fabricd/updates.py,
fabricd/_sender.py ``exchange_inline``): a body of at most ``limits.dataplane_small_bytes``
rides in its header's record, one ack back.

b runs the defaults; c has ``limits.dataplane_small_bytes = 0`` (its small updates use
libp2p); r is reached by a only through a relay that passes its libp2p port, so its data
plane is unreachable from a. Each update here is answered by an executor on the far side
(end-to-end ack, as in production)."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proto.bridge import BridgeClient, Delivery, DeliveryResult, SendResult, SendUpdate
from tests.fabricd._harness import (
    Node,
    bridge_status,
    configure,
    connected_fast,
    init_ca,
    init_node,
    transfer,
    wait_until,
)
from tests.fabricd._transfer_load import blast
from tests.fabricd.test_dataplane_fallback import Relay

pytestmark = pytest.mark.slow

KIB = 1024


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Node]]:
    root: Path = tmp_path_factory.mktemp("small")
    ca = init_ca(root)
    b = init_node(root, "b", ca)
    r = init_node(root, "r", ca)
    started = [b, r]
    relay: Relay | None = None
    try:
        for node in (b, r):
            node.start()
            node.wait_ready()
        relay = Relay(r)
        a = init_node(root, "a", ca, [b.addr(), relay.addr])
        c = init_node(root, "c", ca, [b.addr()])
        configure(c, limits="dataplane_small_bytes = 0")
        for node in (a, c):
            started.append(node)
            node.start()
            node.wait_ready()
        wait_until(lambda: {"b", "r"} <= connected_fast(a) and "b" in connected_fast(c), timeout=60)
        yield {"a": a, "b": b, "c": c, "r": r}
    finally:
        for node in started:
            node.stop()
        if relay is not None:
            relay.close()


def _plane_used(t: dict[str, Any]) -> int:
    return int(t["dataplane_streams_opened"] + t["dataplane_streams_reused"])


def _libp2p_used(t: dict[str, Any]) -> int:
    return int(t["streams_opened"] + t["streams_reused"])


class _Executor:
    """An executor on ``node`` for ``job`` that answers each Delivery (``refuse``: with
    ok=False and that reason) and keeps what it was given."""

    def __init__(self, node: Node, job: str, refuse: str = "") -> None:
        self.client = BridgeClient(node.bridge_socket, role="executor",
                                   cluster_id=node.name, job_id=job, timeout=60, answers_deliveries=True)
        self.refuse = refuse
        self.got: list[tuple[str, bytes]] = []
        wait_until(lambda: any(c["job_id"] == job for c in bridge_status(node)["bridge_clients"]), 30)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                msg, payload = self.client.recv()
                if isinstance(msg, Delivery):
                    if not self.refuse:
                        self.got.append((msg.message_id, bytes(payload)))
                    self.client.send(DeliveryResult(message_id=msg.message_id, ok=not self.refuse,
                                                    reason=self.refuse, source_cluster=msg.source_cluster))
        except (OSError, EOFError, Exception):  # noqa: BLE001 - closed by the test
            return

    def close(self) -> None:
        try:
            self.client.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in recv
        except OSError:
            pass
        self.thread.join(10)
        self.client.close()


def _send(node: Node, target: str, job: str, mid: str, body: bytes) -> SendResult:
    sender = BridgeClient(node.bridge_socket, role="executor",
                          cluster_id=node.name, job_id=job, timeout=60)
    try:
        msg = SendUpdate(target_cluster=target, job_id=job, round=1, source_node="s", target_node="t",
                         message_id=mid, tensor_count=1, byte_length=len(body),
                         sha256=hashlib.sha256(body).digest())
        reply, _ = sender.request(msg, body)
    finally:
        sender.close()
    assert isinstance(reply, SendResult), reply
    return reply


def test_small_updates_over_the_plane_arrive_exactly_once(nodes: dict[str, Node]) -> None:
    a, b = nodes["a"], nodes["b"]
    job = f"small-{uuid.uuid4().hex[:6]}"
    bodies = {f"{job}-{i}": os.urandom(KIB + i) for i in range(5)}
    executor = _Executor(b, job)
    try:
        before = transfer(a)
        for mid, body in bodies.items():
            reply = _send(a, "b", job, mid, body)
            assert reply.ok and reply.reason == "", reply
        # sent again under the same ids (a sender that lost the ack): acked, not delivered again
        for mid in list(bodies)[:2]:
            reply = _send(a, "b", job, mid, bodies[mid])
            assert reply.ok and reply.reason.startswith("duplicate"), reply
        after = transfer(a)
        wait_until(lambda: len(executor.got) >= 5, 10)
    finally:
        executor.close()
    assert sorted(executor.got) == sorted(bodies.items()), "each body delivered once, unchanged"
    assert _plane_used(after) - _plane_used(before) == 7, (before, after)
    assert _libp2p_used(after) == _libp2p_used(before), "libp2p carried none of them"
    assert after["dataplane_fallbacks"] == before["dataplane_fallbacks"], after
    assert b.log().count("event=update.duplicate") >= 2, "b answered the repeats as duplicates"


def test_a_refused_small_update_is_refused_cleanly_and_can_come_again(nodes: dict[str, Node]) -> None:
    a, b = nodes["a"], nodes["b"]
    job = f"refuse-{uuid.uuid4().hex[:6]}"
    body = os.urandom(2 * KIB)
    before = transfer(a)
    # nobody on b takes the job: refused before delivery, with the reason
    reply = _send(a, "b", job, f"{job}-0", body)
    assert not reply.ok and "rejected" in reply.reason and job in reply.reason, reply
    # the executor refuses it: its reason comes back, nothing counts as delivered
    refusing = _Executor(b, job, refuse="the test executor is full")
    try:
        reply = _send(a, "b", job, f"{job}-0", body)
    finally:
        refusing.close()
    assert not reply.ok and reply.reason.startswith("rejected") and "the test executor is full" in reply.reason, reply
    wait_until(lambda: not any(c["job_id"] == job for c in bridge_status(b)["bridge_clients"]), 30)
    # the same id later: delivered (the refusals did not record it), once
    executor = _Executor(b, job)
    try:
        first = _send(a, "b", job, f"{job}-0", body)
        again = _send(a, "b", job, f"{job}-0", body)
        wait_until(lambda: len(executor.got) >= 1, 10)
    finally:
        executor.close()
    assert first.ok and first.reason == "", first
    assert again.ok and again.reason.startswith("duplicate"), again
    assert executor.got == [(f"{job}-0", body)]
    after = transfer(a)
    # all four over the plane (a refusal closes its connection; the next one opens another)
    assert _plane_used(after) - _plane_used(before) == 4, (before, after)
    assert _libp2p_used(after) == _libp2p_used(before), (before, after)


def test_small_updates_fall_back_to_libp2p_when_the_plane_port_is_unreachable(nodes: dict[str, Node]) -> None:
    a, r = nodes["a"], nodes["r"]
    before = transfer(a)
    first = blast(a, r, count=1, size=KIB, sockets=1)
    assert first.failed == [] and first.delivered == 1 and first.digest_mismatch == 0, first.summary()
    more = blast(a, r, count=3, size=4 * KIB, sockets=1)
    assert more.failed == [] and more.delivered == 3 and more.digest_mismatch == 0, more.summary()
    after = transfer(a)
    # one refused dial, then remembered: every small body at once over libp2p
    assert after["dataplane_failed"] - before["dataplane_failed"] == 1, (before, after)
    assert after["dataplane_fallbacks"] - before["dataplane_fallbacks"] == 4, (before, after)
    assert _libp2p_used(after) - _libp2p_used(before) == 4, (before, after)
    assert transfer(r)["dataplane_accepted"] == 0


def test_dataplane_small_bytes_0_keeps_small_updates_on_libp2p(nodes: dict[str, Node]) -> None:
    b, c = nodes["b"], nodes["c"]
    before = transfer(c)
    result = blast(c, b, count=3, size=KIB, sockets=1)
    assert result.failed == [] and result.delivered == 3 and result.digest_mismatch == 0, result.summary()
    after = transfer(c)
    assert _libp2p_used(after) - _libp2p_used(before) == 3, (before, after)
    assert _plane_used(after) == _plane_used(before) and after["dataplane_opened"] == before["dataplane_opened"]
