"""A member's flood of distinct message ids, against a real daemon.

The daemon under test keeps at most 200 delivered ids per (sending cluster, job)
(limits.dedup_ids_per_member); the member sends 4x that many distinct ids - first all in
the round of a genuine update, then spread over newer rounds. The old design (one LRU of
ids for everything) evicts the first id past its bound and delivers it a second time;
here it must never be delivered again, and the table must stay within its bound.
The same flood with the real default bound (65,536) and 100,000 ids is the pure-table
test in tests/fabricd/test_dedup_window.py.
"""

from __future__ import annotations

import hashlib
import re

import pytest
import trio
from libp2p.abc import INetStream

from fabricd._streams import read_message_exact
from proto.codec import frame
from proto.ids import PROTOCOL_UPDATE_POOLED
from proto.messages import UpdateAck, UpdateHeader
from tests.fabricd._harness import bridge_status, wait_until
from tests.fabricd._hostile import hello, peer_info, raw_host
from tests.fabricd.test_security_control import Party
from tests.fabricd.test_security_updates import joined_with_executor

pytestmark = pytest.mark.slow

BOUND = 200
BODY = b"flood!" * 8


def _header(job: str, rnd: int, mid: str) -> UpdateHeader:
    return UpdateHeader(job_id=job, round=rnd, source_node="n", target_node="t", message_id=mid,
                        tensor_count=1, byte_length=len(BODY), sha256=hashlib.sha256(BODY).digest())


@pytest.mark.trio
async def test_a_members_id_flood_neither_re_delivers_nor_grows_the_table(mesh) -> None:
    d, executor = await joined_with_executor(
        mesh, "flood", lambda text: text.replace("[limits]\n", f"[limits]\ndedup_ids_per_member = {BOUND}\n"))
    job = "j-flood"
    target = peer_info(d.addr())
    party = Party(mesh.ca, "flooder", "cluster")
    acks: dict[str, int] = {}
    try:
        await trio.to_thread.run_sync(lambda: wait_until(
            lambda: any(c["job_id"] == "*" for c in bridge_status(d)["bridge_clients"]), 10))
        async with raw_host(party.key_pair) as host:
            await host.connect(target)
            assert (await hello(host, target.peer_id, party.cert)).accepted
            stream: INetStream | None = None

            async def send(rnd: int, mid: str) -> UpdateAck:
                nonlocal stream
                if stream is None:
                    stream = await host.new_stream(target.peer_id, [PROTOCOL_UPDATE_POOLED])
                await stream.write(frame(_header(job, rnd, mid)) + BODY)
                with trio.fail_after(60):
                    ack = await read_message_exact(stream, 1 << 16)
                assert isinstance(ack, UpdateAck), ack
                if ack.status != "ok":  # the daemon closes the stream after anything else
                    await stream.close()
                    stream = None
                kind = ack.status if ack.status != "rejected" else ack.reason.split(":")[0]
                acks[kind] = acks.get(kind, 0) + 1
                return ack

            first = f"{job}/1/update/n/t"
            assert (await send(1, first)).status == "ok"
            for i in range(2 * BOUND):  # one round: past the bound, refused - not evicted
                await send(1, f"{job}/1/flood-{i}/n/t")
            again = await send(1, first)
            assert again.status == "duplicate", again
            for i in range(2 * BOUND):  # newer rounds: they close round 1
                rnd = 2 + i // 40
                await send(rnd, f"{job}/{rnd}/flood-{i}/n/t")
            stale = await send(1, first)
            assert stale.status == "rejected" and stale.reason.startswith("stale: round 1 "), stale
        transfer = await trio.to_thread.run_sync(lambda: bridge_status(d)["transfer"])
        await trio.to_thread.run_sync(lambda: wait_until(
            lambda: sum(1 for m, _ in executor.deliveries if m.job_id == job) >= acks["ok"], timeout=30))
    finally:
        await trio.to_thread.run_sync(executor.close)
        await trio.to_thread.run_sync(d.stop)
    delivered = [m.message_id for m, _ in executor.deliveries if m.job_id == job]
    assert delivered.count(first) == 1, acks
    assert len(delivered) == len(set(delivered)) == acks["ok"], acks
    assert acks.get("quota", 0) >= BOUND, acks  # the one-round flood was refused past the bound
    assert transfer["dedup_ids"] <= BOUND, transfer
    assert re.search(r"event=update\.rejected .*reason=.?stale: round 1 ", d.log())
