"""Update streams on /fedpilot/update/1.0.0.

Sender: ``frame(UpdateHeader)``, the body in chunks of at most 4 MiB, then it reads one
``frame(UpdateAck)`` (an early ack - e.g. a rejection before the body - stops the send).
On /fedpilot/update/1.1.0 the stream then carries the next update (after an ``ok`` ack;
the sending mechanics - pool, retries, parallelism - are in ``fabricd._sender``).
Receiver: checks the header (size limit, in-flight memory budget, a consumer for the
job), reads the body into an ``UpdateReceiver`` (bounded), verifies length and digest
(the header's claim, BLAKE3 or sha256; on the data plane a sha256 claim by the sender's
BLAKE3 trailer by default), drops repeated
message ids, hands the payload to the local executor, and acks ``ok`` only once the
executor accepted it (end to end; a refusal goes back as ``rejected`` with the
executor's reason). An id counts as delivered only after that acceptance, and one
copy of an id is delivered at a time (a second copy meanwhile is told ``busy:``, so it
comes back later and is then a ``duplicate``). Probe updates (job ``_probe``) are hashed
and discarded, never stored.
"""

from __future__ import annotations

import hmac
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import blake3
import trio
from libp2p.abc import IHost, INetStream

from fabricd._bounded import release_one
from fabricd._dataplane import BodyTooSlow, DataPlane, DataPlaneUnavailable, TlsStream
from fabricd._dedup import DUPLICATE, IDS_PER_SCOPE, ROUND_WINDOW, DeliveredWindows
from fabricd._relay import link_kind
from fabricd._sender import (
    GO,
    GO_BLAKE3,
    INLINE_BODY_BYTES,
    SEND_ATTEMPTS,
    Body,
    Gate,
    StreamLost,
    StreamPool,
    backoff,
    discard,
    exchange,
    exchange_half_duplex,
    exchange_inline,
    inline_body,
)
from fabricd._streams import (
    STREAM_ERRORS,
    FrameTooSlow,
    end_stream,
    read_exactly,
    read_message_floored,
    remote_peer,
    write_message,
)
from fabricd.admission import Placements, RateFloor, dedup_key
from fabricd.errors import FabricdError
from fabricd.membership import Membership
from fabricd.metrics import UNWIRED, DaemonMetrics
from fedcore.logs import get_logger
from proto._bridge_fds import SharedMapping, SpareMemfds, unmap_quietly
from proto.errors import DigestMismatch, LengthMismatch, MessageTooLarge, ProtocolError
from proto.ids import DEFAULT_CHUNK_BYTES, PROBE_JOB_ID, PROTOCOL_UPDATE, PROTOCOL_UPDATE_POOLED
from proto.messages import UpdateAck, UpdateHeader
from proto.stream import UpdateReceiver, claimed_digest

log = get_logger("fabricd.updates")

HEADER_LIMIT = 64 * 1024
#: How long a pooled stream may wait for its next header (longer than the sender's
#: IDLE_SECONDS, so the sender stops reusing a stream before we close it).
IDLE_WAIT_SECONDS = 60.0
BUSY_RETRY_TIMEOUTS = 4
#: how a receiver words a rate-floor cut (fabricd.admission.RateFloor.too_slow)
TOO_SLOW = "too slow:"
#: update streams one peer may have open here at once (its sender keeps at most 8)
MAX_STREAMS_PER_MEMBER = 32
_HEADER_ENDED: tuple[type[BaseException], ...] = (EOFError, trio.TooSlowError, *STREAM_ERRORS)


def _sole_exception(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one exception inside (nested) single-member groups, else the group itself."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


#: Chunks smaller than this are hashed on the event loop: a thread hop costs more.
INLINE_HASH_BYTES = 256 * 1024


async def _feed_in_thread(chunks: trio.MemoryReceiveChannel[bytes], sink: Callable[[bytes], None]) -> None:
    async with chunks:
        async for chunk in chunks:
            if len(chunk) < INLINE_HASH_BYTES:
                sink(chunk)
            else:
                await trio.to_thread.run_sync(sink, chunk)


_BEING_DELIVERED = "busy: an update with this message id is being delivered; retry later"


class _TooSlow(FabricdError):
    """A transfer fell below the minimum rate (the message is the reason)."""


class DeliveryError(FabricdError):
    """The local consumer could not take an update (the reason goes back to the sender;
    it starts with ``unavailable:`` or ``busy:`` if a later retry may succeed)."""


class Consumer(Protocol):
    def consumer_for(self, job_id: str) -> str | None:
        """None if some local client takes updates for ``job_id``, else the reason why not."""

    async def deliver(self, header: UpdateHeader, payload: bytes | bytearray | memoryview,
                      source_cluster: str) -> None:
        """Hand a verified update to the local client; returns once it accepted it,
        DeliveryError if it cannot or refused it."""


@dataclass
class JobCounters:
    sent_bytes: int = 0
    received_bytes: int = 0
    sent_updates: int = 0
    received_updates: int = 0
    duplicates: int = 0
    rejected: int = 0


class UpdateService:
    """Serves incoming update streams and sends outgoing ones."""

    def __init__(
        self, host: IHost, membership: Membership, consumer: Consumer, *, cluster_id: str,
        max_update_bytes: int, max_inflight_bytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        stream_timeout: float = 30.0, min_rate: float = 256 * 1024,
        placements: Placements | None = None, dedup_ids_per_member: int = IDS_PER_SCOPE,
        dedup_round_window: int = ROUND_WINDOW,
    ) -> None:
        self.host = host
        self.m = membership
        self.consumer = consumer
        self.cluster_id = cluster_id
        self.max_update_bytes = max_update_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.chunk_bytes = chunk_bytes
        self.stream_timeout = stream_timeout
        self.inflight = 0
        self.inflight_peak = 0
        #: in-flight bytes per sending peer, shared fairly between members (see _busy)
        self.peer_inflight: dict[str, int] = {}
        #: open update streams per peer (bounded by MAX_STREAMS_PER_MEMBER)
        self.peer_streams: dict[str, int] = {}
        self.min_rate = min_rate
        self.placements = placements if placements is not None else Placements()
        #: delivered ids per (sender cluster, job) and round: see fabricd._dedup
        self.delivered = DeliveredWindows(dedup_ids_per_member, dedup_round_window)
        #: dedup keys of updates handed to the executor and not yet answered
        self.delivering: set[str] = set()
        self.jobs: dict[str, JobCounters] = defaultdict(JobCounters)
        self.metrics: DaemonMetrics = UNWIRED
        self.pool = StreamPool(host)
        #: large bodies go over the TLS data plane when there is one (fabricd._dataplane)
        self.dataplane: DataPlane | None = None
        self.bulk_pool: StreamPool | None = None
        self.dataplane_min_bytes = 0
        self.dataplane_small_bytes = 0
        self.dataplane_blake3 = False
        #: memfds allocated ahead for the next large data-plane body (off until use_dataplane)
        self.spares = SpareMemfds(0)
        self.dataplane_fallbacks = 0
        #: acknowledged update bytes sent by path: dataplane, dataplane_relayed (spliced by the
        #: receiver's gateway), direct or relayed (libp2p)
        self.bytes_by_path: dict[str, int] = {}
        self.send_retries = 0

    def forget_job(self, job_id: str) -> None:
        """The job's last consumer left: its message ids may be used again by a new run."""
        forgotten = self.delivered.forget_job(job_id)
        self.placements.forget(job_id)
        log.info("update.job_forgotten", job=job_id, message_ids=forgotten)

    def register(self) -> None:
        handler = self.m.guard("update", self._serve, on_refuse=self._refuse)
        for protocol in (PROTOCOL_UPDATE, PROTOCOL_UPDATE_POOLED):
            self.host.set_stream_handler(protocol, handler)  # type: ignore[arg-type]

    def use_dataplane(self, dataplane: DataPlane, min_bytes: int, digest: str = "blake3",
                      small_bytes: int = INLINE_BODY_BYTES, spare_bytes: int = 0) -> None:
        """Send bodies of at least ``min_bytes``, and those of at most ``small_bytes`` (in
        their header's record, no go), over ``dataplane``, and serve its connections like
        pooled update streams (same admission, floors, dedup; large bodies verified by
        ``digest``: "blake3", the sender's trailer, or "sha256", the header's; small ones by
        the header's sha256). Up to ``spare_bytes`` of memfds are allocated ahead, after a
        large body, for the next one (``proto._bridge_fds.SpareMemfds``)."""
        self.dataplane = dataplane
        self.spares = SpareMemfds(spare_bytes)
        self.dataplane_min_bytes = min_bytes
        self.dataplane_small_bytes = min(small_bytes, INLINE_BODY_BYTES)
        self.dataplane_blake3 = digest == "blake3"
        self.bulk_pool = StreamPool(self.host, opener=dataplane.connect)  # type: ignore[arg-type]

    def _wants_trailer(self, header: UpdateHeader) -> bool:
        """A large data-plane body is verified against its sender's BLAKE3 trailer
        ("go blake3") only when the header claims a sha256 (which the sending daemon
        checked): a BLAKE3 claim is verified as it is."""
        return self.dataplane_blake3 and not header.blake3

    async def serve_dataplane(self, stream: TlsStream) -> None:
        try:
            await self._serve(stream)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - one connection's failure is only logged
            log.info("dataplane.aborted", peer=str(stream.muxed_conn.peer_id),
                     reason=f"{type(exc).__name__}: {exc}")
            await stream.reset()

    def transfer_status(self) -> dict[str, Any]:
        bulk = self.bulk_pool
        plane = self.dataplane.status() if self.dataplane is not None else {}
        return {**plane, "dataplane_streams_opened": bulk.opened if bulk else 0,
                "dataplane_streams_reused": bulk.reused if bulk else 0,
                "dataplane_fallbacks": self.dataplane_fallbacks,
                "spare_memfds_taken": self.spares.taken, "spare_memfds_missed": self.spares.missed,
                "spare_memfds": self.spares.held, "spare_memfd_bytes": self.spares.held_bytes,
                "spare_memfd_bytes_making": self.spares.making_bytes,
                "streams_opened": self.pool.opened, "streams_reused": self.pool.reused,
                "send_retries": self.send_retries, "inflight_in_bytes": self.inflight,
                "inflight_in_peak_bytes": self.inflight_peak, "dedup_ids": len(self.delivered),
                "dedup_refused": self.delivered.refused, "bytes_by_path": dict(self.bytes_by_path),
                "bytes_relayed_total": self.bytes_by_path.get("relayed", 0)
                + self.bytes_by_path.get("dataplane_relayed", 0)}

    def counters(self) -> dict[str, dict[str, int]]:
        return {job: asdict(c) for job, c in sorted(self.jobs.items())}

    # ---- receiving ---------------------------------------------------------------------

    async def _refuse(self, stream: INetStream, reason: str) -> None:
        await write_message(stream, UpdateAck(message_id="unknown", status="rejected",
                                              reason=reason, received_bytes=0))

    async def _ack(self, stream: INetStream, header: UpdateHeader | None, status: str,
                   reason: str, received: int) -> None:
        mid = header.message_id if header is not None else "unknown"
        await write_message(stream, UpdateAck(message_id=mid, status=status, reason=reason,
                                              received_bytes=received))

    async def _reject(self, stream: INetStream, peer: str, header: UpdateHeader | None,
                      reason: str, received: int = 0) -> None:
        log.warning("update.rejected", peer=peer, job=header.job_id if header else "?",
                    message_id=header.message_id if header else "?", reason=reason)
        self.metrics.update_rejected(reason)
        if TOO_SLOW in reason:
            self.metrics.stream_cut("update")
        if header is not None:
            self.jobs[header.job_id].rejected += 1
        await self._ack(stream, header, "rejected", reason, received)
        # the sender reads our early ack, stops its body and ends the stream; one that
        # does not (dripping on) is reset
        await end_stream(stream)

    async def _serve(self, stream: INetStream) -> None:
        """Serve updates on ``stream`` until one is not acked ``ok`` or the sender closes it."""
        peer = remote_peer(stream)
        held = self.peer_streams.get(peer, 0)
        if held >= MAX_STREAMS_PER_MEMBER:
            await self._reject(stream, peer, None, f"busy: {held} update streams from this peer are open "
                                                   f"here, at most {MAX_STREAMS_PER_MEMBER}; retry later")
            return
        self.peer_streams[peer] = held + 1
        first = True
        try:
            while await self._handle(stream, first):
                first = False
        finally:
            release_one(self.peer_streams, peer)
            await end_stream(stream)

    async def _handle(self, stream: INetStream, first: bool = True) -> bool:
        """One update; True if it was acked ``ok`` and the stream may carry the next."""
        peer = remote_peer(stream)
        # One clock for header and body: the whole update must keep the minimum rate after
        # one grace, so its deadline follows from its declared size (slow-loris senders
        # cannot hold a stream or the budget). An idle pooled stream's clock starts at the
        # next header's first byte.
        floor = RateFloor(self.min_rate)
        try:
            header = await read_message_floored(stream, HEADER_LIMIT, floor,
                                                None if first else IDLE_WAIT_SECONDS)
        except FrameTooSlow as exc:
            if not first and floor.idle:
                return False  # an idle pooled stream left idle by its sender
            await self._reject(stream, peer, None, f"bad update header: {exc}")
            return False
        except _HEADER_ENDED as exc:
            if not first and not isinstance(exc, ProtocolError):
                return False  # an idle pooled stream closed by its sender
            await self._reject(stream, peer, None, f"bad update header: {type(exc).__name__}: {exc}")
            return False
        except ProtocolError as exc:
            await self._reject(stream, peer, None, f"bad update header: {type(exc).__name__}: {exc}")
            return False
        # Checked per update, not only when the stream opened: a pooled stream may outlive
        # its sender's membership (revoked, certificate expired) by a while.
        cert = self.m.member_certificate(peer)
        if cert is None:
            await self._reject(stream, peer, None, "not a member (any more): no verified certificate "
                                                   "for this peer")
            return False
        source_cluster = cert.cluster_id
        if not isinstance(header, UpdateHeader):
            await self._reject(stream, peer, None, f"expected UpdateHeader, got {header.TYPE}")
            return False
        # On the data plane a small body may ride in its header's record (no go): it must be
        # exactly the rest of that record; anything else there is a framing error.
        extra = stream.pending if isinstance(stream, TlsStream) else 0
        inline = extra > 0
        if inline and not 0 < header.byte_length == extra <= INLINE_BODY_BYTES:
            await self._reject(stream, peer, header, f"{extra} bytes followed the header in its data-plane "
                                                     f"record; an inline body must be all of them "
                                                     f"(byte_length {header.byte_length}, at most "
                                                     f"{INLINE_BODY_BYTES})")
            return False
        try:
            receiver = UpdateReceiver(header, self.max_update_bytes)
        except MessageTooLarge as exc:
            await self._reject(stream, peer, header, str(exc))
            return False
        probe = header.job_id == PROBE_JOB_ID
        if not probe:
            misplaced = self.placements.refusal(header, source_cluster)
            if misplaced is not None:
                await self._reject(stream, peer, header, misplaced)
                return False
            seen = self.delivered.verdict(source_cluster, header)
            if seen == DUPLICATE:
                self.jobs[header.job_id].duplicates += 1
                log.info("update.duplicate", peer=peer, job=header.job_id, message_id=header.message_id)
                await self._ack(stream, header, "duplicate", "already delivered", 0)
                return False
            if seen is not None:
                await self._reject(stream, peer, header, seen)
                return False
            if dedup_key(source_cluster, header.message_id) in self.delivering:
                await self._reject(stream, peer, header, _BEING_DELIVERED)
                return False
            why_not = self.consumer.consumer_for(header.job_id)
            if why_not is not None:
                await self._reject(stream, peer, header, why_not)
                return False
            busy = self._busy(peer, source_cluster, header.byte_length)
            if busy is not None:
                await self._reject(stream, peer, header, busy)
                return False
        reserved = 0 if probe else header.byte_length
        self.inflight += reserved
        self.inflight_peak = max(self.inflight_peak, self.inflight)
        self.peer_inflight[peer] = self.peer_inflight.get(peer, 0) + reserved
        self.metrics.stream_opened("received")
        try:
            if getattr(stream, "half_duplex", False) and not inline:
                await self._ack(stream, header, "ok", GO_BLAKE3 if self._wants_trailer(header) else GO, 0)
            return await self._receive_body(stream, peer, header, receiver, probe, source_cluster, floor,
                                            inline)
        finally:
            if isinstance(stream, TlsStream) and not (probe or inline):
                self.spares.refill(header.byte_length)  # for the next body, in idle time
            self.inflight -= reserved
            left = self.peer_inflight.get(peer, reserved) - reserved
            if left > 0:
                self.peer_inflight[peer] = left
            else:
                self.peer_inflight.pop(peer, None)
            self.metrics.stream_closed("received")

    def _busy(self, peer: str, cluster: str, nbytes: int) -> str | None:
        """Why an update of ``nbytes`` from ``peer`` cannot be taken now (None if it can).

        The in-flight budget is shared per sending member: with k other members holding
        some, a member may hold up to budget/(k+2) - so there is always room left for one
        more member - except that its first update may take up to half the budget (all
        of it while nobody else sends), so any update within limits can go at some point.
        """
        budget = self.max_inflight_bytes
        if self.inflight + nbytes > budget:
            return (f"busy: {self.inflight} bytes of updates in flight on cluster {self.cluster_id!r}, "
                    f"limits.max_inflight_bytes {budget}; retry later")
        held = self.peer_inflight.get(peer, 0)
        others = sum(1 for p, n in self.peer_inflight.items() if n and p != peer)
        share = budget // (others + 2)
        if held == 0:
            share = max(share, budget if others == 0 else budget // 2)
        if held + nbytes > share:
            return (f"busy: cluster {cluster!r} already has {held} bytes of updates in flight here; its "
                    f"share of limits.max_inflight_bytes is {share} with {others} other sending "
                    f"member(s); retry later")
        return None

    async def _receive_body(self, stream: INetStream, peer: str, header: UpdateHeader,
                            receiver: UpdateReceiver, probe: bool, source_cluster: str,
                            floor: RateFloor, inline: bool = False) -> bool:
        # The data plane reads straight into the body's buffer and hashes it in a second
        # thread (fabricd._dataplane.TlsStream.receive_body); libp2p streams feed chunks.
        direct = isinstance(stream, TlsStream) and not inline
        # A memfd mapping, not bytearray(n): the kernel zeroes each page as the reading
        # thread first writes it, instead of this thread memsetting all of it up front
        # (holding the GIL the hashing thread needs); and the bridge can hand the verified
        # body to the executor as the memfd itself (fabricd.bridge), not as a byte stream.
        body = (memoryview(SharedMapping.allocate(header.byte_length, spares=self.spares))
                if direct and not probe and header.byte_length else None)
        try:
            return await self._receive_body_into(body, direct, stream, peer, header, receiver, probe,
                                                 source_cluster, floor, inline)
        finally:
            if body is not None:
                # After the ack: unmapping a received 64 MiB takes 10-20 ms, done in a
                # thread of its own so that this loop reads the next update meanwhile (the
                # executor keeps its own mapping of the memfd, so no memory is held longer).
                mapping = body.obj
                try:
                    body.release()
                except BufferError:
                    pass  # something still reads it: unmapped by the collector when it goes
                else:
                    _UNMAPPER.put(mapping)

    async def _receive_body_into(self, body: memoryview | None, direct: bool, stream: INetStream,
                                 peer: str, header: UpdateHeader, receiver: UpdateReceiver,
                                 probe: bool, source_cluster: str, floor: RateFloor,
                                 inline: bool) -> bool:
        started = time.perf_counter()
        cpu_started = time.process_time()
        algorithm, digest, claimed = claimed_digest(header)
        sink = digest.update if probe else receiver.feed
        received = 0
        # with "go blake3" the sender's trailer is what the body is verified against
        trailer: bytes | None = None
        try:
            if inline and isinstance(stream, TlsStream):
                # read with its header; small, so hashed right here (the header's claim)
                small = stream.take_pending()
                received = len(small)
                sink(small)
            elif isinstance(stream, TlsStream):
                if self._wants_trailer(header):
                    algorithm, digest = "blake3", blake3.blake3()
                received = await stream.receive_body(header.byte_length, body, digest, floor,
                                                     self.stream_timeout)
                if self._wants_trailer(header):
                    with trio.fail_after(floor.wait_budget(received, self.stream_timeout)):
                        trailer = await read_exactly(stream, 32)
            else:
                # Hashing runs in a worker thread (hashlib releases the GIL) while the next
                # chunk is read; at most two chunks wait for it, so memory stays bounded.
                send, receive = trio.open_memory_channel[bytes](2)
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_feed_in_thread, receive, sink)
                        async with send:
                            while received < header.byte_length:
                                # A read may wait only until the transfer would fall below the
                                # minimum rate (slow-loris senders must not hold the budget).
                                with trio.fail_after(floor.wait_budget(received, self.stream_timeout)):
                                    chunk = await stream.read(
                                        min(header.byte_length - received, self.chunk_bytes))
                                received += len(chunk)
                                too_slow = floor.too_slow(received)
                                if too_slow is not None:
                                    raise _TooSlow(too_slow)
                                await send.send(chunk)
                except BaseExceptionGroup as group:
                    raise _sole_exception(group) from None
        except (_TooSlow, BodyTooSlow) as exc:
            await self._reject(stream, peer, header, str(exc), received)
            return False
        except trio.TooSlowError:
            reason = floor.too_slow(received) or f"no body data for {self.stream_timeout:.0f} s"
            await self._reject(stream, peer, header, reason, received)
            return False
        except STREAM_ERRORS:
            if received < header.byte_length:
                await self._reject(stream, peer, header,
                                   f"body ended after {received} of {header.byte_length} bytes", received)
                return False
        except LengthMismatch as exc:
            await self._reject(stream, peer, header, str(exc), received)
            return False
        self.jobs[header.job_id].received_bytes += received
        try:
            if probe or direct:
                expected, says = (trailer, "the sender's trailer") if trailer is not None else (
                    claimed, "the header")
                if not hmac.compare_digest(digest.digest(), expected):
                    raise DigestMismatch(
                        f"update {header.message_id!r}: {algorithm} of the body is {digest.hexdigest()}, "
                        f"{says} says {expected.hex()}")
                payload: bytes | bytearray | memoryview = body if body is not None else bytearray()
            else:
                payload = receiver.finish()
        except (LengthMismatch, DigestMismatch) as exc:
            await self._reject(stream, peer, header, f"{type(exc).__name__}: {exc}", received)
            return False
        if not probe:
            key = dedup_key(source_cluster, header.message_id)
            seen = self.delivered.verdict(source_cluster, header)
            if seen == DUPLICATE:
                self.jobs[header.job_id].duplicates += 1
                await self._ack(stream, header, "duplicate", "already delivered", received)
                return False
            if seen is not None:
                await self._reject(stream, peer, header, seen, received)
                return False
            if key in self.delivering:
                await self._reject(stream, peer, header, _BEING_DELIVERED, received)
                return False
            self.delivering.add(key)
            try:
                await self.consumer.deliver(header, payload, source_cluster)
            except DeliveryError as exc:
                await self._reject(stream, peer, header, str(exc), received)
                return False
            finally:
                self.delivering.discard(key)
            # remembered only now: an update the executor did not accept may come again
            self.delivered.record(source_cluster, header)
        self.jobs[header.job_id].received_updates += 1
        seconds = time.perf_counter() - started
        self.metrics.update_received(source_cluster, received, seconds)
        log.info("update.received", peer=peer, cluster=source_cluster, job=header.job_id,
                 round=header.round, message_id=header.message_id, bytes=received,
                 seconds=round(seconds, 4), cpu_s=round(time.process_time() - cpu_started, 4),
                 verified=algorithm)
        await self._ack(stream, header, "ok", "", received)
        return True

    # ---- sending -----------------------------------------------------------------------

    async def send(self, peer_id: str, header: UpdateHeader, body: Body, gate: Gate | None = None) -> UpdateAck:
        """Stream one update to ``peer_id`` and return its ack (rejections included).

        Broken streams and failed opens are retried (bounded, with backoff; the receiver
        de-duplicates by message id), and so is a ``busy`` refusal for up to
        ``BUSY_RETRY_TIMEOUTS`` stream timeouts. Raises NotAMember if the peer is not a verified member, StreamLost or
        libp2p errors if it cannot be reached, trio.TooSlowError if no ack comes.
        """
        cert = await self.m.wait_verdict(peer_id)
        started = time.perf_counter()
        via: list[str] = []
        async with self.pool.slots(peer_id):
            self.metrics.stream_opened("sent")
            try:
                result = await self._send_retrying(peer_id, header, body, gate, via)
            finally:
                self.metrics.stream_closed("sent")
        counters = self.jobs[header.job_id]
        if result.status == "ok":
            counters.sent_bytes += header.byte_length
            counters.sent_updates += 1
            self.metrics.update_sent(cert.cluster_id, header.byte_length, time.perf_counter() - started)
            # the path the body took: the data plane (direct, or spliced by the receiver's
            # gateway), or libp2p over a direct or a relayed link
            path = via[-1] if via and via[-1].startswith("dataplane") else link_kind(self.host, peer_id)
            self.bytes_by_path[path] = self.bytes_by_path.get(path, 0) + header.byte_length
            self.metrics.update_path(cert.cluster_id, path, header.byte_length)
        return result

    async def _send_retrying(self, peer_id: str, header: UpdateHeader, body: Body,
                             gate: Gate | None, via: list[str] | None = None) -> UpdateAck:
        # The receiver waits up to its stream timeout for its executor's answer before it
        # acks (end-to-end delivery), so the ack may take that much longer than the body.
        ack_timeout = 2 * self.stream_timeout + header.byte_length / 50e6
        # A busy receiver frees its budget as updates complete: keep asking for a while
        # (several stream timeouts), so a burst queues up instead of failing.
        busy_until = time.monotonic() + BUSY_RETRY_TIMEOUTS * self.stream_timeout
        failures = busy = 0
        # a small body rides in its header's data-plane record (exchange_inline)
        small = inline_body(body) if 0 < len(body) <= self.dataplane_small_bytes else None
        bulk = self.bulk_pool is not None and (len(body) >= self.dataplane_min_bytes or small is not None)
        while True:
            pool = self.bulk_pool if bulk and self.bulk_pool is not None else self.pool
            try:
                stream, reused = await pool.take(peer_id)
            except DataPlaneUnavailable as exc:
                bulk = False  # this update goes over libp2p instead, at once
                self.dataplane_fallbacks += 1
                if not exc.remembered:  # one line per failed dial, not per update after it
                    log.warning("update.dataplane_fallback", peer=peer_id, message_id=header.message_id,
                                reason=str(exc), action="updates to this peer use libp2p for a while; "
                                "open the peer's data-plane port or set limits.dataplane_min_bytes = 0")
                continue
            except Exception as exc:  # noqa: BLE001 - StreamFailure after the open retries
                failures += 1
                if failures >= SEND_ATTEMPTS:
                    raise
                self.send_retries += 1
                log.info("update.retry", peer=peer_id, job=header.job_id, message_id=header.message_id,
                         reused=False, reason=f"opening a stream: {type(exc).__name__}: {exc}")
                await trio.sleep(backoff(failures + 3))
                continue
            try:
                if pool is self.pool:
                    result, completed = await exchange(stream, header, body, self.chunk_bytes, ack_timeout, gate)
                elif small is not None:
                    result, completed = await exchange_inline(stream, header, small, ack_timeout, gate)
                else:
                    result, completed = await exchange_half_duplex(
                        stream, header, body, self.chunk_bytes, self.stream_timeout, ack_timeout, gate)
            except StreamLost as exc:
                await discard(stream, clean=False)
                if not reused:  # a stale pooled stream costs one free retry
                    failures += 1
                    if failures >= SEND_ATTEMPTS:
                        raise
                self.send_retries += 1
                log.info("update.retry", peer=peer_id, job=header.job_id, message_id=header.message_id,
                         reused=reused, reason=str(exc))
                await trio.sleep(0 if reused else backoff(failures))
                continue
            except BaseException as exc:
                # also when cancelled (its bridge client left mid-payload): the stream is
                # reset all the same, so the receiver drops the partial body at once
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    await discard(stream, clean=False)
                log.info("update.send_failed", peer=peer_id, message_id=header.message_id,
                         reason=f"{type(exc).__name__}: {exc}")
                raise
            if result.status == "ok" and completed:
                pool.give_back(peer_id, stream)
            else:
                await discard(stream, clean=True)
            if result.status == "rejected" and result.reason.startswith(TOO_SLOW):
                # The receiver cut the body at its rate floor and freed its budget: one end
                # was starved (a loaded machine, a local client slow to hand over the
                # payload; on the data plane the whole body may already have been written
                # when the receiver, itself starved, cut it). Sent again under its message
                # id, it cannot be delivered twice.
                failures += 1
                if failures < SEND_ATTEMPTS:
                    self.send_retries += 1
                    log.info("update.retry", peer=peer_id, job=header.job_id, message_id=header.message_id,
                             reused=reused, reason=result.reason)
                    await trio.sleep(backoff(failures))
                    continue
            if (result.status == "rejected" and result.reason.startswith("busy:")
                    and time.monotonic() < busy_until):
                busy += 1
                self.send_retries += 1
                await trio.sleep(backoff(busy))
                continue
            if via is not None:
                via.append("libp2p" if pool is self.pool else
                           "dataplane_relayed" if getattr(stream, "via", "") else "dataplane")
            return result


class _Unmapper:
    """Unmaps received bodies' mappings, one after another, in a thread of its own (started
    on first use). A mapping that a view still refers to is left to the collector."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def put(self, mapping: object) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fedpilot-unmap", daemon=True)
                self._thread.start()
        self._queue.put(mapping)

    def _run(self) -> None:
        while True:
            unmap_quietly(self._queue.get())  # type: ignore[arg-type]


_UNMAPPER = _Unmapper()
