"""Wire-compatible speed-ups for py-libp2p 0.8.1's TCP + Noise path (applied once per process).

1. Noise writes: a large message is still split into <= 65519-byte Noise frames,
   encrypted in order (same nonces, same bytes on the wire), but the frames are sent
   with ONE socket write instead of one write (and scheduler round-trip) per 64 KiB.
2. TCP reads: the raw stream reads up to 1 MiB per syscall and serves the Noise
   reader's 2-byte and 64 KiB requests from that buffer, instead of one syscall each.
3. Secure-session reads of a large frame collect the decrypted pieces and join them once,
   instead of growing a bytearray 64 KiB at a time (page faults and re-copies).
4. ``read_exactly`` returns the reader's bytes as they are when one read already has all
   ``n`` (the library copies them twice through a bytearray on every frame).
5. Large secure-session reads decrypt whole Noise frames straight out of the TCP
   read-ahead buffer when they are there (same bytes, same nonce order, fewer awaits).

All of them change only how bytes move through this process, not which bytes are sent;
tests/fabricd exercise every path (all daemon traffic goes through them).
"""

from __future__ import annotations

from typing import Any

import trio
from libp2p.io import msgio as _msgio
from libp2p.io import utils as _io_utils
from libp2p.io.exceptions import ConnectionClosedError, IncompleteReadError
from libp2p.io.trio import TrioTCPStream
from libp2p.security.noise import io as noise_io
from libp2p.security.secure_session import SecureSession
from libp2p.stream_muxer.yamux import yamux as _yamux

from fabricd import _muxguard

READ_AHEAD = 1024 * 1024
_applied = False


async def _coalesced_write_msg(self: Any, msg: bytes, prefix_encoded: bool = False) -> None:
    limit = noise_io.MAX_PLAINTEXT_LENGTH
    if prefix_encoded or len(msg) <= limit:
        await _original_write_msg(self, msg, prefix_encoded)
        return
    view = memoryview(msg)
    parts: list[bytes] = []
    # NoiseConnection.encrypt insists on bytes (a copy per 64 KiB); its cipher state takes
    # any buffer, so slices of the frame are encrypted in place, in the same nonce order.
    cipher = getattr(getattr(getattr(self.noise_state, "noise_protocol", None),
                             "cipher_state_encrypt", None), "encrypt_with_ad", None)
    for start in range(0, len(msg), limit):
        piece = view[start:start + limit]
        encrypted = cipher(None, piece) if cipher is not None else self.encrypt(bytes(piece))
        parts.append(len(encrypted).to_bytes(2, "big"))
        parts.append(encrypted)
    await self.read_writer.read_write_closer.write(b"".join(parts))


async def _buffered_read(self: Any, n: int | None = None) -> bytes:
    async with self.read_lock:
        if n is not None and n == 0:
            return b""
        data: bytes = getattr(self, "_fabricd_data", b"")
        pos: int = getattr(self, "_fabricd_pos", 0)
        if pos >= len(data):
            try:
                data = await self.stream.receive_some(max(n or 0, READ_AHEAD))
            except trio.BrokenResourceError as error:
                raise ConnectionClosedError(
                    f"TCP connection reset by remote peer: {error}", transport="tcp"
                ) from error
            except trio.ClosedResourceError:
                return b""
            if n is None or len(data) <= n:
                self._fabricd_data, self._fabricd_pos = b"", 0
                return data
            pos = 0
        end = len(data) if n is None else min(len(data), pos + n)
        out = data[pos:end]
        self._fabricd_data, self._fabricd_pos = data, end
        return out


def _fused_path(noise_rw: Any) -> tuple[Any, Any]:
    """(TCP stream, Noise receive cipher state) under a Noise transport reader, or (None, None)."""
    try:
        raw = noise_rw.read_writer.read_write_closer
        tcp = getattr(raw, "stream", raw)
        cipher = noise_rw.noise_state.noise_protocol.cipher_state_decrypt
    except AttributeError:
        return None, None
    # TCP, or anything else read ahead the same way (fabricd._relay.CircuitStream)
    if getattr(type(tcp), "read", None) is not _buffered_read or not hasattr(cipher, "decrypt_with_ad"):
        return None, None
    return tcp, cipher


def _decrypt_buffered_frame(tcp: Any, cipher: Any) -> bytes | None:
    """Decrypt the next Noise frame straight from the TCP read-ahead buffer, if it is all there.

    Same bytes, same nonce order as NoisePacketReadWriter.read_msg + decrypt, minus a dozen
    awaits, two lock round-trips and a 64 KiB copy per frame. None = take the slow path.
    """
    if tcp.read_lock.locked():
        return None
    data: bytes = getattr(tcp, "_fabricd_data", b"")
    pos: int = getattr(tcp, "_fabricd_pos", 0)
    if len(data) - pos < 2:
        return None
    length = (data[pos] << 8) | data[pos + 1]
    end = pos + 2 + length
    if end > len(data):
        return None
    plaintext = cipher.decrypt_with_ad(None, memoryview(data)[pos + 2:end])
    tcp._fabricd_pos = end
    return bytes(plaintext)


async def _joined_secure_read(self: Any, n: int | None = None) -> bytes:
    if n is None or n <= noise_io.MAX_PLAINTEXT_LENGTH:
        return await _original_secure_read(self, n)
    first = self._drain(n)
    if len(first) == n:
        return first
    parts = [first] if first else []
    got = len(first)
    tcp, cipher = _fused_path(self.conn)
    while got < n:
        needed = n - got
        msg = _decrypt_buffered_frame(tcp, cipher) if tcp is not None else None
        if msg is None:
            msg = await self.conn.read_msg()
        if msg == b"":
            if got:
                return b"".join(parts)
            raise ConnectionClosedError("Connection closed")
        if len(msg) <= needed:
            parts.append(msg)
            got += len(msg)
        else:
            parts.append(msg[:needed])
            self._fill(msg[needed:])
            got = n
    return b"".join(parts)


async def _read_exactly(reader: Any, n: int, retry_count: int = 100) -> bytes:
    data = await reader.read(n)
    if len(data) == n and isinstance(data, bytes):
        return data
    parts = [bytes(data)]
    got = len(data)
    for _ in range(retry_count):
        if got >= n:
            return b"".join(parts)
        more = await reader.read(n - got)
        if not more:
            break
        parts.append(bytes(more))
        got += len(more)
    if got >= n:
        return b"".join(parts)
    raise IncompleteReadError(
        f"Connection closed during read operation: expected {n} bytes but received {got} bytes",
        expected_bytes=n, received_bytes=got)


_original_write_msg: Any = None
_original_secure_read: Any = None


def apply() -> None:
    """Install both speed-ups (idempotent)."""
    global _applied, _original_write_msg, _original_secure_read
    if _applied:
        return
    _original_write_msg = noise_io.BaseNoiseMsgReadWriter.write_msg
    _original_secure_read = SecureSession.read
    SecureSession.read = _joined_secure_read  # type: ignore[method-assign]
    noise_io.NoiseTransportReadWriter.write_msg = _coalesced_write_msg  # type: ignore[method-assign]
    TrioTCPStream.read = _buffered_read  # type: ignore[method-assign]
    for module in (_io_utils, _msgio, _yamux):
        module.read_exactly = _read_exactly  # type: ignore[attr-defined]
    _muxguard.apply()  # not a speed-up: bounds what yamux buffers for a peer
    _applied = True
