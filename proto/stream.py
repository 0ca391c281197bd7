"""Update-stream bodies: bounded, verified reception; chunked sending.

On PROTOCOL_UPDATE a sender writes `frame(UpdateHeader)` then `byte_length` raw
safetensors bytes (in chunks from `iter_chunks`) and reads one `frame(UpdateAck)`.
The receiver feeds the body into an `UpdateReceiver` and delivers only what `finish()`
returns (`fabricd._dedup` makes delivery idempotent by message id).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator
from typing import Any

import blake3

from proto.errors import DigestMismatch, LengthMismatch, MessageTooLarge
from proto.ids import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES
from proto.messages import UpdateHeader


class UpdateReceiver:
    """Collects one update body in bounded memory and verifies it before release.

    Raises MessageTooLarge at construction if `header.byte_length > max_bytes`, so
    nothing is read for an update that could never be accepted.
    """

    def __init__(self, header: UpdateHeader, max_bytes: int) -> None:
        if header.byte_length > max_bytes:
            raise MessageTooLarge(
                f"update {header.message_id!r} announces {header.byte_length} bytes, over the "
                f"limit of {max_bytes} bytes"
            )
        self.header = header
        self.received = 0
        # One buffer of the announced size, filled in place: a single copy of each chunk
        # and no join at the end (allocated on the first byte, after admission).
        self._buf: bytearray | None = None
        self._algorithm, self._hash, self._expected = claimed_digest(header)
        self._finished = False

    @property
    def remaining(self) -> int:
        """Bytes still expected."""
        return self.header.byte_length - self.received

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        """Add the next piece of the body; LengthMismatch if it runs past byte_length."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        n = len(chunk)
        if n > self.remaining:
            raise LengthMismatch(
                f"update {self.header.message_id!r}: body runs past its byte_length "
                f"{self.header.byte_length} (got {self.received + n} bytes)"
            )
        if n:
            if self._buf is None:
                self._buf = bytearray(self.header.byte_length)
            self._hash.update(chunk)
            self._buf[self.received:self.received + n] = chunk
            self.received += n

    def finish(self) -> bytearray:
        """The whole body, after checking its length and digest against the header.

        Raises LengthMismatch (short body) or DigestMismatch; can be called once.
        """
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        buf, self._buf = self._buf, None
        if self.received != self.header.byte_length:
            raise LengthMismatch(
                f"update {self.header.message_id!r}: body ended after {self.received} of "
                f"{self.header.byte_length} bytes"
            )
        if not hmac.compare_digest(self._hash.digest(), self._expected):
            raise DigestMismatch(
                f"update {self.header.message_id!r}: {self._algorithm} of the body is "
                f"{self._hash.hexdigest()}, header says {self._expected.hex()}"
            )
        return buf if buf is not None else bytearray()


def iter_chunks(
    body: bytes | bytearray | memoryview, chunk_size: int = DEFAULT_CHUNK_BYTES
) -> Iterator[memoryview]:
    """Zero-copy slices of `body`, each at most `chunk_size` bytes (<= MAX_CHUNK_BYTES,
    so a chunk always fits in one yamux frame). Yields nothing for an empty body."""
    if not 0 < chunk_size <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_size must be in 1..{MAX_CHUNK_BYTES}, got {chunk_size}")
    view = memoryview(body).cast("B")
    for start in range(0, len(view), chunk_size):
        yield view[start:start + chunk_size]


def claimed_digest(header: Any) -> tuple[str, Any, bytes]:
    """(algorithm, a fresh hasher, the claimed digest) of an update header (an
    UpdateHeader, SendUpdate or Delivery: exactly one of its sha256 and blake3 is set)."""
    if header.blake3:
        return "blake3", blake3.blake3(), header.blake3
    return "sha256", hashlib.sha256(), header.sha256


def body_digest(header: Any, data: bytes | bytearray | memoryview) -> bytes:
    """``data``'s digest under the algorithm ``header`` claims it with."""
    _, hasher, _ = claimed_digest(header)
    hasher.update(data)
    return bytes(hasher.digest())


def sha256(data: bytes | bytearray | memoryview) -> bytes:
    """The 32-byte sha256 digest an UpdateHeader carries."""
    return hashlib.sha256(data).digest()
