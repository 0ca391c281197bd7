"""A member dripping bytes into update and control streams, against a real daemon.

One member (valid certificate) opens, on a daemon with a 160 MiB in-flight budget:
an update declaring 64 MiB whose body comes a byte every 7 s; an update header dripped a
byte every 2 s; a control request announcing a 1 MiB frame dripped a byte every 7 s; a
pooled update stream that carried one small update, then drips its next header a byte
every 7 s; and a second 64 MiB update (its share of the budget is taken by the first).
Each dripped stream must be answered "minimum rate" (after one grace for the whole stream),
the second update refused "busy" naming the member's share, and every one of them then cut (reset: the
member cannot hold a stream open by dripping on after the answer), the rate cuts counted
in ``fabricd status`` (streams_cut) and the metrics (fabricd_streams_cut_total);
meanwhile a genuine 64 MiB update from another member must be delivered without any
refusal.
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
from proto.ids import PROTOCOL_CONTROL, PROTOCOL_UPDATE, PROTOCOL_UPDATE_POOLED
from proto.messages import ControlRequest, ControlResponse, Message, UpdateAck, UpdateHeader
from tests.fabricd._harness import bridge_status, wait_until
from tests.fabricd._hostile import drip_until_cut, hello, peer_info, raw_host
from tests.fabricd.test_metrics import metrics_on, scrape, value
from tests.fabricd.test_security_control import Party
from tests.fabricd.test_security_updates import _send_update, joined_with_executor, small_budget

pytestmark = pytest.mark.slow

SIZE = 64 << 20


def _header(job: str, mid: str, size: int, digest: bytes) -> UpdateHeader:
    return UpdateHeader(job_id=job, round=1, source_node=mid.split("/")[3], target_node="x", message_id=mid,
                        tensor_count=1, byte_length=size, sha256=digest)


async def _drip(stream: INetStream, data: bytes, head: int, every: float,
                answers: dict[str, Message | None], cuts: dict[str, bool], name: str) -> None:
    """Drip ``data`` into ``stream`` (``drip_until_cut``), reading the daemon's answer."""

    async def read() -> None:
        try:
            answers[name] = await read_message_exact(stream, 1 << 16)
        except Exception:  # noqa: BLE001 - reset without an answer: recorded as None
            pass

    answers[name] = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        cuts[name] = await drip_until_cut(stream, data, head, every, timeout=90)
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_dripping_member_is_cut_and_another_members_update_goes_through(mesh) -> None:
    a = mesh.nodes["a"]
    d, executor = await joined_with_executor(mesh, "drip", lambda text: metrics_on(small_budget(text)))
    job = "j-drip"
    target = peer_info(d.addr())
    dripper = Party(mesh.ca, "dripper", "cluster")
    answers: dict[str, Message | None] = {}
    cuts: dict[str, bool] = {}
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

            # a pooled stream carries one whole small update, then its next header is dripped
            pooled = await opened(PROTOCOL_UPDATE_POOLED)
            small = os.urandom(16)
            await pooled.write(frame(_header(job, f"{job}/1/update/d0/x", 16, hashlib.sha256(small).digest())) + small)
            with trio.fail_after(60):
                first = await read_message_exact(pooled, 1 << 16)
            assert isinstance(first, UpdateAck) and first.status == "ok", first
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_drip, pooled, frame(_header(job, f"{job}/1/update/d4/x", SIZE, zero)), 2, 7.0,
                                   answers, cuts, "pooled")
                body = frame(_header(job, f"{job}/1/update/d1/x", SIZE, zero))
                nursery.start_soon(_drip, await opened(PROTOCOL_UPDATE), body, len(body), 7.0, answers, cuts,
                                   "body")
                await trio.to_thread.run_sync(lambda: wait_until(
                    lambda: bridge_status(d)["transfer"]["inflight_in_bytes"] >= SIZE, timeout=60))
                second = frame(_header(job, f"{job}/1/update/d2/x", SIZE, zero))
                nursery.start_soon(_drip, await opened(PROTOCOL_UPDATE), second, len(second), 7.0, answers,
                                   cuts, "second")
                header = frame(_header(job, f"{job}/1/update/d3/x", SIZE, zero))
                nursery.start_soon(_drip, await opened(PROTOCOL_UPDATE), header, 2, 2.0, answers, cuts, "header")
                request = frame(ControlRequest(request_id="drip-1", body={"kind": "status", "pad": "x" * (1 << 20)}))
                nursery.start_soon(_drip, await opened(PROTOCOL_CONTROL), request, 2, 7.0, answers, cuts,
                                   "control")
                result = await trio.to_thread.run_sync(
                    lambda: _send_update(a, "drip", _header(job, gid, SIZE, hashlib.sha256(genuine).digest()),
                                         genuine))
        assert result.ok, result
        await trio.to_thread.run_sync(lambda: wait_until(
            lambda: any(p == genuine for _, p in executor.deliveries), timeout=60))
        counted = await trio.to_thread.run_sync(lambda: bridge_status(d)["streams_cut"])
        samples = await trio.to_thread.run_sync(scrape, d)
    finally:
        await trio.to_thread.run_sync(executor.close)
        await trio.to_thread.run_sync(d.stop)
    log = d.log()
    assert not re.search(rf"event=update\.rejected .*{re.escape(gid)}", log), "the genuine update was refused"
    cut = {name: answers.get(name) for name in ("body", "header", "control", "pooled")}
    for name, answer in cut.items():
        assert isinstance(answer, (UpdateAck, ControlResponse)), (name, answer)
        assert "minimum rate" in answer.reason and "grace" in answer.reason, (name, answer)
    second_answer = answers.get("second")
    assert isinstance(second_answer, UpdateAck) and second_answer.reason.startswith("busy: cluster 'dripper'"), \
        second_answer
    assert "share of limits.max_inflight_bytes" in second_answer.reason
    assert cuts == dict.fromkeys(("body", "second", "header", "control", "pooled"), True), cuts
    assert counted["update"] >= 3 and counted["control"] >= 1, counted
    for protocol in ("update", "control"):
        assert value(samples, "fabricd_streams_cut_total", protocol=protocol) == counted[protocol], samples
