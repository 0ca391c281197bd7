"""The local bridge between fabricd and its executor/CLI: a Unix socket (mode 0600).

Frame = u32 big-endian header length + msgpack header map (`v`, `type`, fields...,
`payload_length`) + `payload_length` raw bytes. Only SendUpdate and Delivery carry a
payload (the safetensors body, `payload_length == byte_length`); every other type has
`payload_length == 0`. A large payload may instead come as a sealed memfd passed with the
frame's first byte (SCM_RIGHTS): the header then says `payload_fd: true` and no payload
bytes follow (see proto._bridge_fds; the daemon takes such SendUpdates from any client
and sends Deliveries so only to a client whose Hello says `accepts_fds`). An executor that said `answers_deliveries` in its Hello answers
each Delivery with a DeliveryResult. Blocking helpers serve a plain socket, async ones a
trio stream.
"""

from __future__ import annotations

import array
import mmap
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proto._bridge_fds import (
    ANC_BYTES,
    FD_MIN_BYTES,
    FdQueue,
    FdRefused,
    SpareMemfds,
    keep_fds,
    recvmsg_fds,
    sealed_memfd,
    take_checked,
)
from proto._bridge_fds import close_quietly as close_fd
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
from proto.errors import (
    InvalidMessage,
    MalformedFrame,
    MessageTooLarge,
    ProtocolError,
    StreamClosed,
)
from proto.ids import MAX_BRIDGE_HEADER_BYTES

PAYLOAD_LENGTH = "payload_length"
#: header key: the payload is in the file descriptor that came with the frame
PAYLOAD_FD = "payload_fd"
#: a payload up to this size is written together with its frame's header
COALESCE_BYTES = 64 * 1024

# ---- framing ----------------------------------------------------------------------------

def bridge_header(msg: BridgeMessage, payload_length: int,
                  *, max_header: int = MAX_BRIDGE_HEADER_BYTES, in_fd: bool = False) -> bytes:
    """The length prefix + header of a frame whose payload has `payload_length` bytes
    (``in_fd``: they are in a descriptor sent with the frame, not after the header)."""
    if not isinstance(msg, BridgeMessage):
        raise TypeError(f"expected a proto.bridge message, got {type(msg).__name__}")
    _check_payload_length(msg, payload_length)
    if in_fd and not (msg.CARRIES_PAYLOAD and payload_length):
        raise ValueError(f"bridge {msg.TYPE} with {payload_length} payload bytes cannot pass them in a descriptor")
    header = msg.to_map()
    header[PAYLOAD_LENGTH] = payload_length
    if in_fd:
        header[PAYLOAD_FD] = True
    data = pack(header)
    if len(data) > max_header:
        raise MessageTooLarge(
            f"bridge {msg.TYPE} header is {len(data)} bytes, over the limit of {max_header}"
        )
    return HEADER_PREFIX.pack(len(data)) + data


@dataclass(frozen=True)
class FrameHeader:
    """A decoded frame header: its payload is ``length`` bytes, after the header or (``in_fd``)
    in the descriptor that came with the frame."""

    msg: BridgeMessage
    length: int
    in_fd: bool = False


def decode_bridge_header(data: bytes, max_payload: int,
                         *, max_header: int = MAX_BRIDGE_HEADER_BYTES
                         ) -> tuple[BridgeMessage, int]:
    """(message, payload_length) from a header (without its prefix); ProtocolError if bad
    (also if its payload is in a descriptor: see ``decode_frame_header``)."""
    head = decode_frame_header(data, max_payload, max_header=max_header)
    if head.in_fd:
        raise InvalidMessage(f"bridge {head.msg.TYPE}: its payload is in a file descriptor, which "
                             "this reader does not take", field=PAYLOAD_FD)
    return head.msg, head.length


def decode_frame_header(data: bytes, max_payload: int,
                        *, max_header: int = MAX_BRIDGE_HEADER_BYTES) -> FrameHeader:
    """The frame header in ``data`` (without its prefix); ProtocolError if bad."""
    obj = unpack_limited(data, max_header)
    if not isinstance(obj, dict):
        raise MalformedFrame(f"bridge header must be a msgpack map, got {type(obj).__name__}")
    msg = from_map(BridgeMessage.REGISTRY, obj, extra=frozenset({PAYLOAD_LENGTH, PAYLOAD_FD}))
    assert isinstance(msg, BridgeMessage)
    if PAYLOAD_LENGTH not in obj:
        raise InvalidMessage(f"{msg.TYPE}: missing field '{PAYLOAD_LENGTH}'", field=PAYLOAD_LENGTH)
    length = Int(0, I64_MAX).check(PAYLOAD_LENGTH, obj[PAYLOAD_LENGTH])
    if length > max_payload:
        raise MessageTooLarge(
            f"bridge {msg.TYPE} payload of {length} bytes is over the limit of {max_payload}"
        )
    _check_payload_length(msg, length)
    in_fd = obj.get(PAYLOAD_FD, False)
    if in_fd is not False and not (in_fd is True and msg.CARRIES_PAYLOAD and length):
        raise InvalidMessage(f"{msg.TYPE}: '{PAYLOAD_FD}' must be true (and only on a frame "
                             f"with payload bytes) or absent, got {in_fd!r}", field=PAYLOAD_FD)
    return FrameHeader(msg, length, in_fd)


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


def send_bridge(sock: socket.socket, msg: BridgeMessage, payload: bytes | bytearray | memoryview = b"",
                *, fd: int | None = None) -> None:
    """Write one frame to a blocking socket; with ``fd`` (a sealed memfd of
    ``msg.byte_length`` bytes, still the caller's to close) instead of payload bytes."""
    if fd is not None:
        if payload:
            raise ValueError("a frame carries its payload as bytes or in a descriptor, not both")
        head = bridge_header(msg, msg.byte_length, in_fd=True)  # type: ignore[attr-defined]
        sent = socket.send_fds(sock, [head], [fd])
        if sent < len(head):
            sock.sendall(head[sent:])
        return
    head = bridge_header(msg, len(payload))
    if len(payload) <= COALESCE_BYTES:
        sock.sendall(head + bytes(payload))  # one write, one wake-up of the reader
        return
    sock.sendall(head)
    sock.sendall(payload)


#: memfds an executor's process makes ahead for its next large payload (one, of the size
#: it last sent: an executor sends updates of one model, round after round)
SEND_SPARES = SpareMemfds(limit=256 * 1024 * 1024, count=1, name="fedpilot-update")


def send_payload(sock: socket.socket, msg: BridgeMessage,
                 payload: bytes | bytearray | memoryview) -> None:
    """``send_bridge``, the payload in a sealed memfd (closed here once sent) if it is at
    least FD_MIN_BYTES: the daemon maps it instead of reading it through the socket."""
    if len(payload) < FD_MIN_BYTES:
        send_bridge(sock, msg, payload)  # type: ignore[arg-type]
        return
    fd = sealed_memfd(payload, spares=SEND_SPARES)
    try:
        send_bridge(sock, msg, fd=fd)
    finally:
        close_fd(fd)


#: a frame's payload: bytes read from the socket, or a read-only mapping of the memfd
#: that came with it
Payload = bytes | mmap.mmap


def recv_bridge(sock: socket.socket, max_payload: int,
                *, max_header: int = MAX_BRIDGE_HEADER_BYTES,
                fds: FdQueue | None = None) -> tuple[BridgeMessage, Payload]:
    """Read one frame from a blocking socket: (message, payload).

    StreamClosed (an EOFError and a ConnectionError) if the peer closed before a frame;
    MalformedFrame if it closed inside one; other ProtocolErrors for bad content.
    Oversized lengths are refused before reading. With ``fds`` (the connection's queue of
    received descriptors) a payload may come as a memfd: it is checked (sealed, its size),
    returned as a read-only mapping, and its descriptor closed; without, any descriptor
    sent along is dropped by the kernel and such a frame is refused.
    """
    if fds is None:
        prefix = _recv_exactly(sock, HEADER_PREFIX.size)
    else:
        prefix = bytearray(recvmsg_fds(sock, HEADER_PREFIX.size, fds, socket.MSG_WAITALL))
        if prefix and len(prefix) < HEADER_PREFIX.size:
            prefix += _recv_exactly(sock, HEADER_PREFIX.size - len(prefix))
    if not prefix:
        raise StreamClosed("bridge closed by the other side")
    header = _recv_exactly(sock, parse_length_prefix(bytes(prefix), max_header, what="bridge header"))
    try:
        head = decode_frame_header(bytes(header), max_payload, max_header=max_header)
    except ProtocolError:
        if fds is not None:
            fds.close_all()
        raise
    msg, length = head.msg, head.length
    if fds is not None and len(fds) != int(head.in_fd):
        # a blocking reader reads one frame at a time: what came with it is all there is
        fds.close_all()
        raise MalformedFrame(f"bridge {msg.TYPE}: the header says {int(head.in_fd)} file "
                             f"descriptor(s) came with it, {'none' if head.in_fd else 'some'} did")
    if head.in_fd:
        fd = fds.take() if fds is not None else None
        if fd is None:
            raise MalformedFrame(f"bridge {msg.TYPE}: the header says its payload is in a file "
                                 "descriptor, which this reader does not take")
        return msg, take_checked(fd, length, future_write=True)
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
        #: descriptors received (SCM_RIGHTS) and not yet claimed by a frame; on a Unix
        #: socket every read outside a payload is a recvmsg, so none is dropped unseen
        self.fds = FdQueue()
        self._sock = getattr(stream, "socket", None)
        unix = self._sock is not None and self._sock.family == socket.AF_UNIX
        self._reader = ExactReader(self._receive_with_fds if unix else stream.receive_some)

    async def _receive_with_fds(self, n: int) -> bytes:
        assert self._sock is not None  # only set as the reader on a socket
        data, ancdata, flags, _ = await self._sock.recvmsg(n, ANC_BYTES)
        keep_fds(ancdata, flags, self.fds)
        return bytes(data)

    def close_fds(self) -> None:
        """Close every descriptor received and not claimed (the connection's end)."""
        self.fds.close_all()

    async def send(self, msg: BridgeMessage, payload: bytes | bytearray | memoryview = b"",
                   *, fd: int | None = None) -> None:
        """One frame; with ``fd`` (a sealed memfd of ``msg.byte_length`` bytes, still the
        caller's) instead of payload bytes (Unix sockets only)."""
        if fd is not None:
            if self._sock is None:
                raise ValueError("a descriptor can only be passed on a Unix socket")
            head = bridge_header(msg, msg.byte_length, in_fd=True)  # type: ignore[attr-defined]
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
            sent = await self._sock.sendmsg([head], rights)
            if sent < len(head):
                await self.stream.send_all(head[sent:])
            return
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
        the caller can wait (backpressure) before taking it with ``recv_payload``.
        A frame whose payload is in a descriptor is refused (``recv_frame_header`` takes it)."""
        head = await self.recv_frame_header()
        if head.in_fd:
            raise InvalidMessage(f"bridge {head.msg.TYPE}: its payload is in a file descriptor, "
                                 "which this reader does not take", field=PAYLOAD_FD)
        return head.msg, head.length

    async def recv_frame_header(self) -> FrameHeader:
        """The next frame's header; if ``in_fd``, its descriptor is ``take_fd()``'s."""
        prefix = await self._reader.read_exactly(HEADER_PREFIX.size)
        if not prefix:
            raise StreamClosed("bridge closed by the other side")
        length = parse_length_prefix(prefix, self.max_header, what="bridge header")
        header = await self._reader.read_exactly(length)
        return decode_frame_header(header, self.max_payload, max_header=self.max_header)

    def take_fd(self) -> int | None:
        """The oldest descriptor received and not yet claimed (the caller closes it), or
        None: the one a frame with ``in_fd`` came with (it came with the frame's first
        byte, so it is here once the header is)."""
        return self.fds.take()

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
                 answers_deliveries: bool = False, accepts_fds: bool = False) -> None:
        self.max_payload = max_payload
        #: descriptors received (only with ``accepts_fds``: Deliveries as memfds)
        self.fds = FdQueue() if accepts_fds else None
        self.sock = connect_bridge(path, Hello(role=role, cluster_id=cluster_id, job_id=job_id,
                                               answers_deliveries=answers_deliveries,
                                               accepts_fds=accepts_fds), timeout)

    def send(self, msg: BridgeMessage, payload: bytes | bytearray | memoryview = b"",
             *, fd: int | None = None) -> None:
        send_bridge(self.sock, msg, payload, fd=fd)

    def send_update(self, msg: BridgeMessage, payload: bytes | bytearray | memoryview) -> None:
        """A SendUpdate (or Delivery) frame, its payload in a sealed memfd if it is at least
        FD_MIN_BYTES (no byte stream through the socket), else as bytes."""
        send_payload(self.sock, msg, payload)

    def recv(self) -> tuple[BridgeMessage, Payload]:
        return recv_bridge(self.sock, self.max_payload, fds=self.fds)

    def request(self, msg: BridgeMessage, payload: bytes = b"") -> tuple[BridgeMessage, Payload]:
        """Send one frame and return the next frame received."""
        self.send(msg, payload)
        return self.recv()

    def close(self) -> None:
        if self.fds is not None:
            self.fds.close_all()
        self.sock.close()

    def __enter__(self) -> BridgeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "FD_MIN_BYTES",
    "BridgeClient",
    "BridgeMessage",
    "FdQueue",
    "FdRefused",
    "FrameHeader",
    "Payload",
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
    "decode_frame_header",
    "send_payload",
    "recv_bridge",
    "send_bridge",
]
