"""Membership enforcement on /fedpilot/member.

On every new connection the two daemons exchange certificates (MemberHello ->
MemberAck). A peer counts as a member only after it presented a certificate that the
federation CA signed for ITS OWN Noise-authenticated peer id, that is inside its
validity window and not revoked. Until then (and forever, for non-members) every other
protocol is refused by ``Membership.guard``; non-members are disconnected. Revocations
(the local list and the CA-signed one spread over gossip, see fabricd.revocation) are
checked every second, and members whose certificate was revoked or expired are dropped
without a restart.

Pre-authentication limits (see docs/security.md): a peer that has not proved membership
within ``auth_timeout`` seconds of connecting is disconnected; at most
``MAX_PENDING_PEERS`` peers may be unauthenticated at once (the oldest is dropped for a
newcomer); streams waiting for a verdict are bounded per peer and in total. A claim
made with a certificate that does not verify (foreign CA, wrong peer) is kept in a small
table of its own and can never mark a real cluster "not a member".
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.peer.id import ID

from fabricd._bounded import BoundedDict, Throttle
from fabricd._streams import (
    Handler,
    close_quietly,
    read_message,
    remote_peer,
    reset_quietly,
    safe_handler,
    stream_reader,
    write_message,
)
from fabricd.logs import get_logger
from fabricd.metrics import UNWIRED, DaemonMetrics
from fabricd.revocation import Revocations
from proto.certs import Certificate, RevocationList, parse_certificate, verify_certificate
from proto.errors import NotAMember, ProtocolError
from proto.ids import MAX_CERTIFICATE_BYTES, PROTOCOL_MEMBER
from proto.messages import MemberAck, MemberHello

log = get_logger("fabricd.membership")

MEMBER_FRAME_LIMIT = MAX_CERTIFICATE_BYTES + 2048
VERDICT_TIMEOUT = 15.0
EXCHANGE_TIMEOUT = 20.0
#: pauses before retrying our exchange after a stream failed to open (bounded: a stranger
#: that never answers costs at most this many attempts)
EXCHANGE_RETRY_PAUSES = (1.0, 2.0, 0.0)
#: seconds a connected peer has to prove membership before it is disconnected
AUTH_TIMEOUT = 10.0
#: unauthenticated peers held at once; a newcomer beyond this drops the oldest
MAX_PENDING_PEERS = 128
#: guarded streams of unauthenticated peers waiting for a verdict (per peer, in total)
MAX_WAITING_STREAMS_PER_PEER = 4
MAX_WAITING_STREAMS = 128
#: concurrent /fedpilot/member streams served per peer
MAX_MEMBER_STREAMS_PER_PEER = 2
#: refusals of CA-signed (revoked, expired, refusing) certificates, by cluster id
MAX_REFUSALS = 1024
#: claims made with certificates that did not verify, by peer id (status display only)
MAX_UNVERIFIED_CLAIMS = 64
MAX_REFUSED_BY = 1024
RevocationCallback = Callable[[str, str], Awaitable[None]]


@dataclass
class PeerVerdict:
    """What we know about one connected peer's membership."""

    decided: trio.Event = field(default_factory=trio.Event)
    #: set once OUR certificate was presented and answered (or the attempt ended)
    answered: trio.Event = field(default_factory=trio.Event)
    exchanging: bool = False
    certificate: Certificate | None = None
    reason: str = ""
    since: float = field(default_factory=time.time)

    @property
    def member(self) -> bool:
        return self.decided.is_set() and self.certificate is not None


@dataclass
class Refusal:
    """A cluster id we saw claimed (or asked for) that is not a member, and why."""

    cluster_id: str
    peer_id: str
    reason: str
    addrs: tuple[str, ...] = ()
    at: float = field(default_factory=time.time)
    #: the CA signed this certificate for this peer (False: anyone could have made the claim)
    verified: bool = True


class _Notifee(INotifee):
    def __init__(self, membership: Membership) -> None:
        self._m = membership

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        self._m.on_connected(str(conn.muxed_conn.peer_id))

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self._m.on_disconnected(str(conn.muxed_conn.peer_id))

    async def listen(self, network: INetwork, multiaddr: object) -> None:
        return None

    async def listen_close(self, network: INetwork, multiaddr: object) -> None:
        return None


class Membership:
    """Certificate exchange, per-peer verdicts, the stream guard and revocation watching."""

    def __init__(
        self, host: IHost, *, certificate: bytes, ca_public: bytes, revocations: Revocations,
        auth_timeout: float = AUTH_TIMEOUT,
    ) -> None:
        self.host = host
        self.certificate = certificate
        self.own = parse_certificate(certificate)
        self.ca_public = ca_public
        self.revocations = revocations
        self.auth_timeout = auth_timeout
        self.verdicts: dict[str, PeerVerdict] = {}
        #: CA-signed non-members (revoked, expired) and clusters that refused us, by cluster id
        self.refusals: BoundedDict[str, Refusal] = BoundedDict(MAX_REFUSALS)
        #: claims whose certificate did not verify, by peer id: shown, never trusted
        self.unverified: BoundedDict[str, Refusal] = BoundedDict(MAX_UNVERIFIED_CLAIMS)
        self.refused_by: BoundedDict[str, str] = BoundedDict(MAX_REFUSED_BY)  # peer id -> their reason
        #: connected peers that have not proved membership yet, oldest first
        self.pending: BoundedDict[str, float] = BoundedDict(MAX_PENDING_PEERS + 1)
        self._waiting: dict[str, int] = {}
        self._waiting_total = 0
        self._member_streams: dict[str, int] = {}
        self.preauth_dropped = 0
        self._throttle = Throttle(log)
        self.on_member: Callable[[str, Certificate], None] | None = None
        self.on_leave: Callable[[str], None] | None = None
        self._spawn: trio.Nursery | None = None
        self.metrics: DaemonMetrics = UNWIRED

    # ---- lifecycle ---------------------------------------------------------------------

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Register the member protocol, guard every other handler, watch revocations."""
        async with trio.open_nursery() as nursery:
            self._spawn = nursery
            self.host.set_stream_handler(PROTOCOL_MEMBER, safe_handler("member", self._handle))  # type: ignore[arg-type]
            self.host.get_network().register_notifee(_Notifee(self))
            for peer in self.host.get_connected_peers():
                self.on_connected(str(peer))
            task_status.started()
            await self._watch_revocations()

    def guard_all_handlers(self) -> None:
        """Wrap every handler registered so far (DHT, gossipsub, identify, ...) in the guard."""
        mux = self.host.get_mux()
        for proto, handler in list(mux.handlers.items()):
            if proto is None or handler is None or proto == PROTOCOL_MEMBER:
                continue
            if getattr(handler, "_fabricd_guarded", False):
                continue
            mux.handlers[proto] = self.guard(str(proto), handler)

    # ---- connection events -------------------------------------------------------------

    def on_connected(self, peer_id: str) -> None:
        self.metrics.member_event("connected")
        if peer_id not in self.verdicts:
            self.verdicts[peer_id] = PeerVerdict()
        if self.member_certificate(peer_id) is None and peer_id not in self.pending:
            self.pending[peer_id] = time.monotonic()
            if len(self.pending) > MAX_PENDING_PEERS:
                oldest, _ = next(iter(self.pending.items()))
                self.pending.pop(oldest, None)
                self._drop_unauthenticated(oldest, f"more than {MAX_PENDING_PEERS} peers were "
                                                   "waiting to authenticate; the oldest is dropped")
            if self._spawn is not None:
                self._spawn.start_soon(self._auth_deadline, peer_id)
        if self._spawn is not None:
            self._spawn.start_soon(self._exchange, peer_id)

    async def _auth_deadline(self, peer_id: str) -> None:
        # Loops because a hang-up can fail under load: the peer is dropped until it is gone.
        await trio.sleep(self.auth_timeout)
        while self._connected(peer_id):
            verdict = self.verdicts.get(peer_id)
            if verdict is not None and verdict.certificate is not None:
                return
            self.pending.pop(peer_id, None)
            reason = (verdict.reason if verdict is not None and verdict.reason else
                      f"did not complete the membership exchange within {self.auth_timeout:g} s")
            self._drop_unauthenticated(peer_id, reason)
            await trio.sleep(self.auth_timeout)

    def _connected(self, peer_id: str) -> bool:
        return bool(self.host.get_network().connections.get(ID.from_base58(peer_id)))

    def _drop_unauthenticated(self, peer_id: str, reason: str) -> None:
        self.preauth_dropped += 1
        self._throttle.warning("member.preauth_dropped", peer=peer_id, reason=reason,
                               dropped_total=self.preauth_dropped)
        if self._spawn is not None:
            self._spawn.start_soon(self._hang_up, peer_id)

    async def _hang_up(self, peer_id: str) -> None:
        try:
            await self.host.disconnect(ID.from_base58(peer_id))
        except Exception as exc:  # noqa: BLE001 - best effort; the peer may be gone already
            log.debug("member.disconnect_failed", peer=peer_id, reason=str(exc))

    def on_disconnected(self, peer_id: str) -> None:
        if self.host.get_network().connections.get(ID.from_base58(peer_id)):
            return
        self.pending.pop(peer_id, None)
        verdict = self.verdicts.pop(peer_id, None)
        if verdict is not None:
            verdict.decided.set()
            verdict.answered.set()
            if verdict.certificate is not None:
                _protect(self.host, peer_id, False)
                log.info("member.disconnected", peer=peer_id, cluster=verdict.certificate.cluster_id)
                self.metrics.member_event("disconnected")
                if self.on_leave is not None:
                    self.on_leave(peer_id)

    # ---- queries -----------------------------------------------------------------------

    def member_certificate(self, peer_id: str) -> Certificate | None:
        """The verified certificate of a connected member that has not refused us, else None."""
        if peer_id in self.refused_by:
            return None
        verdict = self.verdicts.get(peer_id)
        return verdict.certificate if verdict is not None and verdict.member else None

    async def wait_verdict(self, peer_id: str, timeout: float = VERDICT_TIMEOUT) -> Certificate:
        """The peer's certificate once verified; NotAMember with the reason otherwise."""
        verdict = self.verdicts.get(peer_id)
        if verdict is None:
            verdict = self.verdicts[peer_id] = PeerVerdict()
            if self._spawn is not None:
                self._spawn.start_soon(self._exchange, peer_id)
        with trio.move_on_after(timeout):
            await verdict.decided.wait()
            # Their certificate may be verified before they answered ours: wait for that too.
            if verdict.certificate is not None and not verdict.answered.is_set():
                if not verdict.exchanging and self._spawn is not None:
                    self._spawn.start_soon(self._exchange, peer_id)
                await verdict.answered.wait()
        if peer_id in self.refused_by:
            raise NotAMember(f"peer {peer_id} refused us: {self.refused_by[peer_id]}")
        if verdict.certificate is not None:
            return verdict.certificate
        raise NotAMember(verdict.reason or f"peer {peer_id} disconnected or presented no valid "
                                           f"certificate within {timeout:.0f} s")

    # ---- the guard ---------------------------------------------------------------------

    def guard(
        self, name: str, handler: Handler,
        on_refuse: Callable[[INetStream, str], Awaitable[None]] | None = None,
    ) -> Handler:
        """A handler that serves only verified members; everyone else is refused and logged."""

        async def guarded(stream: INetStream) -> None:
            peer = remote_peer(stream)
            try:
                if self.member_certificate(peer) is None:
                    await self._wait_bounded(name, peer, stream)
            except _TooManyWaiting:
                return
            except NotAMember as exc:
                log.warning("stream.refused", protocol=name, peer=peer, reason=f"not a member: {exc}")
                self.metrics.stream_refused()
                if on_refuse is not None:
                    with trio.move_on_after(2):
                        await on_refuse(stream, f"not a member: {exc}")
                    await close_quietly(stream)
                else:
                    await reset_quietly(stream)
                return
            await handler(stream)

        wrapped = safe_handler(name, guarded)
        wrapped._fabricd_guarded = True  # type: ignore[attr-defined]
        return wrapped

    async def _wait_bounded(self, name: str, peer: str, stream: INetStream) -> None:
        """Wait for ``peer``'s verdict, unless too many streams already wait (then reset)."""
        per_peer = self._waiting.get(peer, 0)
        if per_peer >= MAX_WAITING_STREAMS_PER_PEER or self._waiting_total >= MAX_WAITING_STREAMS:
            self._throttle.warning(
                "stream.refused", protocol=name, peer=peer,
                reason=f"too many streams waiting for membership ({per_peer} from this peer, "
                       f"{self._waiting_total} in total; limits {MAX_WAITING_STREAMS_PER_PEER} "
                       f"and {MAX_WAITING_STREAMS})")
            self.metrics.stream_refused()
            await reset_quietly(stream)
            raise _TooManyWaiting
        self._waiting[peer] = per_peer + 1
        self._waiting_total += 1
        try:
            await self.wait_verdict(peer, timeout=self.auth_timeout)
        finally:
            self._waiting_total -= 1
            left = self._waiting.get(peer, 1) - 1
            if left > 0:
                self._waiting[peer] = left
            else:
                self._waiting.pop(peer, None)

    # ---- the exchange ------------------------------------------------------------------

    def _verify(self, cert_bytes: bytes, peer_id: str) -> Certificate:
        return verify_certificate(
            cert_bytes, self.ca_public, now=time.time(), revoked=self.revoked,
            expected_peer_id=peer_id,
        )

    def _accept(self, peer_id: str, cert: Certificate) -> None:
        verdict = self.verdicts.setdefault(peer_id, PeerVerdict())
        first = verdict.certificate is None
        verdict.certificate, verdict.reason = cert, ""
        verdict.decided.set()
        self.pending.pop(peer_id, None)
        if peer_id not in self.refused_by:
            self.refusals.pop(cert.cluster_id, None)
        if first:
            _protect(self.host, peer_id, True)
            log.info("member.accepted", peer=peer_id, cluster=cert.cluster_id, role=cert.role,
                     serial=cert.serial)
            self.metrics.member_event("accepted")
            if self.on_member is not None:
                self.on_member(peer_id, cert)

    def _reject(self, peer_id: str, reason: str, cert_bytes: bytes | None) -> None:
        verdict = self.verdicts.setdefault(peer_id, PeerVerdict())
        verdict.certificate, verdict.reason = None, reason
        verdict.decided.set()
        claimed = _claimed_cluster(cert_bytes)
        authentic = bool(claimed) and self._ca_signed_for(cert_bytes, peer_id)
        if claimed:
            refusal = Refusal(claimed, peer_id, reason, _peer_addrs(self.host, peer_id), verified=authentic)
            # Only a certificate the CA signed for this very peer may say "cluster X is not
            # a member"; anyone can write any cluster id into a forged one.
            if authentic:
                self.refusals[claimed] = refusal
            else:
                self.unverified[peer_id] = refusal
        log.warning("member.rejected", peer=peer_id, claimed_cluster=claimed or "?", reason=reason,
                    verified_claim=authentic)
        self.metrics.member_event("rejected", reason)
        if self._spawn is not None:
            self._spawn.start_soon(self._disconnect_later, peer_id)

    def _ca_signed_for(self, cert_bytes: bytes | None, peer_id: str) -> bool:
        """Whether the CA signed ``cert_bytes`` for ``peer_id`` (expired or revoked or not)."""
        if not cert_bytes:
            return False
        try:
            cert = parse_certificate(cert_bytes)
            verify_certificate(cert_bytes, self.ca_public, now=cert.not_before, revoked=(),
                               expected_peer_id=peer_id)
        except NotAMember:
            return False
        return True

    async def _disconnect_later(self, peer_id: str) -> None:
        # Give the MemberAck with the reason time to reach the peer before we hang up.
        await trio.sleep(0.5)
        verdict = self.verdicts.get(peer_id)
        if verdict is not None and verdict.certificate is None:
            try:
                await self.host.disconnect(ID.from_base58(peer_id))
            except Exception as exc:  # noqa: BLE001 - best effort
                log.debug("member.disconnect_failed", peer=peer_id, reason=str(exc))

    async def _handle(self, stream: INetStream) -> None:
        peer = remote_peer(stream)
        open_streams = self._member_streams.get(peer, 0)
        if open_streams >= MAX_MEMBER_STREAMS_PER_PEER:
            self._throttle.warning("member.bad_frame", peer=peer,
                                   reason=f"more than {MAX_MEMBER_STREAMS_PER_PEER} membership streams at once")
            await reset_quietly(stream)
            return
        self._member_streams[peer] = open_streams + 1
        try:
            await self._handle_hello(stream, peer)
        finally:
            left = self._member_streams.get(peer, 1) - 1
            if left > 0:
                self._member_streams[peer] = left
            else:
                self._member_streams.pop(peer, None)

    async def _handle_hello(self, stream: INetStream, peer: str) -> None:
        reader = stream_reader(stream)
        try:
            with trio.fail_after(self.auth_timeout):
                hello = await read_message(reader, MEMBER_FRAME_LIMIT)
        except (ProtocolError, EOFError, trio.TooSlowError) as exc:
            log.warning("member.bad_frame", peer=peer, reason=f"{type(exc).__name__}: {exc}")
            await write_message(stream, MemberAck(accepted=False, reason=f"bad frame: {exc}",
                                                  certificate=self.certificate))
            await close_quietly(stream)
            return
        if not isinstance(hello, MemberHello):
            reason = f"expected MemberHello on {PROTOCOL_MEMBER}, got {hello.TYPE}"
            log.warning("member.bad_frame", peer=peer, reason=reason)
            await write_message(stream, MemberAck(accepted=False, reason=reason, certificate=self.certificate))
            await close_quietly(stream)
            return
        try:
            cert = self._verify(hello.certificate, peer)
        except NotAMember as exc:
            self._reject(peer, f"{type(exc).__name__}: {exc}", hello.certificate)
            await write_message(stream, MemberAck(
                accepted=False, reason=f"not a member: {exc}", certificate=self.certificate))
            await close_quietly(stream)
            return
        self._accept(peer, cert)
        await write_message(stream, MemberAck(accepted=True, reason="", certificate=self.certificate))
        await close_quietly(stream)

    async def _exchange(self, peer_id: str) -> None:
        """Present our certificate to ``peer_id`` and verify theirs from the reply."""
        verdict = self.verdicts.setdefault(peer_id, PeerVerdict())
        if verdict.answered.is_set() or verdict.exchanging:
            return
        verdict.exchanging = True
        try:
            # Opening a stream can fail on a loaded daemon: retry while the peer is still
            # connected and has not proved membership either way, so a member is not
            # mistaken for a staller by the auth deadline.
            for pause in EXCHANGE_RETRY_PAUSES:
                if await self._present(peer_id):
                    break
                await trio.sleep(pause)
                current = self.verdicts.get(peer_id)
                if not self._connected(peer_id) or current is None or current.decided.is_set():
                    break
        finally:
            verdict.exchanging = False
            verdict.answered.set()

    async def _present(self, peer_id: str) -> bool:
        """One attempt; False only if it failed in a way worth retrying (no answer at all)."""
        try:
            with trio.fail_after(EXCHANGE_TIMEOUT):
                stream = await self.host.new_stream(ID.from_base58(peer_id), [PROTOCOL_MEMBER])  # type: ignore[list-item]
                await write_message(stream, MemberHello(certificate=self.certificate))
                ack = await read_message(stream_reader(stream), MEMBER_FRAME_LIMIT)
                await close_quietly(stream)
        except trio.TooSlowError:
            # Slow is not the same as foreign: forget the attempt; the next connection retries.
            log.warning("member.exchange_timeout", peer=peer_id, seconds=EXCHANGE_TIMEOUT)
            verdict = self.verdicts.get(peer_id)
            if verdict is not None and not verdict.decided.is_set():
                verdict.reason = f"peer {peer_id} did not answer the membership exchange within {EXCHANGE_TIMEOUT:.0f} s"
                verdict.decided.set()
                self.verdicts.pop(peer_id, None)
            return True
        except (ProtocolError, EOFError) as exc:
            self._reject(peer_id, f"bad membership reply: {type(exc).__name__}: {exc}", None)
            return True
        except Exception as exc:  # noqa: BLE001 - libp2p raises many kinds on dial/negotiate
            # A peer that vanished mid-exchange is neither member nor rejected; forget it.
            log.info("member.exchange_failed", peer=peer_id, reason=f"{type(exc).__name__}: {exc}")
            return False
        if not isinstance(ack, MemberAck):
            self._reject(peer_id, f"expected MemberAck, got {ack.TYPE}", None)
            return True
        try:
            cert = self._verify(ack.certificate, peer_id)
        except NotAMember as exc:
            self._reject(peer_id, f"{type(exc).__name__}: {exc}", ack.certificate)
            return True
        # Recorded only for verified peers, so strangers cannot grow this table.
        if not ack.accepted:
            self.refused_by[peer_id] = ack.reason
            log.warning("member.refused_by_peer", peer=peer_id, reason=ack.reason)
            self.metrics.member_event("refused_by_peer")
        else:
            self.refused_by.pop(peer_id, None)
        if not ack.accepted:
            # They are a member to us, but they refuse us: we cannot talk to them either.
            self.refusals[cert.cluster_id] = Refusal(
                cert.cluster_id, peer_id, f"peer refused us: {ack.reason}", _peer_addrs(self.host, peer_id))
            verdict = self.verdicts.setdefault(peer_id, PeerVerdict())
            verdict.reason = f"peer {peer_id} (cluster {cert.cluster_id}) refused us: {ack.reason}"
            verdict.decided.set()
            return True
        self._accept(peer_id, cert)
        return True


    # ---- revocation --------------------------------------------------------------------

    async def _watch_revocations(self) -> None:
        while True:
            await trio.sleep(1.0)
            self.recheck()
            # libp2p may register handlers later (e.g. a DHT mode switch): guard those too.
            self.guard_all_handlers()

    @property
    def revoked(self) -> RevocationList:
        """Every serial revoked as of now (re-read if the lists changed)."""
        return self.revocations.current()

    def recheck(self) -> None:
        """Drop members whose certificate is now revoked or expired."""
        revoked = self.revoked
        now = time.time()
        for peer_id, verdict in list(self.verdicts.items()):
            cert = verdict.certificate
            if cert is None:
                continue
            if cert.serial in revoked:
                reason = f"certificate serial {cert.serial} for peer {peer_id} has been revoked"
            elif not cert.not_before <= now <= cert.not_after:
                reason = f"certificate serial {cert.serial} for peer {peer_id} expired"
            else:
                continue
            self._reject(peer_id, reason, None)
            self.refusals[cert.cluster_id] = Refusal(cert.cluster_id, peer_id, reason,
                                                     _peer_addrs(self.host, peer_id))
            if self.on_leave is not None:
                self.on_leave(peer_id)


class _TooManyWaiting(Exception):
    """The stream was reset because too many streams already wait for a verdict."""


def _protect(host: IHost, peer_id: str, on: bool) -> None:
    """Keep a verified member's connection out of libp2p's connection pruning."""
    network: Any = host.get_network()
    method = getattr(network, "protect" if on else "unprotect", None)
    if method is not None:
        method(ID.from_base58(peer_id), "fedpilot-member")


def _claimed_cluster(cert_bytes: bytes | None) -> str:
    if not cert_bytes:
        return ""
    try:
        return parse_certificate(cert_bytes).cluster_id
    except ProtocolError:
        return ""


def _peer_addrs(host: IHost, peer_id: str) -> tuple[str, ...]:
    try:
        return tuple(str(a) for a in host.get_peerstore().addrs(ID.from_base58(peer_id)))
    except Exception:  # noqa: BLE001 - unknown peer
        return ()
