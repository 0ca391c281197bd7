"""The local bridge between fabricd and its executor/CLI: a Unix socket (mode 0600).

Frame = u32 big-endian header length + msgpack header map (`v`, `type`, fields...,
`payload_length`) + `payload_length` raw bytes. Only SendUpdate and Delivery carry a
payload (the safetensors body, `payload_length == byte_length`); every other type has
`payload_length == 0`. An executor that said `answers_deliveries` in its Hello answers
each Delivery with a DeliveryResult. Blocking helpers serve a plain socket, async ones a
trio stream.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from proto._bridge_messages import (
    BridgeMessage,
    ControlDelivery,
    ControlReply,
    ControlResult,
    ControlSend,
    Delivery,
    DeliveryResult,
    Error,
    Hello,
    ProbeReply,
    ProbeRequest,
    SendResult,
    SendUpdate,
    StatusReply,
    StatusRequest,
)
from proto._schema import I64_MAX, Int, from_map, pack, unpack_limited
from proto.codec import LENGTH_PREFIX as HEADER_PREFIX
from proto.codec import ExactReader, parse_length_prefix
from proto.errors import InvalidMessage, MalformedFrame, MessageTooLarge, StreamClosed
from proto.ids import MAX_BRIDGE_HEADER_BYTES

PAYLOAD_LENGTH = "payload_length"
#: a payload up to this size is written together with its frame's header
COALESCE_BYTES = 64 * 1024

# ---- framing ----------------------------------------------------------------------------

def bridge_header(msg: BridgeMessage, payload_length: int,
                  *, max_header: int = MAX_BRIDGE_HEADER_BYTES) -> bytes:
    """The length prefix + header of a frame whose payload has `payload_length` bytes."""
    if not isinstance(msg, BridgeMessage):
        raise TypeError(f"expected a proto.bridge message, got {type(msg).__name__}")
    _check_payload_length(msg, payload_length)
    header = msg.to_map()
    header[PAYLOAD_LENGTH] = payload_length
    data = pack(header)
    if len(data) > max_header:
        raise MessageTooLarge(
            f"bridge {msg.TYPE} header is {len(data)} bytes, over the limit of {max_header}"
        )
    return HEADER_PREFIX.pack(len(data)) + data


def decode_bridge_header(data: bytes, max_payload: int,
                         *, max_header: int = MAX_BRIDGE_HEADER_BYTES
                         ) -> tuple[BridgeMessage, int]:
    """(message, payload_length) from a header (without its prefix); ProtocolError if bad."""
    obj = unpack_limited(data, max_header)
    if not isinstance(obj, dict):
        raise MalformedFrame(f"bridge header must be a msgpack map, got {type(obj).__name__}")
    msg = from_map(BridgeMessage.REGISTRY, obj, extra=frozenset({PAYLOAD_LENGTH}))
    assert isinstance(msg, BridgeMessage)
    if PAYLOAD_LENGTH not in obj:
        raise InvalidMessage(f"{msg.TYPE}: missing field '{PAYLOAD_LENGTH}'", field=PAYLOAD_LENGTH)
    length = Int(0, I64_MAX).check(PAYLOAD_LENGTH, obj[PAYLOAD_LENGTH])
    if length > max_payload:
        raise MessageTooLarge(
            f"bridge {msg.TYPE} payload of {length} bytes is over the limit of {max_payload}"
        )
    _check_payload_length(msg, length)
    return msg, length


def _check_payload_length(msg: BridgeMessage, length: int) -> None:
    if msg.CARRIES_PAYLOAD:
        expected = msg.byte_length  # type: ignore[attr-defined]
        if length != expected:
            raise InvalidMessage(
                f"{msg.TYPE}: payload_length {length} differs from byte_length {expected}",
                field=PAYLOAD_LENGTH,
            )
    elif length != 0:
        raise InvalidMessage(
            f"{msg.TYPE} carries no payload, but payload_length is {length}", field=PAYLOAD_LENGTH
        )


# ---- blocking sockets -------------------------------------------------------------------

#: Socket buffers for bridge connections: update payloads are MiBs, and the default
#: ~200 KiB makes every 64 MiB payload ~300 wake-ups of the daemon's event loop.
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024


def tune_socket(sock: Any) -> None:
    """Larger send/receive buffers on a bridge socket (best effort: the kernel may cap them)."""
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        except OSError:
            pass


def _recv_exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            break
        got += k
    view.release()
    del buf[got:]
    return buf


def _recv_payload(sock: socket.socket, n: int) -> bytes:
    """Up to ``n`` bytes as one ``bytes`` (fewer only if the peer closed). On a blocking
    socket one ``recv(n, MSG_WAITALL)`` lets the kernel copy straight into the result: no
    zero-filled buffer and no second copy (a 64 MiB delivery costs the executor ~35 ms of
    CPU instead of ~95). A short read (a socket with a timeout, a signal) goes on into a
    buffer and is joined (one copy, as before)."""
    first = sock.recv(n, socket.MSG_WAITALL)
    if len(first) == n or not first:
        return first
    return b"".join((first, _recv_exactly(sock, n - len(first))))


def connect_bridge(path: str, hello: Hello, timeout: float | None = None) -> socket.socket:
    """A socket connected to fabricd's bridge at `path` that has sent `hello`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    tune_socket(sock)
    try:
        sock.connect(path)
        send_bridge(sock, hello)
    except OSError as exc:
        sock.close()
        raise ConnectionError(f"cannot connect to the fabricd bridge at {path}: {exc} (is "
                              "fabricd running with this config?)") from exc
    return sock


def send_bridge(sock: socket.socket, msg: BridgeMessage, payload: bytes = b"") -> None:
    """Write one frame to a blocking socket."""
    head = bridge_header(msg, len(payload))
    if len(payload) <= COALESCE_BYTES:
        sock.sendall(head + payload)  # one write, one wake-up of the reader
        return
    sock.sendall(head)
    sock.sendall(payload)


def recv_bridge(sock: socket.socket, max_payload: int,
                *, max_header: int = MAX_BRIDGE_HEADER_BYTES) -> tuple[BridgeMessage, bytes]:
    """Read one frame from a blocking socket: (message, payload).

    StreamClosed (an EOFError and a ConnectionError) if the peer closed before a frame;
    MalformedFrame if it closed inside one; other ProtocolErrors for bad content.
    Oversized lengths are refused before reading.
    """
    prefix = _recv_exactly(sock, HEADER_PREFIX.size)
    if not prefix:
        raise StreamClosed("bridge closed by the other side")
    header = _recv_exactly(sock, parse_length_prefix(bytes(prefix), max_header, what="bridge header"))
    msg, length = decode_bridge_header(bytes(header), max_payload, max_header=max_header)
    payload = _recv_payload(sock, length) if length else b""
    if len(payload) != length:
        raise MalformedFrame(f"bridge {msg.TYPE}: payload ended after {len(payload)} of {length}")
    return msg, payload


# ---- trio (or any async stream with send_all / receive_some) ----------------------------

class BridgeStream:
    """A trio stream speaking bridge frames: `await send(msg, payload)`, `await recv()`."""

    def __init__(self, stream: Any, max_payload: int,
                 *, max_header: int = MAX_BRIDGE_HEADER_BYTES) -> None:
        self.stream = stream
        self.max_payload = max_payload
        self.max_header = max_header
        self._reader = ExactReader(stream.receive_some)

    async def send(self, msg: BridgeMessage, payload: bytes | bytearray | memoryview = b"") -> None:
        head = bridge_header(msg, len(payload))
        if len(payload) <= COALESCE_BYTES:
            await self.stream.send_all(head + payload)  # one write, one wake-up of the reader
            return
        await self.stream.send_all(head)
        await self.stream.send_all(payload)

    async def recv(self) -> tuple[BridgeMessage, bytes]:
        """One whole frame; the same errors as `recv_bridge`."""
        msg, length = await self.recv_header()
        payload = await self._reader.read_exactly(length) if length else b""
        if len(payload) != length:
            raise MalformedFrame(f"bridge {msg.TYPE}: payload ended after {len(payload)} of {length}")
        return msg, payload

    async def recv_header(self) -> tuple[BridgeMessage, int]:
        """The next frame's message and payload length; the payload is still unread, so
        the caller can wait (backpressure) before taking it with ``recv_payload``."""
        prefix = await self._reader.read_exactly(HEADER_PREFIX.size)
        if not prefix:
            raise StreamClosed("bridge closed by the other side")
        length = parse_length_prefix(prefix, self.max_header, what="bridge header")
        header = await self._reader.read_exactly(length)
        return decode_bridge_header(header, self.max_payload, max_header=self.max_header)

    async def recv_payload(self, msg: BridgeMessage, length: int, into: bytearray | memoryview | None = None,
                           progress: Callable[[int], None] | None = None) -> bytearray | memoryview:
        """``length`` payload bytes, received straight into one buffer (one copy): ``into``
        if given (its length must be ``length``), calling ``progress(bytes so far)``."""
        buf = bytearray(length) if into is None else into
        view = memoryview(buf)
        got = 0
        while got < length:
            data = self._reader.take_buffered(length - got)
            if not data:
                break
            view[got:got + len(data)] = data
            got += len(data)
        if progress is not None and got:
            progress(got)
        sock = getattr(self.stream, "socket", None)
        while got < length:
            if sock is not None:
                n = await sock.recv_into(view[got:], length - got)
            else:
                data = await self._reader.read_some(length - got)
                n = len(data)
                view[got:got + n] = data
            if n == 0:
                view.release()
                raise MalformedFrame(f"bridge {msg.TYPE}: payload ended after {got} of {length}")
            got += n
            if progress is not None:
                progress(got)
        view.release()
        return buf


class BridgeClient:
    """A blocking bridge client (executor, CLI): connects, sends Hello, then request/reply.

    The daemon decides whether it answers Hello; this client does not wait for a reply.
    """

    def __init__(self, path: str, *, role: str, cluster_id: str = "", job_id: str = "",
                 max_payload: int = 1 << 31, timeout: float | None = None,
                 answers_deliveries: bool = False) -> None:
        self.max_payload = max_payload
        self.sock = connect_bridge(path, Hello(role=role, cluster_id=cluster_id, job_id=job_id,
                                               answers_deliveries=answers_deliveries), timeout)

    def send(self, msg: BridgeMessage, payload: bytes = b"") -> None:
        send_bridge(self.sock, msg, payload)

    def recv(self) -> tuple[BridgeMessage, bytes]:
        return recv_bridge(self.sock, self.max_payload)

    def request(self, msg: BridgeMessage, payload: bytes = b"") -> tuple[BridgeMessage, bytes]:
        """Send one frame and return the next frame received."""
        self.send(msg, payload)
        return self.recv()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> BridgeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "BridgeClient",
    "BridgeMessage",
    "BridgeStream",
    "ControlDelivery",
    "ControlReply",
    "ControlResult",
    "ControlSend",
    "Delivery",
    "DeliveryResult",
    "Error",
    "Hello",
    "ProbeReply",
    "ProbeRequest",
    "SendResult",
    "SendUpdate",
    "StatusReply",
    "StatusRequest",
    "bridge_header",
    "connect_bridge",
    "tune_socket",
    "decode_bridge_header",
    "recv_bridge",
    "send_bridge",
]
