"""A TCP forwarder that behaves like a long, narrow link: one-way delay plus a rate limit.

    python bench/_linkproxy.py TARGET_PORT DELAY_MS RATE_MBIT STATS_FILE [HOST [PORT]]

Listens on HOST (127.0.0.1) and PORT (any; the port goes to stdout), forwards every connection to
127.0.0.1:TARGET_PORT, and in each direction holds every piece for DELAY_MS after the
link has serialized it at RATE_MBIT, so a request/response takes 2 x DELAY_MS plus
transmission. At most QUEUE_BYTES wait per direction (a bottleneck buffer), so a sender
that outruns the link is slowed by TCP flow control, as on a real path. This machine has
no netem; both the daemons and the raw TCP baseline go through the same forwarder, so
their ratio is what the link allows. Total bytes forwarded go to STATS_FILE.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import trio

PIECE = 64 * 1024
QUEUE_BYTES = 4 * 1024 * 1024


class Link:
    def __init__(self, delay: float, bytes_per_s: float) -> None:
        self.delay = delay
        self.bytes_per_s = bytes_per_s
        self.forwarded = 0

    async def pump(self, src: trio.SocketStream, dst: trio.SocketStream) -> None:
        send, receive = trio.open_memory_channel[tuple[float, bytes]](QUEUE_BYTES // PIECE)
        free_at = 0.0

        async def reader() -> None:
            nonlocal free_at
            async with send:
                while True:
                    try:
                        data = await src.receive_some(PIECE)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        return
                    if not data:
                        return
                    now = trio.current_time()
                    free_at = max(now, free_at) + len(data) / self.bytes_per_s
                    await send.send((free_at + self.delay, data))

        async def writer() -> None:
            async with receive:
                async for due, data in receive:
                    await trio.sleep_until(due)
                    try:
                        await dst.send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        return
                    self.forwarded += len(data)
            try:
                await dst.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError, AttributeError):
                pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            nursery.start_soon(writer)


async def main(target: int, delay_ms: float, rate_mbit: float, stats: Path, host: str = "127.0.0.1",
               port: int = 0) -> None:
    link = Link(delay_ms / 1000, rate_mbit * 1e6 / 8)

    async def handle(client: trio.SocketStream) -> None:
        try:
            upstream = await trio.open_tcp_stream("127.0.0.1", target)
        except OSError:
            await client.aclose()
            return
        async with client, upstream:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(link.pump, client, upstream)
                nursery.start_soon(link.pump, upstream, client)

    async def report() -> None:
        while True:
            stats.write_text(json.dumps({"forwarded_bytes": link.forwarded}))
            await trio.sleep(0.2)

    listeners = await trio.open_tcp_listeners(port, host=host)
    print(listeners[0].socket.getsockname()[1], flush=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(report)
        await trio.serve_listeners(handle, listeners)


def start(target_port: int, delay_ms: float, rate_mbit: float, stats: Path, host: str = "127.0.0.1",
          port: int = 0) -> tuple[subprocess.Popen[str], int]:
    """Run a forwarder in its own process (its own core and GIL): (process, listening port)."""
    proc = subprocess.Popen([sys.executable, __file__, str(target_port), str(delay_ms), str(rate_mbit),
                             str(stats), host, str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def forwarded(stats: Path) -> int:
    try:
        return int(json.loads(stats.read_text())["forwarded_bytes"])
    except (OSError, ValueError, KeyError):
        return 0


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), Path(sys.argv[4]),
             sys.argv[5] if len(sys.argv) > 5 else "127.0.0.1", int(sys.argv[6]) if len(sys.argv) > 6 else 0)
