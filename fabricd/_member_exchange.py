"""The certificate exchange on /fedpilot/member (MemberHello -> MemberAck), both sides.

Answering: a peer's hello is verified (the CA signed it for the peer's own
Noise-authenticated id, in its validity window, not revoked) and acked with our
certificate. Presenting: we send ours and verify theirs from the ack, retrying a stream
that failed to open while the peer stays connected. The verdicts land in
fabricd.membership's tables.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from fabricd._bounded import Throttle, release_one
from fabricd._member_tables import PeerVerdict, Refusal, is_connected, peer_addrs
from fabricd._streams import (
    close_quietly,
    read_message,
    remote_peer,
    reset_quietly,
    stream_reader,
    write_message,
)
from fedcore.logs import get_logger
from proto.errors import NotAMember, ProtocolError
from proto.ids import MAX_CERTIFICATE_BYTES, PROTOCOL_MEMBER
from proto.messages import MemberAck, MemberHello

if TYPE_CHECKING:
    from fabricd.membership import Membership

log = get_logger("fabricd.membership")

MEMBER_FRAME_LIMIT = MAX_CERTIFICATE_BYTES + 2048
EXCHANGE_TIMEOUT = 20.0
#: pauses before retrying our exchange after a stream failed to open (bounded: a stranger
#: that never answers costs at most this many attempts)
EXCHANGE_RETRY_PAUSES = (1.0, 2.0, 0.0)
#: concurrent /fedpilot/member streams served per peer
MAX_MEMBER_STREAMS_PER_PEER = 2


class CertificateExchange:
    """Serves peers' hellos and presents our certificate, for one ``Membership``."""

    def __init__(self, membership: Membership, throttle: Throttle) -> None:
        self.m = membership
        self._throttle = throttle
        self._member_streams: dict[str, int] = {}

    # ---- answering ---------------------------------------------------------------------

    async def handle(self, stream: INetStream) -> None:
        """The /fedpilot/member handler: at most a few streams per peer at once."""
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
            release_one(self._member_streams, peer)

    async def _handle_hello(self, stream: INetStream, peer: str) -> None:
        m = self.m
        reader = stream_reader(stream)
        try:
            with trio.fail_after(m.auth_timeout):
                hello = await read_message(reader, MEMBER_FRAME_LIMIT)
        except (ProtocolError, EOFError, trio.TooSlowError) as exc:
            log.warning("member.bad_frame", peer=peer, reason=f"{type(exc).__name__}: {exc}")
            await write_message(stream, MemberAck(accepted=False, reason=f"bad frame: {exc}",
                                                  certificate=m.certificate))
            await close_quietly(stream)
            return
        if not isinstance(hello, MemberHello):
            reason = f"expected MemberHello on {PROTOCOL_MEMBER}, got {hello.TYPE}"
            log.warning("member.bad_frame", peer=peer, reason=reason)
            await write_message(stream, MemberAck(accepted=False, reason=reason, certificate=m.certificate))
            await close_quietly(stream)
            return
        try:
            cert = m.verify(hello.certificate, peer)
        except NotAMember as exc:
            m.reject(peer, f"{type(exc).__name__}: {exc}", hello.certificate)
            await write_message(stream, MemberAck(
                accepted=False, reason=f"not a member: {exc}", certificate=m.certificate))
            await close_quietly(stream)
            return
        m.accept(peer, cert)
        await write_message(stream, MemberAck(accepted=True, reason="", certificate=m.certificate))
        await close_quietly(stream)

    # ---- presenting --------------------------------------------------------------------

    async def exchange(self, peer_id: str) -> None:
        """Present our certificate to ``peer_id`` and verify theirs from the reply."""
        m = self.m
        verdict = m.verdicts.setdefault(peer_id, PeerVerdict())
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
                current = m.verdicts.get(peer_id)
                if not is_connected(m.host, peer_id) or current is None or current.decided.is_set():
                    break
        finally:
            verdict.exchanging = False
            verdict.answered.set()

    async def _present(self, peer_id: str) -> bool:
        """One attempt; False only if it failed in a way worth retrying (no answer at all)."""
        m = self.m
        try:
            with trio.fail_after(EXCHANGE_TIMEOUT):
                stream = await m.host.new_stream(ID.from_base58(peer_id), [PROTOCOL_MEMBER])  # type: ignore[list-item]
                await write_message(stream, MemberHello(certificate=m.certificate))
                ack = await read_message(stream_reader(stream), MEMBER_FRAME_LIMIT)
                await close_quietly(stream)
        except trio.TooSlowError:
            # Slow is not the same as foreign: forget the attempt; the next connection retries.
            log.warning("member.exchange_timeout", peer=peer_id, seconds=EXCHANGE_TIMEOUT)
            verdict = m.verdicts.get(peer_id)
            if verdict is not None and not verdict.decided.is_set():
                verdict.reason = f"peer {peer_id} did not answer the membership exchange within {EXCHANGE_TIMEOUT:.0f} s"
                verdict.decided.set()
                m.verdicts.pop(peer_id, None)
            return True
        except (ProtocolError, EOFError) as exc:
            m.reject(peer_id, f"bad membership reply: {type(exc).__name__}: {exc}", None)
            return True
        except Exception as exc:  # noqa: BLE001 - libp2p raises many kinds on dial/negotiate
            # A peer that vanished mid-exchange is neither member nor rejected; forget it.
            log.info("member.exchange_failed", peer=peer_id, reason=f"{type(exc).__name__}: {exc}")
            return False
        if not isinstance(ack, MemberAck):
            m.reject(peer_id, f"expected MemberAck, got {ack.TYPE}", None)
            return True
        try:
            cert = m.verify(ack.certificate, peer_id)
        except NotAMember as exc:
            m.reject(peer_id, f"{type(exc).__name__}: {exc}", ack.certificate)
            return True
        # Recorded only for verified peers, so strangers cannot grow this table.
        if not ack.accepted:
            m.refused_by[peer_id] = ack.reason
            log.warning("member.refused_by_peer", peer=peer_id, reason=ack.reason)
            m.metrics.member_event("refused_by_peer")
        else:
            m.refused_by.pop(peer_id, None)
        if not ack.accepted:
            # They are a member to us, but they refuse us: we cannot talk to them either.
            m.refusals[cert.cluster_id] = Refusal(
                cert.cluster_id, peer_id, f"peer refused us: {ack.reason}", peer_addrs(m.host, peer_id))
            verdict = m.verdicts.setdefault(peer_id, PeerVerdict())
            verdict.reason = f"peer {peer_id} (cluster {cert.cluster_id}) refused us: {ack.reason}"
            verdict.decided.set()
            return True
        m.accept(peer_id, cert)
        return True
