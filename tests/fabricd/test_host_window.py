"""yamux credit as fabricd tunes it (fabricd._host.tune_yamux): a reader grants the sender
more window once half of it was read (go-yamux's rule), not a WINDOW_UPDATE frame after
every read - small messages cost one frame each way, not two (and through a relay,
where the inner session's update crosses the hop too, four) - and a body larger than the
window still flows."""

from __future__ import annotations

import struct
from typing import Any

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo
from libp2p.stream_muxer.yamux import yamux as _yamux

from fabricd._host import YAMUX_WINDOW, open_host_stack
from fabricd._streams import read_exactly

PROTOCOL = "/test/window/1"


def _count_credit(conn: Any, granted: list[int]) -> None:
    """Record every WINDOW_UPDATE frame ``conn`` writes that grants credit (not a stream's
    SYN/ACK/FIN/RST: those carry flags)."""
    write = conn._write_frame

    async def counted(data: bytes) -> None:
        _, typ, flags, _, length = struct.unpack(_yamux.YAMUX_HEADER_FORMAT, data[:_yamux.HEADER_SIZE])
        if typ == _yamux.TYPE_WINDOW_UPDATE and flags == 0:
            granted.append(length)
        await write(data)

    conn._write_frame = counted


@pytest.mark.trio
async def test_small_messages_cost_no_window_update_and_a_large_body_still_flows() -> None:
    key = create_new_key_pair
    listen = ["/ip4/127.0.0.1/tcp/0"]
    async with open_host_stack(key(), listen, None, 1.0) as a, open_host_stack(key(), listen, None, 1.0) as b:
        got: list[int] = []
        done = trio.Event()
        expect = 100 * 100 + YAMUX_WINDOW + YAMUX_WINDOW // 2

        async def handler(stream: Any) -> None:
            while sum(got) < expect:
                got.append(len(await read_exactly(stream, min(100 if sum(got) < 10_000 else 1 << 20,
                                                              expect - sum(got)))))
            done.set()

        b.host.set_stream_handler(PROTOCOL, handler)
        await a.host.connect(PeerInfo(b.host.get_id(), b.host.get_addrs()))
        granted: list[int] = []
        for conn in b.host.get_network().get_connections(a.host.get_id()):
            _count_credit(conn.muxed_conn, granted)
        stream = await a.host.new_stream(b.host.get_id(), [PROTOCOL])
        for _ in range(100):
            await stream.write(b"x" * 100)
        with trio.fail_after(30):
            while sum(got) < 10_000:
                await trio.sleep(0.01)
        assert granted == [], f"{len(granted)} window updates for 100 small messages"

        # 1.5 windows: the sender waits for credit once, and gets it
        with trio.fail_after(60):
            await stream.write(b"y" * (YAMUX_WINDOW + YAMUX_WINDOW // 2))
            await done.wait()
        assert granted, "a body larger than the window went through without a window update?"
        await stream.close()
