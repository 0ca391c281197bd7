"""Data-plane splices: a gateway joins two members' TCP connections, so that a member
behind NAT receives large updates over the data plane too, not through a libp2p circuit.

Circuit relay v2 (fabricd/_relay.py) carries a private site's libp2p link, but the gateway
decrypts and re-encrypts every relayed byte (Noise), and each end runs Noise and yamux
twice (the hop, and the session inside the circuit): bench_transfer ``--relay`` measured
~0.27x direct on 2 cores. A large body does not need any of that. The data plane's TLS
handshake and AES-GCM records run end to end, so the gateway only has to pass bytes on:

1. The receiver (``reachability = "private"``), asked for a data-plane ticket, asks a
   gateway where it holds a relay reservation for a splice (``SpliceRequest`` on
   PROTOCOL_SPLICE, members only). The gateway answers with its data-plane port and two
   random one-time tokens, valid SPLICE_SECONDS.
2. The receiver dials that port, opens with SPLICE_MAGIC and its token, and from then on
   treats the connection as one its own listener accepted. It answers the sender with the
   ticket, the gateway's peer id and port, and the other token (inside their Noise session).
3. The sender dials the gateway (at the address of its own libp2p connection to it), opens
   with SPLICE_MAGIC and its token, then runs the data plane's handshake as on a direct
   dial: TLS pinned to the receiver's certificate, with the ticket inside it.
4. The gateway joins the two connections once both have come, and two threads copy bytes
   both ways (no crypto, no event loop per chunk).

The gateway sees only ciphertext: TLS 1.3, then records keyed inside it. It cannot read,
change or forge a body (records are authenticated end to end, the ticket and the pinned
certificates are the direct dial's). Like any relay it can drop or stall one; the ends'
rate floors cut that. The gateway keeps a floor of its own (_Frames): each frame begun
(the ticket's tag, a TLS record, a data-plane record) must come at the minimum rate after
its grace, as in a circuit, so a member dripping into a splice - or splicing its own two
connections, with no honest end to cut it - holds it that long at most; bytes that are no
data-plane frame end it. Limits: a member has at most PER_CIRCUIT x ``relay.max_circuits``
splices, pending or joined, and PENDING_PER_SENDER pending for one sender; a gateway
MAX_SPLICES; a token not used within SPLICE_SECONDS is void; a joined splice is cut after
SPLICE_IDLE_SECONDS with no byte either way, or at ``relay.circuit_seconds`` /
``relay.circuit_bytes``. A connection whose token is unknown is closed at once: strangers
get nothing. Counted in ``fabricd status`` (relay service: ``splices_*``, ``bytes_spliced``).
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from libp2p.abc import IHost, INetStream

from fabricd._bounded import Throttle
from fabricd._relay import Bandwidth, _relayed, connections
from fabricd._sender import open_stream
from fabricd._streams import close_quietly, read_message_exact, remote_peer, write_message
from fabricd.admission import RATE_GRACE, RateFloor
from fabricd.config import Relay
from fabricd.metrics import UNWIRED, DaemonMetrics
from fedcore.logs import get_logger
from proto.ids import PROTOCOL_SPLICE
from proto.messages import SpliceGrant, SpliceRequest

log = get_logger("fabricd.splice")

#: a connection to be joined opens with these bytes and its token (cleartext)
SPLICE_MAGIC = b"FPSP"
TOKEN_BYTES = 32
#: tokens are void this long after the grant (the data plane's tickets live as long)
SPLICE_SECONDS = 10.0
#: a joined splice with no byte either way this long is cut (pooled data-plane connections
#: idle at most 20 s before their sender closes them; an ack may take 2 stream timeouts)
SPLICE_IDLE_SECONDS = 300.0
#: a frame begun must arrive at the minimum rate after this grace (as in a circuit)
SPLICE_GRACE = RATE_GRACE
#: the largest frame: a data-plane record (1 MiB) and far more; beyond it is no data plane
MAX_FRAME = 16 * 1024 * 1024
GRANT_SECONDS = 5.0
DIAL_SECONDS = 2.0
#: splices pending or joined at once on one gateway (two copying threads each)
MAX_SPLICES = 256
#: a member's splices, pending or joined, at most this many times relay.max_circuits (a
#: receiver's senders each pool up to 8 data-plane connections to it)
PER_CIRCUIT = 4
#: a member's splices pending (not joined yet) for one sender: a sender that asks for
#: tickets and never connects holds no more of the receiver's splices than this
PENDING_PER_SENDER = 8
COPY_BYTES = 256 * 1024
#: how long one blocking socket call of a copying thread waits before it looks at limits
POLL_SECONDS = 0.5
FRAME_LIMIT = 64 * 1024


def peer_ip(host: IHost, peer_id: str) -> str | None:
    """The IP address of this host's direct libp2p connection to ``peer_id``, if any."""
    for conn in connections(host, peer_id):
        if _relayed(conn):
            continue
        try:
            address = conn.muxed_conn.secured_conn.get_remote_address()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - an odd connection object: try the next
            continue
        if address:
            return str(address[0])
    return None


async def request(host: IHost, gateway: str, peer: str) -> tuple[str, SpliceGrant]:
    """A splice at ``gateway`` for sender ``peer``: (the gateway's IP, its grant);
    ConnectionError saying why not."""
    ip = peer_ip(host, gateway)
    if ip is None:
        raise ConnectionError(f"no direct link to gateway {gateway}")
    with trio.move_on_after(GRANT_SECONDS) as scope:  # the sender waits for its ticket meanwhile
        try:
            stream = await open_stream(host, gateway, PROTOCOL_SPLICE, attempts=2)
        except Exception as exc:  # noqa: BLE001 - StreamFailure: the gateway may not offer it
            raise ConnectionError(f"gateway {gateway}: {type(exc).__name__}: {exc}") from exc
        try:
            await write_message(stream, SpliceRequest(peer=peer))
            grant = await read_message_exact(stream, FRAME_LIMIT)
        except Exception as exc:  # noqa: BLE001 - a broken stream: the caller says why
            raise ConnectionError(f"gateway {gateway}: {type(exc).__name__}: {exc}") from exc
        finally:
            await close_quietly(stream)
    if scope.cancelled_caught:
        raise ConnectionError(f"gateway {gateway} granted no splice within {GRANT_SECONDS:g} s")
    if not isinstance(grant, SpliceGrant) or not grant.port:
        raise ConnectionError(f"gateway {gateway} refused a splice: "
                              f"{grant.reason if isinstance(grant, SpliceGrant) else grant.TYPE}")
    return ip, grant


async def park(ip: str, port: int, opening: bytes) -> trio.socket.SocketType:
    """A receiver's own connection to a data-plane port, ``opening`` sent: its half of a
    splice (SPLICE_MAGIC and its token, to the gateway), or a connection back to the
    sender (fabricd._dataplane.REVERSE_MAGIC and the offer's nonce)."""
    sock = trio.socket.socket(trio.socket.AF_INET6 if ":" in ip else trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    try:
        with trio.fail_after(DIAL_SECONDS):
            await sock.connect((ip, port))
            sock.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, 1)
            head = memoryview(opening)
            while head:
                head = head[await sock.send(head):]
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass(eq=False)  # one object behind both tokens: compared and hashed by identity
class _Rendezvous:
    member: str
    peer: str
    expires: float
    #: the sender's token
    dial: bytes
    #: the connection that came first, waiting for the other
    parked: trio.socket.SocketType | None = None
    joined: trio.Event = field(default_factory=trio.Event)
    released: bool = False


class _Frames:
    """One direction of a joined splice, cut into the data plane's frames - from the
    sender first the ticket's tag (TICKET_MAGIC, 20 bytes), then TLS records (5-byte
    header: type 20-23, version, 2-byte length), then its AES-GCM records (4-byte length,
    the ciphertext, a 16-byte tag) - with a clock for the frame under way, as
    fabricd._relay._Frames has for a circuit: a frame begun must arrive at the minimum rate
    after its grace, so a member dripping into a splice holds it that long at most (between
    frames a direction may idle). Bytes that are no such frame end the splice."""

    def __init__(self, min_rate: float, sender: bool) -> None:
        self.min_rate = min_rate
        self.first = sender  # the sender's first frame is its ticket's tag
        self.head = b""
        self.need = 0
        #: bytes of the frame still to come after its header (-1: the header is not whole)
        self.left = -1
        self.floor: RateFloor | None = None
        self.got = 0

    def too_slow(self) -> str | None:
        return self.floor.too_slow(self.got) if self.floor else None

    def feed(self, data: memoryview) -> str | None:
        """Take bytes read; why to cut the splice (too slow, not the data plane), or None."""
        i = 0
        while i < len(data):
            if self.floor is None:
                self.floor, self.got, self.head, self.left = RateFloor(self.min_rate, SPLICE_GRACE), 0, b"", -1
                first = data[i]
                self.need = 20 if self.first and first == ord("F") else 5 if 20 <= first <= 23 else 4 if first == 0 else 0
                if not self.need:
                    return f"not data-plane traffic (a frame began with byte {first:#04x})"
            if self.left < 0:
                take = min(self.need - len(self.head), len(data) - i)
                self.head += bytes(data[i:i + take])
                if len(self.head) == self.need:
                    self.left = (0 if self.need == 20 else int.from_bytes(self.head[3:5], "big") if self.need == 5
                                 else int.from_bytes(self.head, "big") + 16)
                    if self.left > MAX_FRAME:
                        return f"not data-plane traffic (a frame of {self.left} bytes)"
            else:
                take = min(self.left, len(data) - i)
                self.left -= take
            i += take
            self.got += take
            if self.left == 0:
                self.floor, self.first = None, False
        return self.too_slow()


class _Copy:
    """What the two copying threads of one joined splice share."""

    def __init__(self, socks: list[socket.socket], limit_bytes: int, limit_seconds: int,
                 bandwidth: Bandwidth) -> None:
        self.socks = socks
        self.bandwidth = bandwidth
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.bytes = 0
        self.last = time.monotonic()
        self.limit_bytes = limit_bytes
        self.deadline = time.monotonic() + limit_seconds if limit_seconds else float("inf")
        self.why = ""
        self.running = 2

    def add(self, n: int) -> str:
        with self.lock:
            self.bytes += n
            self.last = time.monotonic()
            if self.limit_bytes and self.bytes > self.limit_bytes:
                return f"network.relay_circuit_bytes ({self.limit_bytes}) reached"
        return ""

    def check(self, frames: _Frames | None = None) -> str:
        """Why to cut the splice now (its limits, and the floor of ``frames``' frame under way), or ""."""
        now = time.monotonic()
        if now >= self.deadline:
            return "network.relay_circuit_seconds reached"
        if now - self.last >= SPLICE_IDLE_SECONDS:
            return f"no byte either way for {SPLICE_IDLE_SECONDS:g} s"
        return (frames.too_slow() if frames is not None else None) or ""

    def pump(self, src: socket.socket, dst: socket.socket, frames: _Frames, counted: Callable[[int], None]) -> None:
        """Copy src to dst until either ends or a limit is hit (then both stop); the last
        thread out closes both sockets (never one a thread may still use)."""
        buf = bytearray(COPY_BYTES)
        view = memoryview(buf)
        why = ""
        try:
            while not self.stop.is_set() and not why:
                try:
                    n = src.recv_into(buf)
                except TimeoutError:
                    why = self.check(frames)
                    continue
                if not n:
                    break
                counted(n)
                why = self.add(n) or frames.feed(view[:n]) or ""
                sent = 0
                began = time.monotonic()
                hold = self.bandwidth.delay(n)
                while hold > 0 and not self.stop.is_set():  # relay.max_bytes_per_second
                    time.sleep(min(hold, POLL_SECONDS))
                    hold -= POLL_SECONDS
                while sent < n and not self.stop.is_set() and not why:
                    try:
                        sent += dst.send(view[sent:n])
                    except TimeoutError:
                        why = self.check()  # (waiting on the other end: not this frame's pace)
                if frames.floor is not None:  # the other end's pace is not this end's
                    frames.floor.started += time.monotonic() - began
        except OSError as exc:
            why = f"{type(exc).__name__}: {exc}"
        finally:
            if why:
                self.why = self.why or why
                self.stop.set()
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)  # the other direction goes on: a half-close is passed on
            with self.lock:
                self.running -= 1
                last = self.running == 0
            if last:
                for sock in self.socks:
                    sock.close()



class SpliceService:
    """The gateway's side (module docstring): grants on PROTOCOL_SPLICE, and the
    connections that open with SPLICE_MAGIC, which the data plane's listener hands over."""

    def __init__(self, host: IHost, cfg: Relay, port: Callable[[], int],
                 has_reservation: Callable[[str], bool], min_rate: float = 256 * 1024,
                 bandwidth: Bandwidth | None = None) -> None:
        self.host = host
        self.cfg = cfg
        self.min_rate = min_rate
        #: relay.max_bytes_per_second (the gateway's, shared with its circuits)
        self.bandwidth = bandwidth or Bandwidth(cfg.max_bytes_per_second)
        self.port = port
        self.has_reservation = has_reservation
        self.metrics: DaemonMetrics = UNWIRED
        #: the copying threads (their own: splices never take the data plane's)
        self.limiter = trio.CapacityLimiter(2 * MAX_SPLICES)
        #: both tokens of each pending grant -> its rendezvous
        self.tokens: dict[bytes, _Rendezvous] = {}
        #: splices pending or joined, by member (entries removed at zero)
        self.by_member: dict[str, int] = {}
        self.counts = dict.fromkeys(("splices_granted", "splices_refused", "splices_joined",
                                     "splices_unknown_token", "bytes_spliced"), 0)
        self._count_lock = threading.Lock()
        self._throttle = Throttle(log)

    def register(self, guard: Callable[..., Any]) -> None:
        self.host.set_stream_handler(PROTOCOL_SPLICE, guard("dataplane.splice", self._grant,  # type: ignore[arg-type]
                                                            self._refuse))

    def status(self) -> dict[str, int]:
        self._expire()
        return {**self.counts, "splices_pending": len(set(self.tokens.values())),
                "splices_open": sum(self.by_member.values())}

    async def _refuse(self, stream: INetStream, reason: str) -> None:
        await write_message(stream, SpliceGrant(port=0, listen_token=b"", dial_token=b"", reason=reason))

    async def _grant(self, stream: INetStream) -> None:
        member = remote_peer(stream)
        try:
            with trio.fail_after(GRANT_SECONDS):
                req = await read_message_exact(stream, FRAME_LIMIT)
            await write_message(stream, self.grant(member, req))
        except trio.TooSlowError:
            log.info("splice.refused", peer=member, reason=f"no SpliceRequest within {GRANT_SECONDS:g} s")
        finally:
            await close_quietly(stream)

    def grant(self, member: str, req: object) -> SpliceGrant:
        """The answer to ``member``'s request: two fresh tokens, or why not."""
        why = self._why_not(member, req)
        if why or not isinstance(req, SpliceRequest):
            self.counts["splices_refused"] += 1
            log.warning("splice.refused", peer=member, reason=why)
            return SpliceGrant(port=0, listen_token=b"", dial_token=b"", reason=why)
        listen, dial = secrets.token_bytes(TOKEN_BYTES), secrets.token_bytes(TOKEN_BYTES)
        self.tokens[listen] = self.tokens[dial] = _Rendezvous(member, req.peer, time.monotonic() + SPLICE_SECONDS,
                                                              dial)
        self.by_member[member] = self.by_member.get(member, 0) + 1
        self.counts["splices_granted"] += 1
        return SpliceGrant(port=self.port(), listen_token=listen, dial_token=dial, reason="")

    def _why_not(self, member: str, req: object) -> str:
        self._expire()
        if not isinstance(req, SpliceRequest):
            return f"expected SpliceRequest, got {getattr(req, 'TYPE', type(req).__name__)}"
        if not self.port():
            return "unavailable: the data plane is not listening"
        if not self.has_reservation(member):
            return "no relay reservation here: a splice is for members behind NAT that reserved at this gateway"
        held, most = self.by_member.get(member, 0), PER_CIRCUIT * self.cfg.max_circuits
        if held >= most:
            return (f"busy: {held} splices of this member are pending or open, at most {most} "
                    f"({PER_CIRCUIT} x network.relay_max_circuits); retry later")
        pending = sum(1 for rv in set(self.tokens.values()) if rv.member == member and rv.peer == req.peer)
        if pending >= PENDING_PER_SENDER:
            return (f"busy: {pending} splices of this member for sender {req.peer} are pending, at most "
                    f"{PENDING_PER_SENDER}; retry later")
        if sum(self.by_member.values()) >= MAX_SPLICES:
            return f"busy: {MAX_SPLICES} splices pending or open on this gateway; retry later"
        return ""

    def _release(self, rv: _Rendezvous) -> None:
        if rv.released:
            return
        rv.released = True
        left = self.by_member.pop(rv.member, 1) - 1
        if left > 0:
            self.by_member[rv.member] = left

    def _expire(self) -> None:
        now = time.monotonic()
        for token, rv in list(self.tokens.items()):
            if rv.expires < now and rv.parked is None:
                del self.tokens[token]
                self._release(rv)

    def _drop(self, rv: _Rendezvous, release: bool = True) -> None:
        for token in [t for t, r in self.tokens.items() if r is rv]:
            del self.tokens[token]
        if release:
            self._release(rv)

    async def take(self, token: bytes, tsock: trio.socket.SocketType, where: str) -> None:
        """A connection that opened with SPLICE_MAGIC and ``token`` (consumed): parked
        until its other half comes, or joined with the half parked."""
        rv = self.tokens.pop(token, None)
        if rv is None or rv.expires < time.monotonic():
            self.counts["splices_unknown_token"] += 1
            self._throttle.warning("splice.refused", address=where,
                                   reason="no pending splice has this token (unknown, used or expired)")
            tsock.close()
            if rv is not None:
                self._drop(rv)
            return
        if rv.parked is None:
            rv.parked = tsock
            try:
                with trio.move_on_after(max(0.0, rv.expires - time.monotonic())):
                    await rv.joined.wait()
            finally:
                if not rv.joined.is_set():  # (or this daemon stops)
                    log.info("splice.expired", peer=rv.member, sender=rv.peer,
                             reason=f"the other half did not come within {SPLICE_SECONDS:g} s")
                    rv.parked = None
                    self._drop(rv)
                    tsock.close()
            return
        other, rv.parked = rv.parked, None
        rv.joined.set()
        self._drop(rv, release=False)  # held by the member until the splice ends
        sender, receiver = (tsock, other) if token == rv.dial else (other, tsock)
        try:
            await self._join(rv, sender, receiver)
        finally:
            self._release(rv)

    async def _join(self, rv: _Rendezvous, sender: trio.socket.SocketType, receiver: trio.socket.SocketType) -> None:
        socks = [socket.socket(fileno=s.detach()) for s in (sender, receiver)]
        for sock in socks:
            sock.settimeout(POLL_SECONDS)
        copy = _Copy(socks, self.cfg.circuit_bytes, self.cfg.circuit_seconds, self.bandwidth)
        self.counts["splices_joined"] += 1
        log.info("splice.joined", peer=rv.member, sender=rv.peer)

        def counted(n: int) -> None:
            with self._count_lock:
                self.counts["bytes_spliced"] += n

        try:
            async with trio.open_nursery() as nursery:
                for src, dst in ((socks[0], socks[1]), (socks[1], socks[0])):
                    frames = _Frames(self.min_rate, sender=src is socks[0])
                    nursery.start_soon(self._run, copy.pump, src, dst, frames, counted)
        finally:
            copy.stop.set()  # cancelled (the daemon stops): the threads end within POLL_SECONDS
        if copy.why.startswith(("too slow", "not data-plane")):
            log.warning("splice.cut", peer=rv.member, sender=rv.peer, bytes=copy.bytes, reason=copy.why)
            self.metrics.stream_cut("relay")
        else:
            log.info("splice.ended", peer=rv.member, sender=rv.peer, bytes=copy.bytes, reason=copy.why or "closed")

    async def _run(self, pump: Callable[..., None], *args: Any) -> None:
        await trio.to_thread.run_sync(pump, *args, abandon_on_cancel=True, limiter=self.limiter)  # type: ignore[call-arg]
