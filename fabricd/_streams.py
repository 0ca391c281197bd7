"""Helpers for libp2p streams: exact reads, frame I/O, and handler wrapping.

py-libp2p traps handled here: ``read()`` raises ``StreamEOF`` at the end (never b""),
returns up to n bytes, and an uncaught exception in a stream handler takes the whole
host down - so every handler runs inside ``safe_handler``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.abc import INetStream
from libp2p.network.stream.exceptions import StreamEOF, StreamError, StreamReset

from fabricd.admission import RateFloor
from fedcore.logs import get_logger
from proto.codec import ExactReader, frame, read_frame
from proto.errors import ProtocolError
from proto.messages import Message

log = get_logger("fabricd.streams")

Handler = Callable[[INetStream], Awaitable[None]]

#: seconds a peer has to end a stream after the daemon's last answer before it is reset
LINGER_SECONDS = 2.0
LINGER_READ = 1 << 20

STREAM_ERRORS: tuple[type[BaseException], ...] = (StreamError, StreamEOF, StreamReset)


def remote_peer(stream: INetStream) -> str:
    """The Noise-authenticated peer id of the other end of ``stream``."""
    return str(stream.muxed_conn.peer_id)


def stream_reader(stream: INetStream) -> ExactReader:
    """An ExactReader whose ``read_exactly(n)`` returns fewer than n bytes only at EOF."""

    async def receive(n: int) -> bytes:
        try:
            return await stream.read(n)
        except StreamEOF:
            return b""

    return ExactReader(receive)


async def read_message(reader: ExactReader, max_size: int) -> Message:
    return await read_frame(reader.read_exactly, max_size)


async def read_exactly(stream: INetStream, n: int) -> bytes:
    """Exactly ``n`` bytes, or fewer only at EOF; never reads past them (unlike ExactReader)."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        try:
            data = await stream.read(n - got)
        except StreamEOF:
            break
        parts.append(data)
        got += len(data)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def read_message_exact(stream: INetStream, max_size: int) -> Message:
    """One length-prefixed message, reading nothing beyond it (a raw body may follow)."""

    async def exact(n: int) -> bytes:
        return await read_exactly(stream, n)

    return await read_frame(exact, max_size)


class FrameTooSlow(ProtocolError):
    """A frame did not keep the minimum rate (or did not start in time); says which."""


async def read_message_floored(stream: INetStream, max_size: int, floor: RateFloor,
                               first_byte_wait: float | None = None) -> Message:
    """One length-prefixed message that must arrive at ``floor``'s minimum rate after its
    grace - so its whole deadline follows from its declared length - reading nothing
    beyond it. With ``first_byte_wait`` (an idle pooled stream), the floor's clock starts
    at the frame's first byte, which may take that long to come.

    FrameTooSlow names the rate, the bytes and the seconds; EOFError if the stream ends
    before a frame starts."""
    got = 0

    async def exact(n: int) -> bytes:
        nonlocal got
        parts: list[bytes] = []
        have = 0
        while have < n:
            waiting_first = got == 0 and first_byte_wait is not None
            wait = first_byte_wait if waiting_first else floor.wait_budget(got, 3600.0)
            with trio.move_on_after(wait) as scope:  # type: ignore[arg-type]
                try:
                    data = await stream.read(n - have)
                except StreamEOF:
                    break
            if scope.cancelled_caught:
                if waiting_first:
                    floor.idle = True
                    raise FrameTooSlow(f"no frame started within {first_byte_wait:g} s")
                raise FrameTooSlow(floor.too_slow(got) or f"{got} bytes of a frame in {wait:.1f} s")
            if waiting_first:
                floor.restart()
            parts.append(data)
            have += len(data)
            got += len(data)
            too_slow = floor.too_slow(got)
            if too_slow is not None:
                raise FrameTooSlow(too_slow)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    return await read_frame(exact, max_size)


async def write_message(stream: INetStream, msg: Message) -> None:
    await stream.write(frame(msg))


async def reset_quietly(stream: INetStream) -> None:
    try:
        await stream.reset()
    except Exception:  # noqa: BLE001 - the stream is already broken; nothing to report
        pass


async def close_quietly(stream: INetStream) -> None:
    try:
        await stream.close()
    except Exception:  # noqa: BLE001 - as reset_quietly: a broken stream has nothing to say
        pass


async def end_stream(stream: INetStream, linger: float = LINGER_SECONDS) -> None:
    """Close our side after our last answer and give the peer ``linger`` s to end its own
    (what it still sends is read and dropped: an early ack reaches a sender mid-body), then
    reset the stream: nobody holds a half-closed stream open by dripping into it."""
    await close_quietly(stream)
    with trio.move_on_after(linger):
        try:
            while True:
                await stream.read(LINGER_READ)
        except Exception:  # noqa: BLE001 - the end (EOF), a reset, a closed muxer: over
            return
    await reset_quietly(stream)


def safe_handler(name: str, handler: Handler) -> Handler:
    """Wrap ``handler`` so that no exception escapes into libp2p (which would stop the host)."""

    async def wrapped(stream: INetStream) -> None:
        try:
            await handler(stream)
        except trio.Cancelled:
            raise
        except STREAM_ERRORS as exc:
            log.info("stream.aborted", protocol=name, peer=_peer_or_unknown(stream),
                     reason=f"{type(exc).__name__}: {exc}")
            await reset_quietly(stream)
        except BaseException as exc:  # noqa: BLE001 - last line of defence for the host
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            log.error("handler.crashed", protocol=name, peer=_peer_or_unknown(stream),
                      reason=f"{type(exc).__name__}: {exc}")
            await reset_quietly(stream)

    return wrapped


def _peer_or_unknown(stream: Any) -> str:
    try:
        return remote_peer(stream)
    except Exception:  # noqa: BLE001 - only for a log line: a dead connection has no peer
        return "unknown"
