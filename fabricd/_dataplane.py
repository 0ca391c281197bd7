"""The bulk data plane: large update bodies over TLS-keyed connections between members.

libp2p (Noise + yamux in Python, one thread) keeps membership, discovery, gossip, control
and small updates. A body of at least ``limits.dataplane_min_bytes`` goes over a plain TCP
connection: TLS 1.3 authenticates both ends and carries two fresh keys, then the
connection leaves TLS and carries AES-256-GCM records (``Records``: what kTLS would do; the
kernel here has no ``tls`` ULP, and Python's ``ssl`` opens one 16 KiB record per call at
~3x the CPU). Socket calls and crypto run in worker threads, and a body is hashed by a
second thread while the next record is read, so the event loop, decryption and the digest use
more than one core. It is on by default (``limits.dataplane_min_bytes``, 1 MiB);
``dataplane_min_bytes = 0`` turns it off.

A peer whose data-plane port cannot be reached (a NAT, firewall or forwarder that passes
only the libp2p port) costs one short dial (``DIAL_SECONDS``): the update goes over libp2p
at once, and so does every large update to that peer while it is remembered as
unreachable (``UNREACHABLE_SECONDS``, doubling per failure again up to
``UNREACHABLE_MAX_SECONDS``; a success forgets it). A receiver behind NAT
(``reachability = "private"``) has its gateway splice the connection instead
(fabricd/_splice.py): its ticket names the gateway, and the handshake below runs end to
end through it.

Trust comes only from the membership already proven on libp2p - no new root. Python's
``ssl`` has no verify callback, so a TLS certificate cannot be checked against the
federation CA's (non-X.509, ed25519) membership certificates directly; instead each side
learns the other's TLS certificate over a channel that the CA already authenticated and
pins it exactly:

1. Every daemon makes an ephemeral ECDSA P-256 key and self-signed certificate at start
   (its private key never leaves a 0600 file in a private temporary directory).
2. The sender asks for a ticket on ``/fedpilot/dataplane/1.0.0``: a libp2p stream, so
   Noise proves both peer ids and ``Membership.guard`` admits CA-verified members only.
   It gives its TLS certificate; the receiver answers with its own, its data-plane port
   and a one-time random ticket bound to the sender's peer id and the fingerprint of
   the sender's TLS certificate (valid ``TICKET_SECONDS``, at most
   ``TICKETS_PER_PEER`` outstanding per member).
3. The sender connects and runs TLS 1.3 with its certificate and trusts exactly the
   receiver's (so it talks to the member it asked, and nobody else); the receiver
   requires a client certificate (trusted: only the current certificate of each member
   that asked for a ticket) and reads the ticket and the two record keys (one per
   direction, drawn by the sender) as the first bytes inside TLS. The ticket is spent
   on its first use, whatever the outcome; it must name the client certificate that TLS
   just proved, and its peer must still be a member. Then both sides leave TLS
   (close_notify both ways: the receiver's is the acceptance the sender waits for). The
   connection serves that member only, and membership is re-checked per update.

The connection carries the same frames as a pooled update stream, half duplex: the
sender writes a header, the receiver answers a go (``UpdateAck`` ok, reason ``go``) or its
refusal, then the body, then the final ack. So no two threads ever use one connection's
record state at once, and a refused large body is never sent. A small body (at most
``INLINE_BODY_BYTES``, ``limits.dataplane_small_bytes``) rides in its header's record
instead - no go, one ack back - and the receiver, which then holds at most one such record
per connection before admission, may still refuse it. Headers, acks and small bodies are
read, opened, sealed and written on the event loop (no worker-thread hop: a 1 KiB update
costs each daemon ~0.5 ms of CPU instead of ~1.8 ms over Noise + yamux); large bodies in
worker threads. Strangers get nothing: a connection that does
not finish TLS and present a valid ticket within ``HANDSHAKE_SECONDS`` is closed, and at
most ``MAX_HANDSHAKES`` handshakes run at once. Strangers cannot keep a member out either:
a connection holds no handshake slot until its first bytes come (at most ``MAX_WAITING``
wait, the oldest is dropped for a newcomer), and a member's opens with ``TICKET_MAGIC`` and
a tag of its ticket (a hash: the ticket itself stays inside TLS), which gives it a slot
among ``MAX_HANDSHAKES`` of its own - whatever strangers hold, only a ticket's holder
gets one of those.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import queue
import secrets
import socket
import ssl
import tempfile
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import trio
from cryptography import x509
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.x509.oid import NameOID
from libp2p.abc import IHost, INetStream
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID

from fabricd._bounded import BoundedDict, Throttle
from fabricd._relay import link_kind, relay_of
from fabricd._sender import INLINE_BODY_BYTES, open_stream
from fabricd._splice import SPLICE_MAGIC, SpliceService, park, peer_ip
from fabricd._splice import TOKEN_BYTES as SPLICE_TOKEN_BYTES
from fabricd._splice import request as request_splice
from fabricd._streams import close_quietly, read_message_exact, remote_peer, write_message
from fabricd.admission import RateFloor
from fabricd.errors import FabricdError
from fedcore.logs import get_logger
from proto.ids import PROTOCOL_DATAPLANE
from proto.messages import DataPlaneOffer, DataPlaneTicket

log = get_logger("fabricd.dataplane")

TICKET_SECONDS = 10.0
TICKET_BYTES = 32
HANDSHAKE_SECONDS = 5.0
MAX_HANDSHAKES = 64
MAX_TICKETS = 1024
#: outstanding tickets one member may hold (its sender opens at most 8 connections at once)
TICKETS_PER_PEER = 16
#: members whose TLS certificate this daemon trusts (one current certificate each)
MAX_TRUSTED_PEERS = 4096
#: after a failed ticket request or dial, a peer's large updates use libp2p for this long,
#: doubled per consecutive failure (a peer behind a NAT keeps failing) up to the maximum
UNREACHABLE_SECONDS = 60.0
UNREACHABLE_MAX_SECONDS = 900.0
#: the TCP connect of a data-plane dial (one SYN retransmission: Linux resends after 1 s);
#: TLS and the ticket then have HANDSHAKE_SECONDS
DIAL_SECONDS = 2.0
#: worker threads of the data plane (socket calls and handshakes)
MAX_THREADS = 512
#: how long one blocking socket call may wait before the event loop gets to look at
#: cancellation (rate floors, shutdown)
POLL_SECONDS = 0.5
WRITE_SECONDS = 30.0
FRAME_LIMIT = 64 * 1024
#: a member's data-plane connection opens with these bytes and its ticket's tag (cleartext)
TICKET_MAGIC = b"FPDP"
TICKET_TAG_BYTES = 16
#: a receiver behind NAT connecting back to the sender's port opens with these bytes and
#: the nonce of the sender's offer (cleartext); the sender then runs its usual handshake
REVERSE_MAGIC = b"FPRV"
REVERSE_NONCE_BYTES = 16
#: connections waiting for their first bytes, without a handshake slot
MAX_WAITING = 512


#: plaintext of one record at most: a body is read a record at a time, and the hashing
#: thread takes one record's bytes while the next is read
RECORD_BYTES = 1024 * 1024
TAG_BYTES = 16
NONCE_BYTES = 12
#: AES-256-GCM, one key per direction
KEY_BYTES = 32
#: records of a body that is not kept (a probe): the reader fills one while the hasher
#: hashes the others, so memory is bounded by RING * RECORD_BYTES per transfer
RING = 4
#: the largest record ``TlsStream.read`` takes (a header frame with an inline body of at
#: most INLINE_BODY_BYTES, which the receiver may still refuse; acks, trailers): read,
#: opened and sealed on the event loop, with no worker-thread hop
LOOP_RECORD_BYTES = FRAME_LIMIT + INLINE_BODY_BYTES + 64

T = TypeVar("T")


class DataPlaneUnavailable(FabricdError):
    """No data-plane connection could be made to a peer (the caller falls back to libp2p);
    ``remembered``: not tried, the peer failed lately."""

    def __init__(self, message: str, remembered: bool = False) -> None:
        super().__init__(message)
        self.remembered = remembered


class BodyTooSlow(FabricdError):
    """A body on the data plane fell below the minimum rate or stalled (the message says
    which, for the sender)."""


class _Stopped(FabricdError):
    """The event loop gave up on a body (cancelled): its reading thread stops."""


def _fingerprint(der: bytes) -> bytes:
    return hashlib.sha256(der).digest()


@dataclass
class _Identity:
    der: bytes
    pem: bytes
    cert_path: str
    key_path: str


def _make_identity(peer_id: str, directory: Path) -> _Identity:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, peer_id[:64])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=30))
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    cert_path, key_path = directory / "dataplane.crt", directory / "dataplane.key"
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    cert_path.write_bytes(pem)
    return _Identity(cert.public_bytes(serialization.Encoding.DER), pem, str(cert_path), str(key_path))


def _context(identity: _Identity, *, server: bool, pinned: bytes | None = None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(identity.cert_path, identity.key_path)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    if server:
        ctx.num_tickets = 0  # no resumption: nothing may arrive between the handshake and unwrap
    if pinned is not None:
        ctx.load_verify_locations(cadata=pinned)
    return ctx


class _Conn:
    def __init__(self, peer_id: ID) -> None:
        self.peer_id = peer_id


def _ticket_tag(ticket: bytes) -> bytes:
    return hashlib.sha256(b"fedpilot-dataplane-ticket-tag" + ticket).digest()[:TICKET_TAG_BYTES]


def _nonce(counter: int) -> bytes:
    return counter.to_bytes(NONCE_BYTES, "big")


class Records:
    """AES-256-GCM records on the plain TCP socket, keyed inside TLS 1.3 (blocking; one
    thread at a time).

    A record is a 4-byte big-endian plaintext length (the associated data) then the
    ciphertext and its 16-byte tag. Each direction has its own key, fresh per
    connection, and an implicit nonce that counts records from 0: a record that was
    altered, dropped, replayed or reordered fails its tag and ends the connection."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes) -> None:
        if isinstance(sock, ssl.SSLSocket):  # left TLS: a plain socket skips ssl's wrappers
            timeout = sock.gettimeout()
            sock = socket.socket(fileno=sock.detach())
            sock.settimeout(timeout)
        self.sock = sock
        self._tx, self._rx = AESGCM(send_key), AESGCM(recv_key)
        self._sent = self._got = 0
        self._out = bytearray(0)
        self._sealed = bytearray(RECORD_BYTES + TAG_BYTES)
        self._head = bytearray(4)

    def _timeout(self, seconds: float) -> None:
        # (a changed timeout costs a system call: most calls keep theirs)
        if self.sock.gettimeout() != seconds:
            self.sock.settimeout(seconds)

    def send(self, data: Any) -> None:
        """Seal and send all of ``data`` (records of at most RECORD_BYTES)."""
        view = memoryview(data).cast("B")
        self._timeout(WRITE_SECONDS)
        for start in range(0, len(view), RECORD_BYTES):  # nothing for b"": b"" reads as the end
            piece = view[start:start + RECORD_BYTES]
            size = 4 + len(piece) + TAG_BYTES
            if len(self._out) < size:
                self._out = bytearray(max(size, min(RECORD_BYTES + 4 + TAG_BYTES, 2 * size)))
            out = memoryview(self._out)[:size]
            head = len(piece).to_bytes(4, "big")
            out[:4] = head
            self._tx.encrypt_into(_nonce(self._sent), piece, head, out[4:])
            self._sent += 1
            self.sock.sendall(out)

    def seal(self, piece: Any) -> bytearray:
        """One record of ``piece`` (at most RECORD_BYTES), sealed under the next send nonce:
        the caller must send all of it, or the connection is over."""
        size = len(piece)
        out = bytearray(4 + size + TAG_BYTES)
        head = size.to_bytes(4, "big")
        out[:4] = head
        self._tx.encrypt_into(_nonce(self._sent), piece, head, memoryview(out)[4:])
        self._sent += 1
        return out

    def open(self, head: bytes, sealed: bytes | bytearray) -> bytes:
        """The plaintext of the next record received (``head``: its 4-byte length)."""
        try:
            plain = self._rx.decrypt(_nonce(self._got), bytes(sealed), head)
        except InvalidTag:
            raise RecordRefused("a data-plane record failed authentication (altered, replayed "
                                "or out of order)") from None
        self._got += 1
        return plain

    def recv_into(self, destination: Callable[[int], memoryview], waiting: Callable[[], None]) -> int:
        """Receive one record and open it into ``destination(length)`` (a view of exactly
        that length; it may raise to refuse the length); ``waiting()`` is called each
        POLL_SECONDS nothing comes (it raises to give up). StreamEOF at the end of the
        connection, RecordRefused for a record that does not open."""
        head = memoryview(self._head)
        self._recv_exact(head, waiting)
        length = int.from_bytes(head, "big")
        if length > RECORD_BYTES:
            raise RecordRefused(f"a data-plane record of {length} bytes, at most {RECORD_BYTES}")
        sealed = memoryview(self._sealed)[:length + TAG_BYTES]
        self._recv_exact(sealed, waiting)
        try:
            self._rx.decrypt_into(_nonce(self._got), sealed, bytes(head), destination(length))
        except InvalidTag:
            raise RecordRefused("a data-plane record failed authentication (altered, replayed "
                                "or out of order)") from None
        self._got += 1
        return length

    def recv(self, waiting: Callable[[], None]) -> bytes:
        """One record's plaintext."""
        out = bytearray(0)

        def destination(length: int) -> memoryview:
            out.extend(bytes(length))
            return memoryview(out)

        self.recv_into(destination, waiting)
        return bytes(out)

    def _recv_exact(self, view: memoryview, waiting: Callable[[], None]) -> None:
        got = 0
        self._timeout(POLL_SECONDS)
        while got < len(view):
            try:
                k = self.sock.recv_into(view[got:], len(view) - got)
            except TimeoutError:
                waiting()
                continue
            if k == 0:
                raise StreamEOF("data-plane connection ended")
            got += k


class RecordRefused(FabricdError):
    """A data-plane record was too long, failed authentication or crossed a body's end
    (the connection is closed)."""


def dial(address: str, port: int, ctx: ssl.SSLContext, ticket: bytes, splice: bytes = b"",
         back: socket.socket | None = None) -> Records:
    """Connect, run TLS 1.3 (``ctx`` pins the receiver's certificate), present the ticket
    and two fresh record keys inside it, then leave TLS (close_notify both ways): the
    receiver's close_notify is its acceptance. Blocking; OSError/ssl.SSLError if refused.
    ``splice``: ``address`` is the receiver's gateway, which joins us to it by this token;
    ``back``: no connect, the receiver connected back to us on this socket."""
    raw = back or socket.create_connection((address, port), timeout=DIAL_SECONDS)
    try:
        raw.settimeout(HANDSHAKE_SECONDS)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw.sendall((SPLICE_MAGIC + splice if splice else b"") + TICKET_MAGIC + _ticket_tag(ticket))
        sock = ctx.wrap_socket(raw, server_side=False)
        keys = secrets.token_bytes(2 * KEY_BYTES)
        sock.sendall(ticket + keys)
        plain = sock.unwrap()
    except BaseException:
        raw.close()
        raise
    return Records(plain, keys[:KEY_BYTES], keys[KEY_BYTES:])


class TlsStream:
    """One data-plane connection, looking like a libp2p stream to the update code:
    ``read``/``write``/``close``/``reset`` and ``muxed_conn.peer_id`` (the member the
    ticket was issued to). Records of at most LOOP_RECORD_BYTES (headers, acks, small
    bodies) are read and written on the event loop with non-blocking socket calls; large
    bodies run in worker threads that look at cancellation every POLL_SECONDS, so trio's
    deadlines (rate floors) apply to both. A record cut short (cancelled, failed) ends the
    connection: its record state is lost."""

    half_duplex = True

    def __init__(self, records: Records, peer_id: ID, limiter: trio.CapacityLimiter, via: str = "") -> None:
        self.records = records
        #: the gateway that splices this connection (its receiver is behind NAT), or ""
        self.via = via
        self.muxed_conn = _Conn(peer_id)
        self.closed = False
        #: the data plane's own threads: idle connections polling must not take the
        #: threads hashing and the rest of the daemon use
        self.limiter = limiter
        #: plaintext of the last record not yet read
        self._pending = b""

    async def _in_thread(self, work: Callable[[threading.Event], T]) -> T:
        """``work(stop)`` in a worker thread; on cancellation ``stop`` is set and the
        connection (whose record state the thread owns) is closed once it returned."""
        if self.closed:
            raise StreamEOF("data-plane connection closed")
        stop = threading.Event()
        done = threading.Event()
        # "waiting" until the thread takes the work ("running"); "dropped" if it was
        # cancelled first (waiting for a thread of the busy limiter, or not yet begun)
        phase = ["waiting"]
        phase_lock = threading.Lock()

        def run() -> T:
            with phase_lock:
                if phase[0] == "dropped":
                    raise _Stopped("cancelled before it began")
                phase[0] = "running"
            try:
                return work(stop)
            finally:
                done.set()

        try:
            return await trio.to_thread.run_sync(  # type: ignore[call-arg, no-any-return]
                run, abandon_on_cancel=True, limiter=self.limiter)
        except trio.Cancelled:
            # The thread owns the socket's record state: wake it with a shutdown (the
            # descriptor stays its own) and close only once it let go. Work that never
            # began holds nothing: no wait (it waited WRITE_SECONDS for a thread that
            # would never come, and kept a bridge client's budget booked that long)
            stop.set()
            with contextlib.suppress(OSError):
                self.records.sock.shutdown(socket.SHUT_RDWR)
            with phase_lock:
                began = phase[0] == "running"
                phase[0] = phase[0] if began else "dropped"
            with trio.CancelScope(shield=True):
                let_go = not began or await trio.to_thread.run_sync(done.wait, WRITE_SECONDS)
            if let_go:
                await self.close()
            else:
                self.closed = True
            raise
        except (OSError, RecordRefused, _Stopped) as exc:
            await self.close()
            raise StreamEOF(f"data-plane connection broke: {type(exc).__name__}: {exc}") from exc
        except StreamEOF:
            await self.close()
            raise

    async def read(self, n: int | None = None) -> bytes:
        if not self._pending:
            self._pending = await self._recv_on_loop()
        n = n if n and n > 0 else len(self._pending)
        out, self._pending = self._pending[:n], self._pending[n:]
        return out

    def take_pending(self) -> bytes:
        """What is left of the last record read (an inline body after its header)."""
        out, self._pending = self._pending, b""
        return out

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def write(self, data: Any) -> None:
        if len(data) <= LOOP_RECORD_BYTES:
            await self._send_on_loop(data)
        else:
            await self._in_thread(lambda stop: self.records.send(data))

    async def _send_on_loop(self, data: Any) -> None:
        """Seal ``data`` as one record and send it from the event loop (waiting for room in
        the socket's buffer at most WRITE_SECONDS)."""
        if self.closed:
            raise StreamEOF("data-plane connection closed")
        await trio.lowlevel.checkpoint_if_cancelled()  # before the record is sealed
        record = memoryview(self.records.seal(data))
        sock = self.records.sock
        sent = 0
        try:
            self.records._timeout(0.0)
            try:
                sent = sock.send(record)  # most often all of it: no deadline to set up
            except BlockingIOError:
                pass
            if sent < len(record):
                with trio.fail_after(WRITE_SECONDS):
                    while sent < len(record):
                        try:
                            sent += sock.send(record[sent:])
                        except BlockingIOError:
                            await trio.lowlevel.wait_writable(sock.fileno())
        except BaseException as exc:
            await self.close()  # the record was sealed: unsent, the nonces disagree
            if isinstance(exc, (OSError, trio.TooSlowError, trio.ClosedResourceError)):
                raise StreamEOF(f"data-plane connection broke: {type(exc).__name__}: {exc}") from exc
            raise

    async def _recv_on_loop(self) -> bytes:
        """The next record's plaintext (at most LOOP_RECORD_BYTES), read on the event loop.
        Cancelled before its first byte, the connection stays usable."""
        if self.closed:
            raise StreamEOF("data-plane connection closed")
        sock = self.records.sock
        head = bytearray(4)
        consumed = 0

        async def fill(buf: bytearray) -> None:
            nonlocal consumed
            view = memoryview(buf)
            got = 0
            while got < len(view):
                try:
                    k = sock.recv_into(view[got:])
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(sock.fileno())
                    continue
                if k == 0:
                    raise StreamEOF("data-plane connection ended")
                got += k
                consumed += k

        try:
            self.records._timeout(0.0)
            await fill(head)
            length = int.from_bytes(head, "big")
            if length > LOOP_RECORD_BYTES:
                raise RecordRefused(f"a data-plane record of {length} bytes where at most "
                                    f"{LOOP_RECORD_BYTES} may come (a header, an ack or a small body)")
            sealed = bytearray(length + TAG_BYTES)
            await fill(sealed)
            return self.records.open(bytes(head), sealed)
        except trio.Cancelled:
            if consumed:
                await self.close()
            raise
        except BaseException as exc:
            await self.close()
            if isinstance(exc, (OSError, RecordRefused, trio.ClosedResourceError)):
                raise StreamEOF(f"data-plane connection broke: {type(exc).__name__}: {exc}") from exc
            raise

    async def write_many(self, pieces: list[memoryview], digest: Any = None) -> None:
        """``write`` each piece, all in one worker-thread call, and feed them to ``digest``
        in a second thread meanwhile (BLAKE3 and AES-GCM both release the GIL: the body is
        hashed while it is encrypted and sent, not before); returns when both are done."""
        if digest is None or len(pieces) < 2:
            def send(stop: threading.Event) -> None:
                for piece in pieces:
                    if digest is not None:
                        digest.update(piece)
                    self.records.send(piece)
        else:
            def send(stop: threading.Event) -> None:
                failed: list[BaseException] = []

                def hash_pieces() -> None:
                    try:
                        for piece in pieces:
                            digest.update(piece)
                    except BaseException as exc:  # noqa: BLE001 - re-raised by the sender
                        failed.append(exc)

                hasher = threading.Thread(target=hash_pieces, name="fabricd-dataplane-hash", daemon=True)
                hasher.start()
                try:
                    for piece in pieces:
                        self.records.send(piece)
                finally:
                    hasher.join()
                if failed:
                    raise failed[0]

        await self._in_thread(send)

    async def receive_body(self, nbytes: int, into: bytearray | memoryview | None, digest: Any, floor: RateFloor,
                           idle: float) -> int:
        """Read a body of ``nbytes`` into ``into`` (or, if None, into a small ring of
        regions that are only hashed) and feed it to ``digest`` in order; returns the
        bytes read (== nbytes).

        One thread reads and opens each record straight into the destination, a second
        hashes what is already there (hashlib releases the GIL), so decryption and
        the digest overlap with no copy and no event-loop hop per record. The rate floor and
        the idle limit are kept by the reading thread: BodyTooSlow says which; StreamEOF
        if the connection ends, breaks or sends a record across the body's end."""
        if self._pending:
            await self.close()
            raise StreamEOF("data-plane protocol: a record ran from the header into the body")
        return await self._in_thread(lambda stop: self._read_body(nbytes, into, digest, floor, idle, stop))

    def _read_body(self, nbytes: int, into: bytearray | memoryview | None, digest: Any, floor: RateFloor,
                   idle: float, stop: threading.Event) -> int:
        filled: queue.Queue[memoryview | None] = queue.Queue()
        free: queue.Queue[bytearray] = queue.Queue()
        if into is None:
            for _ in range(RING):
                free.put(bytearray(min(RECORD_BYTES, max(nbytes, 1))))
        failed: list[BaseException] = []

        def hash_regions() -> None:
            while (region := filled.get()) is not None:
                if not failed:
                    try:
                        digest.update(region)
                    except BaseException as exc:  # noqa: BLE001 - handed to the reader
                        failed.append(exc)
                if into is None:
                    free.put(region.obj)  # type: ignore[arg-type]
                region.release()

        hasher = threading.Thread(target=hash_regions, name="fabricd-dataplane-hash", daemon=True)
        hasher.start()
        whole = memoryview(into) if into is not None else None
        received = 0
        last = time.monotonic()
        region: memoryview | None = None

        def waiting() -> None:
            if stop.is_set() or failed:
                raise _Stopped("the transfer was given up")
            too_slow = floor.too_slow(received)
            if too_slow is not None:
                raise BodyTooSlow(too_slow)
            if time.monotonic() - last >= idle:
                raise BodyTooSlow(f"no body data for {idle:.0f} s")

        def destination(length: int) -> memoryview:
            nonlocal region
            if length > nbytes - received:
                raise RecordRefused(f"a data-plane record of {length} bytes runs past the body's "
                                    f"{nbytes} bytes (at {received})")
            if whole is not None:
                region = whole[received:received + length]
            else:
                while True:
                    try:
                        region = memoryview(free.get(timeout=POLL_SECONDS))[:length]
                        break
                    except queue.Empty:
                        waiting()
            return region

        try:
            while received < nbytes:
                region = None
                got = self.records.recv_into(destination, waiting)
                assert region is not None
                received += got
                last = time.monotonic()
                filled.put(region)
                too_slow = floor.too_slow(received)
                if too_slow is not None:
                    raise BodyTooSlow(too_slow)
                if failed:
                    raise failed[0]
            return received
        finally:
            filled.put(None)
            hasher.join()
            if whole is not None:
                whole.release()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        fd = self.records.sock.fileno()
        if fd >= 0:
            try:  # wakes a task of ours waiting for it (ClosedResourceError)
                trio.lowlevel.notify_closing(fd)
            except RuntimeError:
                pass  # not in trio (a test's thread)
        try:
            self.records.sock.close()
        except OSError:
            pass

    async def reset(self) -> None:
        await self.close()


class DataPlane:
    """Both halves of the data plane of one daemon."""

    def __init__(self, host: IHost, *, listen_ip: str, is_member: Callable[[str], bool],
                 serve: Callable[[TlsStream], Awaitable[None]], state_dir: Path | None = None) -> None:
        self.host = host
        self.listen_ip = listen_ip
        self.is_member = is_member
        self.serve = serve
        self._tmp = tempfile.TemporaryDirectory(prefix="fabricd-dp-", dir=state_dir)
        self.identity = _make_identity(str(host.get_id()), Path(self._tmp.name))
        #: the current TLS certificate (DER) of each member that asked for a ticket
        self.client_certs: BoundedDict[str, bytes] = BoundedDict(MAX_TRUSTED_PEERS)
        self.server_ctx = _context(self.identity, server=True)
        #: peers whose ticket request or dial failed lately -> (until when libp2p is used
        #: instead, consecutive failures)
        self.unreachable: BoundedDict[str, tuple[float, int]] = BoundedDict(MAX_TRUSTED_PEERS)
        #: peers a data-plane connection was made to (dials to them may run in parallel)
        self.reached: BoundedDict[str, bool] = BoundedDict(MAX_TRUSTED_PEERS)
        #: peers not reached yet -> the one dial to them under way
        self._first_dial: dict[str, trio.Event] = {}
        #: ticket -> (peer id, client certificate fingerprint, expiry)
        self.tickets: BoundedDict[bytes, tuple[str, bytes, float]] = BoundedDict(MAX_TICKETS)
        self.port = 0
        self._handshakes = trio.Semaphore(MAX_HANDSHAKES)
        #: handshake slots for connections that showed an outstanding ticket's tag
        self._expected = trio.Semaphore(MAX_HANDSHAKES)
        #: tags of outstanding tickets -> (unused)
        self.ticket_tags: BoundedDict[bytes, bool] = BoundedDict(MAX_TICKETS)
        #: connections waiting for their first bytes, oldest first
        self._waiting: dict[object, trio.CancelScope] = {}
        self.limiter = trio.CapacityLimiter(MAX_THREADS)
        self._throttle = Throttle(log)
        self.accepted = 0
        self.refused = 0
        self.opened = 0
        #: connections that could not be made (each is one dial or ticket request)
        self.failed = 0
        #: network.reachability = "private": nobody can dial our port; a ticket then names
        #: a gateway that splices the sender's connection to one of ours (fabricd/_splice.py)
        self.behind_nat = False
        #: network.reachability = "auto": a sender that reaches us only through a relay gets
        #: a splice too (our port may be out of its reach); any other gets our port
        self.splice_relayed = False
        #: the gateways this daemon holds relay reservations at (private or auto)
        self.gateways: Callable[[], list[str]] = list
        #: a gateway's splices (relay_service = true)
        self.splices: SpliceService | None = None
        #: our connections spliced by a gateway (ended when the gateway goes silent)
        self._spliced_streams: weakref.WeakSet[TlsStream] = weakref.WeakSet()
        #: nonces of our offers under way -> (set when the receiver connected back, its socket)
        self._back: dict[bytes, tuple[trio.Event, list[trio.socket.SocketType]]] = {}
        self._nursery: trio.Nursery | None = None

    # ---- receiving ---------------------------------------------------------------------

    def register(self, guard: Callable[..., Any]) -> None:
        handler = guard("dataplane", self._issue, on_refuse=self._refuse)
        self.host.set_stream_handler(PROTOCOL_DATAPLANE, handler)  # type: ignore[arg-type]

    async def _refuse(self, stream: INetStream, reason: str) -> None:
        await write_message(stream, DataPlaneTicket(port=0, certificate=b"", ticket=b"", reason=reason))

    async def _issue(self, stream: INetStream) -> None:
        peer = remote_peer(stream)
        try:
            with trio.fail_after(HANDSHAKE_SECONDS):
                offer = await read_message_exact(stream, FRAME_LIMIT)
            if not isinstance(offer, DataPlaneOffer):
                await self._refuse(stream, f"expected DataPlaneOffer, got {offer.TYPE}")
                return
            if not self.port or self._nursery is None:
                await self._refuse(stream, "unavailable: the data plane is not listening")
                return
            outstanding = sum(1 for p, _, _ in self.tickets.values() if p == peer)
            if outstanding >= TICKETS_PER_PEER:
                await self._refuse(stream, f"busy: {outstanding} data-plane tickets of peer {peer} are "
                                           f"outstanding, at most {TICKETS_PER_PEER}; retry later")
                return
            self._trust(peer, offer.certificate)
            port, via, splice, back = self.port, "", b"", None
            # a link DCUtR upgraded reaches only the peer's libp2p port: its body is spliced
            # as over a relayed link (bench/bench_wan_paths.py: 1.22x the punched libp2p
            # connection's throughput at 10 ms RTT, 1.53x at 80 ms and 1 % loss)
            relayed = ((self.behind_nat or self.splice_relayed)
                       and link_kind(self.host, peer) in ("relayed", "upgraded"))
            if self.behind_nat and not relayed:
                # a member we reach directly (we dialled it): we connect to its port instead
                back = await self._connect_back(stream, offer)
                if isinstance(back, str):
                    await self._refuse(stream, "unavailable: this daemon is behind NAT (network.reachability = "
                                               f"private) and could not connect back to you: {back}")
                    return
                port = 0
            elif self.behind_nat or self.splice_relayed and relayed:
                spliced = await self._spliced(peer)
                if isinstance(spliced, str):
                    await self._refuse(stream, "unavailable: this daemon's port is out of your reach (behind "
                                               f"NAT, network.reachability) and no gateway spliced: {spliced}")
                    return
                port, via, splice = spliced
            ticket = secrets.token_bytes(TICKET_BYTES)
            self.tickets[ticket] = (peer, _fingerprint(offer.certificate), time.monotonic() + TICKET_SECONDS)
            self.ticket_tags[_ticket_tag(ticket)] = True
            if back is not None:
                assert self._nursery is not None
                self._nursery.start_soon(self._accept, back, f"{peer} (connected back)")
            await write_message(stream, DataPlaneTicket(port=port, certificate=self.identity.der, ticket=ticket,
                                                        reason="", via=via, splice=splice, reverse=back is not None))
        except (ssl.SSLError, ValueError) as exc:
            await self._refuse(stream, f"bad data-plane certificate: {exc}")
        except trio.TooSlowError:
            # a member that opens the stream and offers nothing: not a crash of ours
            log.info("dataplane.refused", peer=peer,
                     reason=f"no DataPlaneOffer within {HANDSHAKE_SECONDS:g} s")
        finally:
            await close_quietly(stream)

    async def _connect_back(self, stream: INetStream, offer: DataPlaneOffer) -> trio.socket.SocketType | str:
        """Behind NAT, asked by a sender we reach directly: our connection to its own
        data-plane port (at the address of our link to it), opened with its offer's nonce;
        or why none could be made."""
        address = stream.get_remote_address()
        if not offer.port or len(offer.nonce) != REVERSE_NONCE_BYTES or address is None:
            return "your offer names no data-plane port of yours"
        try:
            return await park(str(address[0]), offer.port, REVERSE_MAGIC + offer.nonce)
        except (OSError, trio.TooSlowError) as exc:
            return f"{address[0]}:{offer.port}: {type(exc).__name__}: {exc}"

    async def _spliced(self, peer: str) -> tuple[int, str, bytes] | str:
        """Behind NAT: a splice for sender ``peer`` at one of our gateways, our half
        connected and served as if our listener had accepted it: (the gateway's port, its
        peer id, the sender's token), or why none could be had."""
        failures = []
        carrying = relay_of(self.host, peer)  # first the gateway our libp2p link to the sender uses
        for gateway in sorted(self.gateways(), key=lambda g: g != carrying):
            try:
                ip, grant = await request_splice(self.host, gateway, peer)
                sock = await park(ip, grant.port, SPLICE_MAGIC + grant.listen_token)
            except (ConnectionError, OSError, trio.TooSlowError) as exc:
                failures.append(f"{gateway}: {type(exc).__name__}: {exc}")
                continue
            assert self._nursery is not None
            self._nursery.start_soon(self._accept, sock, f"{ip}:{grant.port} (spliced by {gateway})")
            return grant.port, gateway, grant.dial_token
        return "; ".join(failures) or "no relay reservation held"

    def _trust(self, peer: str, der: bytes) -> None:
        """Trust ``der`` as member ``peer``'s client certificate (replacing its previous one).

        The store holds one certificate per member, so it is bounded by the membership; a
        replaced or evicted certificate stops being trusted by new handshakes."""
        if self.client_certs.get(peer) == der:
            return
        x509.load_der_x509_certificate(der)  # ValueError if it is not a certificate
        replacing = peer in self.client_certs or len(self.client_certs) >= MAX_TRUSTED_PEERS
        self.client_certs[peer] = der
        if replacing:
            ctx = _context(self.identity, server=True)
            for known in self.client_certs.values():
                ctx.load_verify_locations(cadata=known)
            self.server_ctx = ctx
        else:
            self.server_ctx.load_verify_locations(cadata=der)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen for data-plane connections until cancelled."""
        listener = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
        listener.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
        await listener.bind((self.listen_ip, 0))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        log.info("dataplane.listening", address=f"{self.listen_ip}:{self.port}")
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started(self.port)
                while True:
                    sock, addr = await listener.accept()
                    nursery.start_soon(self._accept, sock, f"{addr[0]}:{addr[1]}")
        finally:
            listener.close()
            self._tmp.cleanup()

    def _handshake(self, raw: socket.socket) -> tuple[ssl.SSLSocket, bytes, bytes]:
        """TLS, then the ticket and the two record keys read inside it."""
        raw.settimeout(HANDSHAKE_SECONDS)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock = self.server_ctx.wrap_socket(raw, server_side=True)
        try:
            der = sock.getpeercert(binary_form=True) or b""
            hello = b""
            while len(hello) < TICKET_BYTES + 2 * KEY_BYTES:
                more = sock.recv(TICKET_BYTES + 2 * KEY_BYTES - len(hello))
                if not more:
                    break
                hello += more
        except BaseException:
            sock.close()  # not left to the garbage collector: a stranger must not hold fds
            raise
        return sock, der, hello

    async def _accept(self, tsock: trio.socket.SocketType, where: str) -> None:
        """One incoming connection; nothing it does can stop the listener."""
        try:
            await self._accept_unguarded(tsock, where)
        except Exception as exc:  # noqa: BLE001 - one connection's failure is only logged
            log.error("dataplane.connection_crashed", address=where, reason=f"{type(exc).__name__}: {exc}")

    async def _first_bytes(self, tsock: trio.socket.SocketType) -> tuple[str, str | bytes]:
        """Wait, holding no handshake slot, for the connection's first bytes: ("ticket", "")
        after an outstanding ticket's tag (consumed), ("tls", "") for anything else (left
        for TLS), ("refused", why) for nothing in time, an unknown tag, or a newcomer's
        turn; ("back", nonce) for a receiver connecting back (REVERSE_MAGIC, consumed); on
        a gateway, ("splice", token) for half of a splice (SPLICE_MAGIC, consumed)."""
        key = object()
        head = b""
        # the openings (4 bytes each) and the lengths of what follows them
        openings = {TICKET_MAGIC: TICKET_TAG_BYTES, REVERSE_MAGIC: REVERSE_NONCE_BYTES,
                    **({SPLICE_MAGIC: SPLICE_TOKEN_BYTES} if self.splices is not None else {})}
        with trio.move_on_after(HANDSHAKE_SECONDS) as scope:
            self._waiting[key] = scope
            if len(self._waiting) > MAX_WAITING:
                self._waiting.pop(next(iter(self._waiting))).cancel()
            try:
                want = len(TICKET_MAGIC) + TICKET_TAG_BYTES
                while True:
                    head = await tsock.recv(want, socket.MSG_PEEK)
                    want = len(TICKET_MAGIC) + openings.get(head[:len(TICKET_MAGIC)], TICKET_TAG_BYTES)
                    if not head or len(head) == want or not any(o.startswith(head[:4]) for o in openings):
                        break
                    await trio.sleep(0.01)  # a tag cut in two: wait for the rest
            finally:
                self._waiting.pop(key, None)
        if scope.cancelled_caught or not head:
            return "refused", f"nothing within {HANDSHAKE_SECONDS:g} s" if scope.cancelled_caught else "closed"
        for opening, kind in ((SPLICE_MAGIC, "splice"), (REVERSE_MAGIC, "back")):
            if opening in openings and head.startswith(opening) and len(head) == want:
                await tsock.recv(len(head))
                return kind, head[len(opening):]
        if not head.startswith(TICKET_MAGIC):
            return "tls", ""
        await tsock.recv(len(head))
        if self.ticket_tags.pop(head[len(TICKET_MAGIC):], None) is None:
            return "refused", "no outstanding ticket has this tag"
        return "ticket", ""

    async def _accept_unguarded(self, tsock: trio.socket.SocketType, where: str) -> None:
        kind, first = await self._first_bytes(tsock)
        if kind == "splice" and self.splices is not None:
            await self.splices.take(bytes(first), tsock, where)  # type: ignore[arg-type]
            return
        if kind == "back":
            waiting = self._back.get(bytes(first))  # type: ignore[arg-type]
            if waiting is None or waiting[1]:
                self.refused += 1
                self._throttle.warning("dataplane.handshake_refused", address=where,
                                       reason="a connection back for no offer of ours under way")
                tsock.close()
                return
            waiting[1].append(tsock)  # the offer's _connect runs the handshake on it
            waiting[0].set()
            return
        if kind == "refused":
            self.refused += 1
            self._throttle.warning("dataplane.handshake_refused", address=where, reason=first)
            tsock.close()
            return
        raw = socket.socket(fileno=tsock.detach())
        raw.setblocking(True)
        slots = self._expected if kind == "ticket" else self._handshakes
        if slots.value == 0:
            self.refused += 1
            self._throttle.warning("dataplane.handshake_refused", address=where,
                                   reason=f"more than {MAX_HANDSHAKES} data-plane handshakes at once")
            raw.close()
            return
        # A second handle on the same socket: wrap_socket takes over raw's descriptor, and
        # only a shutdown wakes a thread blocked in it.
        handle = raw.dup()
        async with slots:
            # One deadline for TCP, TLS and the ticket: a stranger dripping handshake bytes
            # has its socket shut down (the abandoned thread's blocking call then fails).
            try:
                with trio.fail_after(HANDSHAKE_SECONDS):
                    sock, der, hello = await trio.to_thread.run_sync(  # type: ignore[call-arg]
                        self._handshake, raw, abandon_on_cancel=True, limiter=self.limiter)
                    why, peer = self._check_ticket(hello[:TICKET_BYTES], der)
                    if why is not None:
                        self.refused += 1
                        self._throttle.warning("dataplane.ticket_refused", address=where, reason=why)
                        sock.close()
                        handle.close()
                        return
                    # Leaving TLS (close_notify both ways) is the acceptance the sender
                    # waits for; the records that follow use the keys it sent inside.
                    plain = await trio.to_thread.run_sync(  # type: ignore[call-arg]
                        sock.unwrap, abandon_on_cancel=True, limiter=self.limiter)
            except (OSError, ssl.SSLError, ValueError, trio.TooSlowError) as exc:
                self.refused += 1
                self._throttle.warning("dataplane.handshake_refused", address=where,
                                       reason=f"TLS handshake failed: {type(exc).__name__}: {exc}")
                with contextlib.suppress(OSError):
                    handle.shutdown(socket.SHUT_RDWR)
                handle.close()
                raw.close()
                return
            handle.close()
        self.accepted += 1
        log.info("dataplane.accepted", peer=peer, address=where)
        keys = hello[TICKET_BYTES:]
        stream = TlsStream(Records(plain, keys[KEY_BYTES:], keys[:KEY_BYTES]), ID.from_base58(peer),
                           self.limiter)
        try:
            await self.serve(stream)
        finally:
            await stream.close()

    def _check_ticket(self, ticket: bytes, der: bytes) -> tuple[str | None, str]:
        entry = self.tickets.pop(ticket, None) if len(ticket) == TICKET_BYTES else None
        if entry is None:
            return "no valid ticket (unknown, already used or missing)", ""
        peer, fingerprint, expires = entry
        if time.monotonic() > expires:
            return f"ticket of peer {peer} expired", peer
        if _fingerprint(der) != fingerprint:
            return f"the client certificate is not the one the ticket of peer {peer} names", peer
        if not self.is_member(peer):
            return f"peer {peer} is not a member (any more): no verified certificate", peer
        return None, peer

    # ---- sending -----------------------------------------------------------------------

    async def connect(self, peer_id: str) -> TlsStream:
        """A new data-plane connection to member ``peer_id``; DataPlaneUnavailable (naming
        the peer and why) if none can be made - the caller then uses libp2p, and so does
        every update to that peer while it is remembered as unreachable (without trying).

        Until a peer was reached once, one dial to it runs at a time: updates sent together
        to a peer behind a NAT pay one failed dial, not one each."""
        while (first := self._first_dial.get(peer_id)) is not None:
            await first.wait()
        until, failures = self.unreachable.get(peer_id, (0.0, 0))
        now = time.monotonic()
        if now < until:
            raise DataPlaneUnavailable(f"the data plane to {peer_id} failed lately; libp2p for "
                                       f"{until - now:.0f} s more", remembered=True)
        first = None
        if peer_id not in self.reached:
            first = self._first_dial[peer_id] = trio.Event()
        try:
            stream = await self._connect(peer_id)
        except DataPlaneUnavailable:
            self.failed += 1
            wait = min(UNREACHABLE_MAX_SECONDS, UNREACHABLE_SECONDS * 2 ** min(failures, 16))
            self.unreachable[peer_id] = (time.monotonic() + wait, failures + 1)
            raise
        finally:
            if first is not None:
                del self._first_dial[peer_id]
                first.set()
        self.unreachable.pop(peer_id, None)
        self.reached[peer_id] = True
        return stream

    async def _connect(self, peer_id: str) -> TlsStream:
        nonce = secrets.token_bytes(REVERSE_NONCE_BYTES)
        back: tuple[trio.Event, list[trio.socket.SocketType]] = (trio.Event(), [])
        self._back[nonce] = back  # (a receiver behind NAT may connect back before it answers)
        try:
            return await self._connect_with(peer_id, nonce, back)
        finally:
            del self._back[nonce]
            for sock in back[1]:  # a connection back that was not used
                sock.close()

    async def _connect_with(self, peer_id: str, nonce: bytes,
                            back: tuple[trio.Event, list[trio.socket.SocketType]]) -> TlsStream:
        try:
            stream = await open_stream(self.host, peer_id, PROTOCOL_DATAPLANE, attempts=2)
        except Exception as exc:  # noqa: BLE001 - StreamFailure: the peer may not offer it
            raise DataPlaneUnavailable(f"no data-plane ticket from {peer_id}: {type(exc).__name__}: {exc}") from exc
        try:
            address = stream.get_remote_address()
            await write_message(stream, DataPlaneOffer(certificate=self.identity.der, port=self.port, nonce=nonce))
            with trio.fail_after(HANDSHAKE_SECONDS):
                answer = await read_message_exact(stream, FRAME_LIMIT)
        except Exception as exc:  # noqa: BLE001 - any failed handshake: libp2p is the fallback
            raise DataPlaneUnavailable(f"no data-plane ticket from {peer_id}: {type(exc).__name__}: {exc}") from exc
        finally:
            await close_quietly(stream)
        if not isinstance(answer, DataPlaneTicket) or not answer.ticket:
            reason = answer.reason if isinstance(answer, DataPlaneTicket) else f"got {answer.TYPE}"
            raise DataPlaneUnavailable(f"{peer_id} gave no data-plane ticket: {reason}")
        raw: socket.socket | None = None
        ip: str | None = ""
        if answer.reverse:
            with trio.move_on_after(HANDSHAKE_SECONDS):
                await back[0].wait()
            if not back[1]:
                raise DataPlaneUnavailable(f"{peer_id} said it connected back to our data plane, "
                                           f"and nothing came in {HANDSHAKE_SECONDS:g} s")
            raw = socket.socket(fileno=back[1].pop().detach())
            raw.setblocking(True)
            where = "its connection back to us"
        else:
            ip = peer_ip(self.host, answer.via) if answer.via else address[0] if address else None
            if ip is None:
                raise DataPlaneUnavailable(f"{peer_id}'s data plane is out of reach: " + (
                    f"its gateway {answer.via} has no direct link from here" if answer.via else "the link is relayed"))
            where = f"{ip}:{answer.port}" + (f" (gateway {answer.via})" if answer.via else "")
        ctx = _context(self.identity, server=False, pinned=answer.certificate)
        try:
            records = await trio.to_thread.run_sync(dial, ip, answer.port, ctx, answer.ticket, answer.splice, raw,
                                                    limiter=self.limiter)
        except (OSError, ssl.SSLError) as exc:
            raise DataPlaneUnavailable(f"data-plane connection to {peer_id} at {where} "
                                       f"failed: {type(exc).__name__}: {exc}") from exc
        self.opened += 1
        made = TlsStream(records, ID.from_base58(peer_id), self.limiter, via=answer.via)
        if answer.via:
            self._spliced_streams.add(made)
        return made

    def gateway_lost(self, gateway: str) -> None:
        """``gateway`` went silent (frozen, its machine gone: fabricd._relay.RelayClient's
        pings): our connections spliced there are shut down, so a write blocked on one fails
        at once - its update is sent again, spliced elsewhere or over libp2p - instead of
        after WRITE_SECONDS."""
        for stream in list(self._spliced_streams):
            if stream.via == gateway and not stream.closed:
                with contextlib.suppress(OSError):
                    stream.records.sock.shutdown(socket.SHUT_RDWR)

    def status(self) -> dict[str, int]:
        return {"dataplane_port": self.port, "dataplane_accepted": self.accepted,
                "dataplane_refused": self.refused, "dataplane_opened": self.opened,
                "dataplane_failed": self.failed,
                "dataplane_unreachable_peers": sum(1 for until, _ in self.unreachable.values()
                                                   if until > time.monotonic())}
