"""A non-member flooding streams nobody reads, against a real daemon.

The stranger connects (Noise, no certificate), opens update and control streams - the
daemon holds them waiting for a membership verdict that never comes - and pushes 48 MiB
into each, ignoring yamux flow control (as a hostile implementation would: its send
window is forced open). py-libp2p alone buffers all of it (the issue measured 101 ->
764 MiB of RSS); fabricd._muxguard cuts the connection once the stranger has a small
allowance of unread bytes buffered. The daemon's RSS is sampled throughout.
"""

from __future__ import annotations

import threading

import pytest
import trio

from proto.ids import PROTOCOL_CONTROL, PROTOCOL_UPDATE
from tests.fabricd._harness import connected_fast, wait_until
from tests.fabricd._hostile import is_connected, peer_info, raw_host
from tests.fabricd._transfer_load import rss_bytes

pytestmark = pytest.mark.slow

MIB = 1 << 20
PER_STREAM = 48 * MIB


@pytest.mark.trio
async def test_a_strangers_unread_flood_moves_rss_by_a_few_mib(mesh) -> None:
    a = mesh.nodes["a"]
    d = await trio.to_thread.run_sync(lambda: mesh.add("buffer", [a.addr()]))
    await trio.to_thread.run_sync(lambda: wait_until(lambda: "buffer" in connected_fast(a), timeout=60))
    assert d.proc is not None
    pid = d.proc.pid
    # A daemon on a loaded machine may still be finishing start-up, and serving members
    # (the update path's first use) allocates too: one member probe first, then settle.
    await trio.to_thread.run_sync(lambda: a.probe("buffer", 1 << 20))
    await trio.sleep(2)
    baseline = max(rss_bytes(pid) for _ in range(3))
    peak = [baseline]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_bytes(pid))
            stop.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    target = peer_info(d.addr())
    pushed = [0]
    try:
        async with raw_host() as host:
            await host.connect(target)

            async def flood(protocol: str) -> None:
                try:
                    stream = await host.new_stream(target.peer_id, [protocol])  # type: ignore[list-item]
                    stream.muxed_stream.send_window = 1 << 40  # type: ignore[attr-defined]
                    block = b"\x55" * MIB
                    for _ in range(PER_STREAM // MIB):
                        await stream.write(block)
                        pushed[0] += MIB
                except Exception:  # noqa: BLE001 - cut by the daemon: what this test wants
                    return

            with trio.move_on_after(60):
                async with trio.open_nursery() as nursery:
                    for protocol in (PROTOCOL_UPDATE, PROTOCOL_UPDATE, PROTOCOL_CONTROL, PROTOCOL_UPDATE):
                        nursery.start_soon(flood, protocol)
            await trio.to_thread.run_sync(lambda: wait_until(
                lambda: not is_connected(host, target.peer_id), timeout=30))
        stop.set()  # the flood is over: what the member probe below allocates is not its
        # The daemon still serves members.
        await trio.to_thread.run_sync(lambda: a.probe("buffer", 1 << 20))
    finally:
        stop.set()
        sampler.join(5)
        grown = peak[0] - baseline
        await trio.to_thread.run_sync(d.stop)
    log = d.log()
    assert "event=mux.connection_cut" in log and "before proving membership" in log, log[-3000:]
    assert grown <= 12 * MIB, f"daemon RSS grew {grown / MIB:.1f} MiB while a stranger pushed {pushed[0] / MIB:.0f} MiB"
