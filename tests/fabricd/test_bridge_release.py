"""A SendUpdate passed as a memfd: its answer goes to the executor before the daemon
unmaps the payload (unmapping 64 MiB takes 10-20 ms here), and the unmapping runs in a
worker thread, not on the event loop; the outgoing budget comes back after it."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import blake3
import pytest
import trio

from fabricd import bridge as fabricd_bridge
from fabricd._sender import FillingBuffer
from fabricd.bridge import BridgeServer
from fabricd.daemon import Daemon
from proto.bridge import BridgeClient, SendResult, SendUpdate
from proto.messages import UpdateHeader

SIZE = 2 * 1024 * 1024  # over FD_MIN_BYTES: passed as a memfd


class _Backend:
    def __init__(self) -> None:
        self.sent: list[int] = []

    async def send_update(self, target: str, header: UpdateHeader, payload: Any) -> SendResult:
        self.sent.append(len(payload))
        return SendResult(message_id=header.message_id, ok=True, reason="", bytes=len(payload))

    def status(self) -> dict[str, Any]:
        return {}


@pytest.mark.trio
async def test_the_answer_goes_before_the_payload_is_unmapped_off_the_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    answered = threading.Event()
    seen: dict[str, Any] = {}
    unmap = fabricd_bridge._Unmapping.unmap

    def watched_unmap(self: Any) -> None:
        if "answered_first" not in seen:  # the first call: the one that unmaps
            seen["answered_first"] = answered.wait(10)
            seen["thread"] = threading.get_ident()
        unmap(self)

    monkeypatch.setattr(fabricd_bridge._Unmapping, "unmap", watched_unmap)
    path = Path(tempfile.mkdtemp(prefix="fpd-")) / "bridge.sock"
    backend = _Backend()
    server = BridgeServer(path, backend=backend, cluster_id="a",  # type: ignore[arg-type]
                          max_payload=4 * SIZE, max_outgoing_bytes=4 * SIZE)
    body = os.urandom(SIZE)
    msg = SendUpdate(target_cluster="b", job_id="j", round=1, source_node="s", target_node="t",
                     message_id="j-0", tensor_count=1, byte_length=SIZE, sha256=b"",
                     blake3=blake3.blake3(body).digest())

    def executor() -> Any:
        with BridgeClient(str(path), role="executor", cluster_id="a", job_id="j", timeout=30) as client:
            client.send_update(msg, body)
            reply, _ = client.recv()
            answered.set()
            return reply

    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        loop_thread = threading.get_ident()
        reply = await trio.to_thread.run_sync(executor)
        while server.outgoing.used:  # the budget comes back once it is unmapped
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert isinstance(reply, SendResult) and reply.ok and backend.sent == [SIZE]
    assert seen["answered_first"], "the payload was unmapped before the executor had its answer"
    assert seen["thread"] != loop_thread, "the payload was unmapped on the event loop"


@pytest.mark.trio
async def test_a_send_stalled_on_the_network_ends_when_its_client_leaves_mid_payload() -> None:
    """A cut-through send blocked anywhere (a stalled stream write, a busy peer's slot)
    stops once its bridge client hangs up: refused, nothing delivered, and at once, so the
    bridge frees its share of the outgoing budget (CI once waited out 30 s for it)."""
    stalled = trio.Event()

    async def send_checked(*_: Any) -> SendResult:
        stalled.set()
        await trio.sleep_forever()  # a network write that never drains
        raise AssertionError("unreachable")

    daemon = SimpleNamespace(_send_checked=send_checked,
                             _refused=lambda header, reason: Daemon._refused(daemon, header, reason))  # type: ignore[arg-type]
    body = FillingBuffer(bytearray(SIZE))
    header = UpdateHeader(job_id="j", round=1, source_node="s", target_node="t", message_id="j-1",
                          tensor_count=1, byte_length=SIZE, blake3=blake3.blake3(bytes(SIZE)).digest())
    got: list[SendResult] = []

    async def send() -> None:
        got.append(await Daemon.send_update(daemon, "b", header, body))  # type: ignore[arg-type]

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            await stalled.wait()
            body.advance(SIZE // 2)
            body.fail("ConnectionResetError: the client hung up")
    assert len(got) == 1 and not got[0].ok and not got[0].retry, got
    assert "did not arrive in full" in got[0].reason and "nothing was delivered" in got[0].reason
    assert "hung up" in got[0].reason
