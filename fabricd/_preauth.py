"""Pre-authentication limits: what a peer that has not proved membership can hold.

A peer that has not proved membership within ``auth_timeout`` seconds of connecting is
disconnected; at most ``MAX_PENDING_PEERS`` peers may be unauthenticated at once (the
oldest is dropped for a newcomer); streams waiting for a verdict are bounded per peer
and in total (see docs/security.md). fabricd.membership decides the verdicts; this
module only bounds the wait for them.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID

from fabricd._bounded import BoundedDict, Throttle, release_one
from fabricd._member_tables import PeerVerdict, is_connected
from fabricd._streams import reset_quietly
from fabricd.errors import FabricdError
from fedcore.logs import get_logger

# one logger for the whole membership service (fabricd.membership and its parts)
log = get_logger("fabricd.membership")

#: seconds a connected peer has to prove membership before it is disconnected
AUTH_TIMEOUT = 10.0
#: unauthenticated peers held at once; a newcomer beyond this drops the oldest
MAX_PENDING_PEERS = 128
#: guarded streams of unauthenticated peers waiting for a verdict (per peer, in total)
MAX_WAITING_STREAMS_PER_PEER = 4
MAX_WAITING_STREAMS = 128


class TooManyWaiting(FabricdError):
    """The stream was reset because too many streams already wait for a verdict."""


class PreAuth:
    """The unauthenticated peers of one daemon, their deadline and their waiting streams."""

    def __init__(self, host: IHost, *, auth_timeout: float, throttle: Throttle,
                 verdict_of: Callable[[str], PeerVerdict | None],
                 on_stream_refused: Callable[[], None]) -> None:
        self.host = host
        self.auth_timeout = auth_timeout
        self._throttle = throttle
        self._verdict_of = verdict_of
        self._on_stream_refused = on_stream_refused
        #: connected peers that have not proved membership yet, oldest first
        self.pending: BoundedDict[str, float] = BoundedDict(MAX_PENDING_PEERS + 1)
        self._waiting: dict[str, int] = {}
        self._waiting_total = 0
        self.dropped = 0
        #: where the deadlines and hang-ups run (the membership service's nursery)
        self.spawn: trio.Nursery | None = None

    def arrived(self, peer_id: str) -> None:
        """A peer without a verified certificate connected: start its clock."""
        if peer_id in self.pending:
            return
        since = self.pending[peer_id] = time.monotonic()
        if len(self.pending) > MAX_PENDING_PEERS:
            oldest, _ = next(iter(self.pending.items()))
            self.pending.pop(oldest, None)
            self.drop(oldest, f"more than {MAX_PENDING_PEERS} peers were "
                              "waiting to authenticate; the oldest is dropped")
        if self.spawn is not None:
            self.spawn.start_soon(self._deadline, peer_id, since)

    def settled(self, peer_id: str) -> None:
        """The peer proved membership, or left."""
        self.pending.pop(peer_id, None)

    async def _deadline(self, peer_id: str, since: float) -> None:
        await trio.sleep(self.auth_timeout)
        if self.pending.get(peer_id) != since:
            # settled since: a member, or gone - and if it came back (a link lost with a
            # relay, redialled), that arrival has its own clock; this one must not cut it
            return
        # Loops because a hang-up can fail under load: the peer is dropped until it is gone.
        while is_connected(self.host, peer_id):
            verdict = self._verdict_of(peer_id)
            if verdict is not None and verdict.certificate is not None:
                return
            self.pending.pop(peer_id, None)
            reason = (verdict.reason if verdict is not None and verdict.reason else
                      f"did not complete the membership exchange within {self.auth_timeout:g} s")
            self.drop(peer_id, reason)
            await trio.sleep(self.auth_timeout)

    def drop(self, peer_id: str, reason: str) -> None:
        """Disconnect a peer that did not (or could not) authenticate, saying why."""
        self.dropped += 1
        self._throttle.warning("member.preauth_dropped", peer=peer_id, reason=reason,
                               dropped_total=self.dropped)
        if self.spawn is not None:
            self.spawn.start_soon(self._hang_up, peer_id)

    async def _hang_up(self, peer_id: str) -> None:
        try:
            await self.host.disconnect(ID.from_base58(peer_id))
        except Exception as exc:  # noqa: BLE001 - best effort; the peer may be gone already
            log.debug("member.disconnect_failed", peer=peer_id, reason=str(exc))

    async def wait_bounded(self, name: str, peer: str, stream: INetStream,
                           wait: Callable[[], Awaitable[Any]]) -> None:
        """Run ``wait`` (for ``peer``'s verdict), unless too many streams already wait:
        then ``stream`` is reset and TooManyWaiting raised."""
        per_peer = self._waiting.get(peer, 0)
        if per_peer >= MAX_WAITING_STREAMS_PER_PEER or self._waiting_total >= MAX_WAITING_STREAMS:
            self._throttle.warning(
                "stream.refused", protocol=name, peer=peer,
                reason=f"too many streams waiting for membership ({per_peer} from this peer, "
                       f"{self._waiting_total} in total; limits {MAX_WAITING_STREAMS_PER_PEER} "
                       f"and {MAX_WAITING_STREAMS})")
            self._on_stream_refused()
            await reset_quietly(stream)
            raise TooManyWaiting
        self._waiting[peer] = per_peer + 1
        self._waiting_total += 1
        try:
            await wait()
        finally:
            self._waiting_total -= 1
            release_one(self._waiting, peer)
