"""The pre-authentication deadline belongs to one arrival of a peer (fabricd._preauth).

A member whose link was lost with a relay and that came back over another gateway is
pending again while the certificates are exchanged on the new link. The clock started
when it first connected must not cut that exchange (issue 32: it did, 10 s after the
first join, and the resent round.run met "bad membership reply: StreamClosed"); the new
arrival's own clock still drops a peer that never proves membership.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from fabricd._bounded import Throttle
from fabricd._member_tables import PeerVerdict
from fabricd._preauth import PreAuth, log


class _Host:
    """Just what PreAuth reads: who is connected, and hang-ups."""

    def __init__(self) -> None:
        self.connections: dict[ID, list[object]] = {}
        self.hung_up: list[tuple[float, ID]] = []

    def get_network(self) -> _Host:
        return self

    async def disconnect(self, peer: ID) -> None:
        self.hung_up.append((trio.current_time(), peer))
        self.connections.pop(peer, None)


@pytest.mark.trio
async def test_a_member_back_on_a_new_link_is_not_cut_by_its_first_links_deadline(
        autojump_clock: Any) -> None:
    host = _Host()
    peer = ID.from_pubkey(create_new_key_pair().public_key)
    verdict = PeerVerdict()  # the new link's exchange: under way, never finished here
    auth = PreAuth(host, auth_timeout=10.0, throttle=Throttle(log),  # type: ignore[arg-type]
                   verdict_of=lambda p: verdict, on_stream_refused=lambda: None)
    async with trio.open_nursery() as nursery:
        auth.spawn = nursery
        host.connections[peer] = [object()]
        auth.arrived(str(peer))          # t=0: joins through gateway 1
        await trio.sleep(1)
        auth.settled(str(peer))          # t=1: proved membership
        await trio.sleep(7)
        host.connections.pop(peer)
        auth.settled(str(peer))          # t=8: gateway 1 killed, the link lost
        await trio.sleep(1)
        host.connections[peer] = [object()]
        auth.arrived(str(peer))          # t=9: back through gateway 2, exchange under way
        await trio.sleep(5)
        assert host.hung_up == []        # t=14: the first clock (t=10) cut nothing
        await trio.sleep(6)
        # t=20: the new arrival's own clock (t=19) drops it: it never proved membership
        assert [round(t) for t, p in host.hung_up if p == peer] == [19]
        assert auth.dropped == 1
        nursery.cancel_scope.cancel()
