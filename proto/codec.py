"""Encode and decode daemon messages: msgpack maps with `v` and `type`, strictly validated.

Frames on a stream are a u32 big-endian length followed by the msgpack body. Sizes are
checked before any unpacking; nothing is ever unpickled.
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable

from proto._schema import from_map, pack, unpack_limited
from proto.errors import MalformedFrame, MessageTooLarge, StreamClosed
from proto.ids import MAX_MESSAGE_BYTES
from proto.messages import Message

LENGTH_PREFIX = struct.Struct(">I")

ReadExactly = Callable[[int], Awaitable[bytes]]


def encode(msg: Message, *, max_size: int = MAX_MESSAGE_BYTES) -> bytes:
    """The msgpack bytes of `msg`; MessageTooLarge if they exceed `max_size`."""
    if not isinstance(msg, Message):
        raise TypeError(f"expected a proto.messages.Message, got {type(msg).__name__}")
    data = pack(msg.to_map())
    if len(data) > max_size:
        raise MessageTooLarge(
            f"{msg.TYPE} encodes to {len(data)} bytes, over the limit of {max_size} bytes"
        )
    return data


def decode(data: bytes | bytearray | memoryview, *, max_size: int = MAX_MESSAGE_BYTES) -> Message:
    """The valid message in `data`, or a ProtocolError subclass saying what was wrong."""
    msg = from_map(Message.REGISTRY, unpack_limited(data, max_size))
    assert isinstance(msg, Message)
    return msg


def frame(msg: Message, *, max_size: int = MAX_MESSAGE_BYTES) -> bytes:
    """u32 big-endian length + encode(msg)."""
    body = encode(msg, max_size=max_size)
    return LENGTH_PREFIX.pack(len(body)) + body


def parse_length_prefix(prefix: bytes, max_size: int, *, what: str = "frame") -> int:
    """The length a 4-byte prefix announces (of a frame's body, of a bridge header);
    MalformedFrame if truncated, MessageTooLarge if over `max_size`."""
    if len(prefix) != LENGTH_PREFIX.size:
        raise MalformedFrame(f"truncated {what} length prefix ({len(prefix)} of 4 bytes)")
    (length,) = LENGTH_PREFIX.unpack(prefix)
    if length > max_size:
        raise MessageTooLarge(
            f"{what} length prefix announces {length} bytes, over the limit of {max_size} bytes"
        )
    return int(length)


async def read_frame(read_exactly: ReadExactly, max_size: int = MAX_MESSAGE_BYTES) -> Message:
    """Read one length-prefixed message. `read_exactly(n)` returns n bytes (fewer = EOF).

    An oversized length prefix is rejected before the body is read. Raises StreamClosed
    (an EOFError) if the stream ends cleanly before the first byte of the frame, and
    MalformedFrame if it ends inside the frame.
    """
    prefix = await read_exactly(LENGTH_PREFIX.size)
    if not prefix:
        raise StreamClosed("stream closed before a frame")
    length = parse_length_prefix(prefix, max_size)
    body = await read_exactly(length)
    if len(body) != length:
        raise MalformedFrame(f"truncated frame: got {len(body)} of {length} bytes")
    return decode(body, max_size=max_size)


class ExactReader:
    """Buffered reads over any `receive(max_bytes) -> bytes` coroutine (trio
    `stream.receive_some`, libp2p `stream.read`); b"" from `receive` means EOF.

    Each receive asks for at most MAX_RECEIVE bytes so a large read never makes the
    transport allocate one huge buffer.
    """

    MAX_RECEIVE = 4 * 1024 * 1024

    def __init__(self, receive: Callable[[int], Awaitable[bytes]], chunk: int = 65536) -> None:
        self._receive = receive
        self._chunk = chunk
        self._buf = bytearray()
        self.eof = False

    async def read_exactly(self, n: int) -> bytes:
        """Exactly `n` bytes, or fewer only if the stream ended first."""
        while len(self._buf) < n and not self.eof:
            want = min(max(self._chunk, n - len(self._buf)), self.MAX_RECEIVE)
            data = await self._receive(want)
            if not data:
                self.eof = True
                break
            self._buf += data
        return self._take(n)

    async def read_some(self, max_bytes: int) -> bytes:
        """Up to `max_bytes` (buffered bytes first); b"" only at end of stream."""
        if not self._buf and not self.eof:
            data = await self._receive(min(max_bytes, self.MAX_RECEIVE))
            if not data:
                self.eof = True
            return bytes(data)
        return self._take(max_bytes)

    def take_buffered(self, n: int) -> bytes:
        """Up to ``n`` bytes already buffered, without reading (b"" if none)."""
        return self._take(n) if self._buf else b""

    def _take(self, n: int) -> bytes:
        if n >= len(self._buf):
            out = bytes(self._buf)
            self._buf.clear()
            return out
        with memoryview(self._buf) as view:
            out = bytes(view[:n])
        del self._buf[:n]
        return out
