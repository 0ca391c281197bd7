"""Membership enforcement on /fedpilot/member.

On every new connection the two daemons exchange certificates (MemberHello ->
MemberAck). A peer counts as a member only after it presented a certificate that the
federation CA signed for ITS OWN Noise-authenticated peer id, that is inside its
validity window and not revoked. Until then (and forever, for non-members) every other
protocol is refused by ``Membership.guard``; non-members are disconnected. Revocations
(the local list and the CA-signed one spread over gossip, see fabricd.revocation) are
checked every second, and members whose certificate was revoked or expired are dropped
without a restart.

A claim made with a certificate that does not verify (foreign CA, wrong peer) is kept in
a small table of its own and can never mark a real cluster "not a member".

Parts: the exchange itself is fabricd._member_exchange, the pre-authentication limits
(deadline, pending peers, waiting streams; see docs/security.md) fabricd._preauth, the
table entries fabricd._member_tables; this module owns the verdicts and the guard.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.peer.id import ID

from fabricd._bounded import BoundedDict, Throttle
from fabricd._member_exchange import CertificateExchange
from fabricd._member_tables import (
    MAX_REFUSALS,
    MAX_REFUSED_BY,
    MAX_UNVERIFIED_CLAIMS,
    PeerVerdict,
    Refusal,
    claimed_cluster,
    is_connected,
    peer_addrs,
    protect,
)
from fabricd._preauth import AUTH_TIMEOUT, PreAuth, TooManyWaiting
from fabricd._streams import Handler, close_quietly, remote_peer, reset_quietly, safe_handler
from fabricd.metrics import UNWIRED, DaemonMetrics
from fabricd.revocation import Revocations
from fedcore.logs import get_logger
from proto.certs import Certificate, RevocationList, parse_certificate, verify_certificate
from proto.errors import NotAMember
from proto.ids import PROTOCOL_MEMBER

log = get_logger("fabricd.membership")

VERDICT_TIMEOUT = 15.0


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
        self._throttle = Throttle(log)
        self.preauth = PreAuth(host, auth_timeout=auth_timeout, throttle=self._throttle,
                               verdict_of=self.verdicts.get,
                               on_stream_refused=lambda: self.metrics.stream_refused())
        self.hello = CertificateExchange(self, self._throttle)
        self.on_member: Callable[[str, Certificate], None] | None = None
        self.on_leave: Callable[[str], None] | None = None
        self._spawn: trio.Nursery | None = None
        self.metrics: DaemonMetrics = UNWIRED

    # ---- lifecycle ---------------------------------------------------------------------

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Register the member protocol, guard every other handler, watch revocations."""
        async with trio.open_nursery() as nursery:
            self._spawn = self.preauth.spawn = nursery
            self.host.set_stream_handler(PROTOCOL_MEMBER, safe_handler("member", self.hello.handle))  # type: ignore[arg-type]
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
        if self.member_certificate(peer_id) is None:
            self.preauth.arrived(peer_id)
        if self._spawn is not None:
            self._spawn.start_soon(self.hello.exchange, peer_id)

    def on_disconnected(self, peer_id: str) -> None:
        if is_connected(self.host, peer_id):
            return
        self.preauth.settled(peer_id)
        verdict = self.verdicts.pop(peer_id, None)
        if verdict is not None:
            verdict.decided.set()
            verdict.answered.set()
            if verdict.certificate is not None:
                protect(self.host, peer_id, False)
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

    @property
    def pending(self) -> BoundedDict[str, float]:
        """Connected peers that have not proved membership yet, oldest first."""
        return self.preauth.pending

    @property
    def preauth_dropped(self) -> int:
        return self.preauth.dropped

    async def wait_verdict(self, peer_id: str, timeout: float = VERDICT_TIMEOUT) -> Certificate:
        """The peer's certificate once verified; NotAMember with the reason otherwise."""
        verdict = self.verdicts.get(peer_id)
        if verdict is None:
            verdict = self.verdicts[peer_id] = PeerVerdict()
            if self._spawn is not None:
                self._spawn.start_soon(self.hello.exchange, peer_id)
        with trio.move_on_after(timeout):
            await verdict.decided.wait()
            # Their certificate may be verified before they answered ours: wait for that too.
            if verdict.certificate is not None and not verdict.answered.is_set():
                if not verdict.exchanging and self._spawn is not None:
                    self._spawn.start_soon(self.hello.exchange, peer_id)
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
                    await self.preauth.wait_bounded(
                        name, peer, stream, lambda: self.wait_verdict(peer, timeout=self.auth_timeout))
            except TooManyWaiting:
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

    # ---- verdicts ----------------------------------------------------------------------

    def verify(self, cert_bytes: bytes, peer_id: str) -> Certificate:
        """The certificate if the CA signed it for ``peer_id`` and it is valid now; else
        NotAMember saying why."""
        return verify_certificate(
            cert_bytes, self.ca_public, now=time.time(), revoked=self.revoked,
            expected_peer_id=peer_id,
        )

    def accept(self, peer_id: str, cert: Certificate) -> None:
        verdict = self.verdicts.setdefault(peer_id, PeerVerdict())
        first = verdict.certificate is None
        verdict.certificate, verdict.reason = cert, ""
        verdict.decided.set()
        self.preauth.settled(peer_id)
        if peer_id not in self.refused_by:
            self.refusals.pop(cert.cluster_id, None)
        if first:
            protect(self.host, peer_id, True)
            log.info("member.accepted", peer=peer_id, cluster=cert.cluster_id, role=cert.role,
                     serial=cert.serial)
            self.metrics.member_event("accepted")
            if self.on_member is not None:
                self.on_member(peer_id, cert)

    def reject(self, peer_id: str, reason: str, cert_bytes: bytes | None) -> None:
        verdict = self.verdicts.setdefault(peer_id, PeerVerdict())
        verdict.certificate, verdict.reason = None, reason
        verdict.decided.set()
        claimed = claimed_cluster(cert_bytes)
        authentic = bool(claimed) and self._ca_signed_for(cert_bytes, peer_id)
        if claimed:
            refusal = Refusal(claimed, peer_id, reason, peer_addrs(self.host, peer_id), verified=authentic)
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
            self.reject(peer_id, reason, None)
            self.refusals[cert.cluster_id] = Refusal(cert.cluster_id, peer_id, reason,
                                                     peer_addrs(self.host, peer_id))
            if self.on_leave is not None:
                self.on_leave(peer_id)
