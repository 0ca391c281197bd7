"""The sending half of update streams: retried opens, a pool of reusable streams per peer,
bounded parallel sends, and bodies written as chunks without building them in full.

On ``/fedpilot/update/1.1.0`` a stream carries one update after another: header, body,
ack, then the next header. A stream goes back to the pool only after an ``ok`` ack that
came after the whole body was written; anything else (early ack, reset, timeout)
discards it, so the two ends never disagree about where the next header starts. A stream
is reused only if it idled less than ``IDLE_SECONDS`` (the receiver waits longer, so it
is not closing it under us); a reused stream that turns out dead costs one retry.

On a half-duplex data-plane connection (``exchange_half_duplex``) the receiver answers the
header with a go before the body, so a refused large body is never sent; a small body
(``exchange_inline``, at most ``INLINE_BODY_BYTES``) rides in its header's record instead
and the one ack comes back - one round trip, no go.

Why retry: py-libp2p 0.8.1 fails ``new_stream`` (``StreamFailure``) when protocol
negotiation is slow under load. Every update carries a message id the receiver
de-duplicates, so sending it again after a failure cannot deliver it twice.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import blake3
import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID

from fabricd._streams import close_quietly, read_message_exact, reset_quietly
from fabricd.errors import FabricdError
from fedcore.logs import get_logger
from proto.codec import frame
from proto.errors import ProtocolError
from proto.ids import PROTOCOL_UPDATE_POOLED
from proto.messages import UpdateAck, UpdateHeader
from proto.stream import body_digest, claimed_digest, iter_chunks

log = get_logger("fabricd.sender")

HEADER_LIMIT = 64 * 1024
#: An idle pooled stream older than this is closed instead of reused.
IDLE_SECONDS = 20.0
#: A body up to this size is written together with its header.
COALESCE_BYTES = 64 * 1024
#: Idle streams kept per peer (also the number of updates sent to one peer at a time).
PARALLEL_PER_PEER = 8
OPEN_ATTEMPTS = 8
SEND_ATTEMPTS = 4
BACKOFF_FIRST = 0.05
BACKOFF_MAX = 2.0


class RepeatedBody:
    """``nbytes`` made of ``block`` over and over (probe bodies), never built in full."""

    def __init__(self, block: bytes, nbytes: int) -> None:
        if nbytes and not block:
            raise ValueError("an empty block cannot make a non-empty body")
        self.block = block
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes

    def chunks(self, chunk_bytes: int) -> Iterator[memoryview]:
        view = memoryview(self.block)
        left = self.nbytes
        while left > 0:
            for piece in iter_chunks(view[:min(left, len(view))], chunk_bytes):
                left -= len(piece)
                yield piece


class FillingBuffer:
    """A payload still arriving from the bridge while it is already being sent (cut-through):
    ``filled`` bytes of ``buf`` are there; ``wait_filled(n)`` waits for n of them and returns
    why they will never come (the client went away or broke the frame), or None. Callbacks
    given to ``on_fail`` run once it fails (a sender blocked elsewhere, on a stalled stream
    write or a busy peer's slot, stops there and frees what it holds)."""

    def __init__(self, buf: bytearray | memoryview) -> None:
        self.buf = buf
        self.filled = 0
        self.failed: str | None = None
        self._changed = trio.Event()
        self._on_fail: list[Callable[[], None]] = []

    def __len__(self) -> int:
        return len(self.buf)

    def advance(self, filled: int) -> None:
        self.filled = filled
        self._wake()

    def fail(self, reason: str) -> None:
        self.failed = reason
        self._wake()
        for callback in self._on_fail:
            callback()

    def on_fail(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the payload fails (at once if it already has)."""
        if self.failed is not None:
            callback()
        else:
            self._on_fail.append(callback)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_filled(self, n: int) -> str | None:
        while self.filled < n and self.failed is None:
            await self._changed.wait()
        return self.failed if self.filled < n else None


Body = bytes | bytearray | memoryview | RepeatedBody | FillingBuffer


def body_chunks(body: Body, chunk_bytes: int) -> Iterator[memoryview]:
    if isinstance(body, RepeatedBody):
        return body.chunks(chunk_bytes)
    if isinstance(body, FillingBuffer):
        return iter_chunks(body.buf, chunk_bytes)
    return iter_chunks(body, chunk_bytes)


class ByteBudget:
    """Bytes of update payloads this daemon holds for sending; ``acquire`` waits (so the
    bridge stops reading that client's socket: backpressure) until they fit. One payload
    larger than the whole budget still goes through alone, so nothing can wait forever."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._freed = trio.Event()

    async def acquire(self, n: int) -> None:
        while self.used and self.used + n > self.limit:
            await self._freed.wait()
        self.used += n
        self.peak = max(self.peak, self.used)

    def release(self, n: int) -> None:
        self.used -= n
        self._freed.set()
        self._freed = trio.Event()


class StreamLost(FabricdError):
    """The stream broke before an ack came back (the update may be sent again)."""


class BodyRefused(FabricdError):
    """The sender's own check of the body failed; the stream was cut before its last chunk."""


class NoRoute(FabricdError, ConnectionError):
    """One dial tried every way to a peer - its direct addresses and each relay it
    announces - and none reached it. Opening a stream again at once tries the same ways:
    ``open_stream`` leaves this to its caller's retries, seconds apart (an update to a
    member whose only relay died failed after 28 s of these, now after 3-6 s)."""


Gate = Callable[[], Awaitable[str | None]]


class DigestGate:
    """The sending daemon's check of a large payload against its header's digest claim
    (blake3 or sha256), awaited (``gate()``) before the last chunk goes out: a payload that
    does not match its header is never delivered.

    On libp2p streams the exchange calls ``start()`` as the body starts going out, and a
    worker thread hashes the payload meanwhile (hashing overlaps the network instead of
    preceding it). On the data plane a BLAKE3 claim is not gated at all: the receiver
    answers a plain go and verifies the header's claim itself before delivery
    (``exchange_half_duplex``), so the sending daemon does not hash the body; if it is asked
    for a trailer instead (``streams_blake3``), it hashes each chunk as it encrypts it and
    ``settle``s the gate with that digest before the last chunk."""

    STEP = 8 * 1024 * 1024

    def __init__(self, payload: bytes | bytearray | memoryview | FillingBuffer, header: UpdateHeader,
                 nursery: trio.Nursery) -> None:
        self.payload = payload
        self.algorithm, _, self.expected = claimed_digest(header)
        self._header = header
        self._nursery = nursery
        self.reason: str | None = None
        self._started = False
        self._done = trio.Event()

    @property
    def streams_blake3(self) -> bool:
        """A half-duplex sender may verify the claim itself as it sends (and ``settle``)."""
        return self.algorithm == "blake3" and not self._started

    def start(self) -> None:
        """Hash the payload in the background (once; no-op if already started or settled)."""
        if not self._started:
            self._started = True
            self._nursery.start_soon(self._run)

    def settle(self, digest: bytes) -> str | None:
        """The payload's digest as its sender computed it: the verdict, kept for retries."""
        if not self._done.is_set():
            self._started = True
            self.reason = self._verdict(digest)
            self._done.set()
        return self.reason

    async def __call__(self) -> str | None:
        self.start()
        await self._done.wait()
        return self.reason

    def _verdict(self, digest: bytes) -> str | None:
        if digest == self.expected:
            return None
        return (f"payload {self.algorithm} {digest.hex()} does not match the header's "
                f"{self.expected.hex()}; nothing was delivered")

    async def _run(self) -> None:
        try:
            if isinstance(self.payload, FillingBuffer):
                why = await self._hash_while_filling(self.payload)
                if why is not None:
                    self.reason = why
                    return
            else:
                self.reason = self._verdict(await trio.to_thread.run_sync(
                    body_digest, self._header, self.payload))
        finally:
            self._done.set()

    async def _hash_while_filling(self, body: FillingBuffer) -> str | None:
        """Hash the bytes as they arrive, STEP at a time; the reason if they never all do."""
        _, state, _ = claimed_digest(self._header)
        view = memoryview(body.buf)
        pos = 0
        try:
            while pos < len(view):
                end = min(len(view), pos + self.STEP)
                why = await body.wait_filled(end)
                if why is not None:
                    return f"the payload did not arrive in full from the bridge client ({why}); nothing was delivered"
                await trio.to_thread.run_sync(state.update, view[pos:end])
                pos = end
        finally:
            view.release()
        self.reason = self._verdict(state.digest())
        return self.reason


def backoff(attempt: int) -> float:
    """Seconds to wait before attempt ``attempt + 1`` (exponential, jittered, capped)."""
    return float(min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** attempt) * (0.5 + random.random()))


async def open_stream(host: IHost, peer_id: str, protocol: str, attempts: int = OPEN_ATTEMPTS) -> INetStream:
    """``host.new_stream`` with bounded retries and backoff (StreamFailure under load)."""
    for attempt in range(attempts):
        try:
            return await host.new_stream(ID.from_base58(peer_id), [protocol])  # type: ignore[list-item]
        except (trio.Cancelled, NoRoute):
            raise
        except Exception as exc:  # noqa: BLE001 - StreamFailure, dial errors, resets
            if attempt == attempts - 1:
                raise
            log.info("stream.open_retry", peer=peer_id, attempt=attempt + 1,
                     reason=f"{type(exc).__name__}: {exc}")
            await trio.sleep(backoff(attempt))
    raise AssertionError("unreachable")


@dataclass
class _Peer:
    slots: trio.Semaphore = field(default_factory=lambda: trio.Semaphore(PARALLEL_PER_PEER))
    idle: list[tuple[INetStream, float]] = field(default_factory=list)


class StreamPool:
    """Idle update streams per peer, reused across updates; at most PARALLEL_PER_PEER busy."""

    def __init__(self, host: IHost, protocol: str = PROTOCOL_UPDATE_POOLED,
                 opener: Callable[[str], Awaitable[INetStream]] | None = None) -> None:
        self.host = host
        self.protocol = protocol
        #: how a new stream to a peer is made (default: a libp2p stream on ``protocol``)
        self.opener = opener
        self.peers: dict[str, _Peer] = defaultdict(_Peer)
        self.opened = 0
        self.reused = 0

    def slots(self, peer_id: str) -> trio.Semaphore:
        return self.peers[peer_id].slots

    async def take(self, peer_id: str) -> tuple[INetStream, bool]:
        """(stream, reused): a fresh-enough idle stream, else a newly opened one."""
        idle = self.peers[peer_id].idle
        now = time.monotonic()
        while idle:
            stream, since = idle.pop()
            if now - since < IDLE_SECONDS:
                self.reused += 1
                return stream, True
            await close_quietly(stream)
        if self.opener is not None:
            stream = await self.opener(peer_id)
        else:
            stream = await open_stream(self.host, peer_id, self.protocol)
        self.opened += 1
        return stream, False

    def give_back(self, peer_id: str, stream: INetStream) -> None:
        idle = self.peers[peer_id].idle
        if len(idle) >= PARALLEL_PER_PEER:
            self._close_later(stream)
            return
        idle.append((stream, time.monotonic()))

    def _close_later(self, stream: INetStream) -> None:
        trio.lowlevel.spawn_system_task(close_quietly, stream)

    def forget(self, peer_id: str) -> None:
        """Close a peer's idle streams (it left, or its connection broke)."""
        peer = self.peers.get(peer_id)
        if peer is None:
            return
        idle, peer.idle = peer.idle, []
        for stream, _ in idle:
            self._close_later(stream)


async def exchange(stream: INetStream, header: UpdateHeader, body: Body, chunk_bytes: int,
                   ack_timeout: float, gate: Gate | None = None) -> tuple[UpdateAck, bool]:
    """Write header and body, read the ack: (ack, whole body written before the ack).

    ``gate`` is awaited before the last chunk; a reason from it stops the send
    (BodyRefused; the caller resets the stream, so the receiver never gets it all).

    The writer stops between chunks when an early ack arrives (a rejection before the
    body); it is never cancelled inside a write, which could cut a yamux frame in half.
    StreamLost if the stream breaks or ends without an ack.
    """
    acks: list[UpdateAck] = []
    errors: list[BaseException] = []
    got_ack = trio.Event()

    async def read_ack() -> None:
        try:
            msg = await read_message_exact(stream, HEADER_LIMIT)
        except Exception as exc:  # noqa: BLE001 - any failure here means "no ack on this stream"
            errors.append(exc)
        else:
            if isinstance(msg, UpdateAck):
                acks.append(msg)
            else:
                errors.append(ProtocolError(f"expected UpdateAck, got {msg.TYPE}"))
        got_ack.set()

    completed = False
    failure: BaseException | None = None
    if isinstance(gate, DigestGate):
        gate.start()  # hashed while the body goes out
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_ack)
        try:
            chunks = list(body_chunks(body, chunk_bytes))
            refused = await gate() if gate is not None and len(chunks) <= 1 else None
            if refused is None:
                head = frame(header)
                if len(chunks) == 1 and len(chunks[0]) <= COALESCE_BYTES:
                    # A small body rides in the header's write (its gate, if any, has
                    # spoken): one yamux and Noise frame, one wake-up of the receiver.
                    await stream.write(head + chunks.pop())
                else:
                    await stream.write(head)
            offset = 0
            for i, chunk in enumerate(chunks):
                if got_ack.is_set() or refused is not None:
                    break
                offset += len(chunk)
                if isinstance(body, FillingBuffer):
                    refused = await body.wait_filled(offset)
                    if refused is not None:
                        break
                if gate is not None and i == len(chunks) - 1:
                    refused = await gate()
                    if refused is not None:
                        break
                await stream.write(chunk)  # type: ignore[arg-type]  # yamux slices it
            else:
                completed = refused is None
            if refused is not None:
                failure = BodyRefused(refused)
        except Exception as exc:  # noqa: BLE001 - resets, closed muxers, dead connections
            # The receiver may have stopped us with an early ack; wait for it briefly.
            with trio.move_on_after(2):
                await got_ack.wait()
            if not acks:
                failure = StreamLost(f"{type(exc).__name__}: {exc}")
        if failure is None:
            with trio.move_on_after(ack_timeout) as waited:
                await got_ack.wait()
            if waited.cancelled_caught:
                failure = trio.TooSlowError()
        # Raised outside the nursery, so callers see the exception itself, not a group.
        nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure
    if not acks:
        reason = f"{type(errors[0]).__name__}: {errors[0]}" if errors else "no ack"
        raise StreamLost(f"the stream ended without an ack ({reason})")
    return acks[0], completed


#: the receiver's answer on a half-duplex (data-plane) connection: admitted, send the body
GO = "go"
#: the same, and send the body's 32-byte BLAKE3 right after it (the receiver verifies that
#: instead of recomputing the header's sha256, which this sender checked: see DigestGate)
GO_BLAKE3 = "go blake3"
#: a body up to this size rides in its header's record on a half-duplex connection (no go);
#: the receiver takes one only if it is exactly the rest of that record
INLINE_BODY_BYTES = 64 * 1024
#: body bytes a half-duplex sender hands to one write_many call at most
WRITE_BATCH_BYTES = 32 * 1024 * 1024


async def exchange_half_duplex(stream: INetStream, header: UpdateHeader, body: Body, chunk_bytes: int,
                               go_timeout: float, ack_timeout: float,
                               gate: Gate | None = None) -> tuple[UpdateAck, bool]:
    """``exchange`` for a connection one thread at a time may use (the TLS data plane):
    header, then the receiver's go (an ``ok`` ack with reason ``go``) or its final answer,
    then the body and the final ack. A refused body is never sent."""
    try:
        await stream.write(frame(header))
        with trio.fail_after(go_timeout):
            first = await read_message_exact(stream, HEADER_LIMIT)
    except trio.TooSlowError:
        raise StreamLost(f"no answer to the header within {go_timeout:.0f} s") from None
    except Exception as exc:  # noqa: BLE001 - resets, closed connections
        raise StreamLost(f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(first, UpdateAck):
        raise StreamLost(f"expected UpdateAck, got {first.TYPE}")
    if not (first.status == "ok" and first.reason in (GO, GO_BLAKE3)):
        return first, False
    if first.reason == GO and header.blake3:
        # The receiver verifies a BLAKE3 claim against the header itself before delivery (a
        # plain go): a payload that does not match it is refused there, never delivered, so
        # this side does not hash the body at all (the executor did, to claim it).
        gate = None
    # A BLAKE3 claim with a trailer asked for is checked here, on the digest of the chunks
    # as they are encrypted (the gate is settled with it before the last chunk), not by
    # hashing the body twice.
    inline = isinstance(gate, DigestGate) and gate.streams_blake3
    trailer = blake3.blake3() if first.reason == GO_BLAKE3 or inline else None
    chunks = list(body_chunks(body, chunk_bytes))
    offset = 0
    # Chunks already there go out together, in one worker-thread call (write_many).
    batch: list[memoryview] = []

    async def flush() -> None:
        if batch:
            await stream.write_many(batch, trailer)  # type: ignore[attr-defined]
            batch.clear()

    try:
        for i, chunk in enumerate(chunks):
            offset += len(chunk)
            if isinstance(body, FillingBuffer) and body.filled < offset:
                await flush()
                refused = await body.wait_filled(offset)
                if refused is not None:
                    raise BodyRefused(refused)
            if gate is not None and i == len(chunks) - 1:
                await flush()
                if inline:
                    assert isinstance(gate, DigestGate) and trailer is not None
                    await trio.to_thread.run_sync(trailer.update, chunk)
                    refused = gate.settle(trailer.digest())
                    if refused is not None:
                        raise BodyRefused(refused)
                    await stream.write_many([chunk], None)  # type: ignore[attr-defined]
                    continue
                refused = await gate()
                if refused is not None:
                    raise BodyRefused(refused)
            batch.append(chunk)
            if len(batch) * chunk_bytes >= WRITE_BATCH_BYTES:
                await flush()
        await flush()
        if first.reason == GO_BLAKE3 and trailer is not None:
            await stream.write(trailer.digest())
        if not chunks and gate is not None:
            refused = await gate()
            if refused is not None:
                raise BodyRefused(refused)
        with trio.fail_after(ack_timeout):
            final = await read_message_exact(stream, HEADER_LIMIT)
    except (BodyRefused, trio.Cancelled, trio.TooSlowError):
        raise
    except Exception as exc:  # noqa: BLE001 - resets, closed connections, bad frames
        raise StreamLost(f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(final, UpdateAck):
        raise StreamLost(f"expected UpdateAck, got {final.TYPE}")
    return final, True


def inline_body(body: Body) -> bytes | None:
    """The body as bytes if it may ride in its header's record (exchange_inline), else None."""
    if isinstance(body, FillingBuffer) or not 0 < len(body) <= INLINE_BODY_BYTES:
        return None
    if isinstance(body, RepeatedBody):
        return b"".join(body.chunks(INLINE_BODY_BYTES))
    return bytes(body)


async def exchange_inline(stream: INetStream, header: UpdateHeader, body: bytes, ack_timeout: float,
                          gate: Gate | None = None) -> tuple[UpdateAck, bool]:
    """``exchange`` for a small body on a half-duplex connection: header and body in one
    write (one data-plane record), then the one ack - no go. The receiver reads the body
    with the header and may still refuse it; it checks the header's sha256 itself."""
    if gate is not None:
        refused = await gate()
        if refused is not None:
            raise BodyRefused(refused)
    try:
        await stream.write(frame(header) + body)
        with trio.fail_after(ack_timeout):
            ack = await read_message_exact(stream, HEADER_LIMIT)
    except trio.TooSlowError:
        raise
    except Exception as exc:  # noqa: BLE001 - resets, closed connections
        raise StreamLost(f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(ack, UpdateAck):
        raise StreamLost(f"expected UpdateAck, got {ack.TYPE}")
    return ack, True


async def discard(stream: INetStream, clean: bool) -> None:
    if clean:
        await close_quietly(stream)
    else:
        await reset_quietly(stream)
