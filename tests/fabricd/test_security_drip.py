"""A member dripping bytes into update and control streams, against a real daemon.

One member (valid certificate) opens, on a daemon with a 160 MiB in-flight budget:
an update declaring 64 MiB whose body comes a byte every 6 s; an update header dripped a
byte every 2 s; a control request dripped the same way; and a second 64 MiB update
(its share of the budget is taken by the first). Each dripped stream must be cut for its
rate ("minimum rate", after one grace for the whole stream), the second update refused
"busy" naming the member's share; meanwhile a genuine 64 MiB update from another member
must be delivered without any refusal.
"""

from __future__ import annotations

import hashlib
import os
import re

import pytest
import trio
from libp2p.abc import IHost, INetStream

from fabricd._streams import read_message_exact
from proto.codec import frame
from proto.ids import PROTOCOL_CONTROL, PROTOCOL_UPDATE
from proto.messages import ControlRequest, ControlResponse, Message, UpdateAck, UpdateHeader
from tests.fabricd._harness import bridge_status, wait_until
from tests.fabricd._hostile import hello, peer_info, raw_host
from tests.fabricd.test_security_control import Party
from tests.fabricd.test_security_updates import _send_update, joined_with_executor, small_budget

pytestmark = pytest.mark.slow

SIZE = 64 << 20


def _header(job: str, mid: str, size: int, digest: bytes) -> UpdateHeader:
    return UpdateHeader(job_id=job, round=1, source_node=mid.split("/")[3], target_node="x", message_id=mid,
                        tensor_count=1, byte_length=size, sha256=digest)


async def _drip(stream: INetStream, data: bytes, head: int, every: float,
                answers: dict[str, Message | None], name: str) -> None:
    """Write ``data[:head]``, then the rest of ``data`` and zero bytes after it, a byte
    every ``every`` s, until the daemon answers."""

    async def write() -> None:
        try:
            await stream.write(data[:head])
            rest = data[head:]
            while True:
                await trio.sleep(every)
                await stream.write(rest[:1] or b"\0")
                rest = rest[1:]
        except Exception:  # noqa: BLE001 - the daemon cut the stream: that is the point
            return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write)
        answers[name] = None
        with trio.move_on_after(90):
            try:
                answers[name] = await read_message_exact(stream, 1 << 16)
            except Exception:  # noqa: BLE001 - reset without an answer: recorded as None
                pass
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_dripping_member_is_cut_and_another_members_update_goes_through(mesh) -> None:
    a = mesh.nodes["a"]
    d, executor = await joined_with_executor(mesh, "drip", small_budget)
    job = "j-drip"
    target = peer_info(d.addr())
    dripper = Party(mesh.ca, "dripper", "cluster")
    answers: dict[str, Message | None] = {}
    genuine = os.urandom(SIZE)
    gid = f"{job}/1/update/g/x"
    zero = hashlib.sha256(b"\0" * SIZE).digest()
    try:
        await trio.to_thread.run_sync(lambda: wait_until(
            lambda: any(c["job_id"] == "*" for c in bridge_status(d)["bridge_clients"]), 10))
        async with raw_host(dripper.key_pair) as host:
            await host.connect(target)
            assert (await hello(host, target.peer_id, dripper.cert)).accepted

            async def opened(protocol: str, h: IHost = host) -> INetStream:
                return await h.new_stream(target.peer_id, [protocol])  # type: ignore[list-item]

            async with trio.open_nursery() as nursery:
                body = frame(_header(job, f"{job}/1/update/d1/x", SIZE, zero))
                nursery.start_soon(_drip, await opened(PROTOCOL_UPDATE), body, len(body), 6.0, answers, "body")
                await trio.to_thread.run_sync(lambda: wait_until(
                    lambda: bridge_status(d)["transfer"]["inflight_in_bytes"] >= SIZE, timeout=60))
                second = frame(_header(job, f"{job}/1/update/d2/x", SIZE, zero))
                nursery.start_soon(_drip, await opened(PROTOCOL_UPDATE), second, len(second), 6.0, answers, "second")
                header = frame(_header(job, f"{job}/1/update/d3/x", SIZE, zero))
                nursery.start_soon(_drip, await opened(PROTOCOL_UPDATE), header, 2, 2.0, answers, "header")
                request = frame(ControlRequest(request_id="drip-1", body={"kind": "status", "pad": "x" * 64}))
                nursery.start_soon(_drip, await opened(PROTOCOL_CONTROL), request, 2, 2.0, answers, "control")
                result = await trio.to_thread.run_sync(
                    lambda: _send_update(a, "drip", _header(job, gid, SIZE, hashlib.sha256(genuine).digest()),
                                         genuine))
        assert result.ok, result
        await trio.to_thread.run_sync(lambda: wait_until(
            lambda: any(p == genuine for _, p in executor.deliveries), timeout=60))
    finally:
        await trio.to_thread.run_sync(executor.close)
        await trio.to_thread.run_sync(d.stop)
    log = d.log()
    assert not re.search(rf"event=update\.rejected .*{re.escape(gid)}", log), "the genuine update was refused"
    cut = {name: answers.get(name) for name in ("body", "header", "control")}
    for name, answer in cut.items():
        assert isinstance(answer, (UpdateAck, ControlResponse)), (name, answer)
        assert "minimum rate" in answer.reason and "grace" in answer.reason, (name, answer)
    second_answer = answers.get("second")
    assert isinstance(second_answer, UpdateAck) and second_answer.reason.startswith("busy: cluster 'dripper'"), \
        second_answer
    assert "share of limits.max_inflight_bytes" in second_answer.reason
