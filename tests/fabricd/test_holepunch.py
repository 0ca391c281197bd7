"""DCUtR hole punching as fabricd wires it (fabricd/_holepunch.py), without a network:
its handler behind the guard, the addresses it takes from a peer and from its own
listeners, what it leaves in the peerstore, and the "upgraded" link it reports. Two NATs
punched through for real, and symmetric ones that cannot be: tests/e2e/test_wan.py."""

from __future__ import annotations

import types
from typing import Any

from libp2p.connection_types import ConnectionType
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStore
from multiaddr import Multiaddr

from fabricd import _holepunch
from fabricd._holepunch import HolePunch
from fabricd._relay import link_kind


def _peer() -> ID:
    return ID.from_pubkey(create_new_key_pair().public_key)


class _Conn:
    def __init__(self, relayed: bool) -> None:
        self.relayed = relayed

    def get_connection_type(self) -> ConnectionType:
        return ConnectionType.RELAYED if self.relayed else ConnectionType.DIRECT

    def get_transport_addresses(self) -> list[Multiaddr]:
        return [Multiaddr("/ip4/198.51.100.1/tcp/4001/p2p-circuit")] if self.relayed else \
            [Multiaddr("/ip4/198.51.100.2/tcp/4001")]


def _host(conns: dict[str, list[_Conn]] | None = None, transport: list[str] | None = None) -> Any:
    store = PeerStore()
    network = types.SimpleNamespace(
        get_connections=lambda pid: (conns or {}).get(str(pid), []), connections={})
    return types.SimpleNamespace(
        get_peerstore=lambda: store, get_network=lambda: network,
        get_transport_addrs=lambda: [Multiaddr(a) for a in transport or []],
        # a private daemon's get_addrs: its relayed addresses only (fabricd._relay)
        get_addrs=lambda: [Multiaddr("/ip4/198.51.100.9/tcp/4001/p2p-circuit")])


def test_the_handler_is_the_guarded_one() -> None:
    wrapped: list[str] = []

    def guard(name: str, handler: Any) -> Any:
        wrapped.append(name)
        return ("guarded", handler)
    punch = HolePunch(_host(), guard)
    assert wrapped == ["dcutr"] and punch._handle_dcutr_stream[0] == "guarded"  # type: ignore[index]


def test_a_peers_connect_gives_at_most_a_few_tcp_addresses() -> None:
    punch = HolePunch(_host(), lambda name, h: h)
    tcp = [Multiaddr(f"/ip4/203.0.113.{i}/tcp/4001").to_bytes() for i in range(1, 10)]
    udp = Multiaddr("/ip4/203.0.113.50/udp/4001/quic-v1").to_bytes()
    got = punch._decode_observed_addrs([udp, b"\xff garbage", *tcp])
    assert [str(a) for a in got] == [f"/ip4/203.0.113.{i}/tcp/4001" for i in range(1, _holepunch.MAX_ADDRS + 1)]


def test_it_predicts_and_dials_from_the_listen_sockets_not_the_announced_circuits() -> None:
    host = _host(transport=["/ip4/10.77.1.2/tcp/4001", "/ip4/10.77.1.2/udp/4001/quic-v1"])
    assert _holepunch._listen_addrs(host) == [(4, "10.77.1.2", 4001)]
    # the library reads its listen ports through the module function fabricd replaces
    from libp2p.relay.circuit_v2 import dcutr
    assert dcutr._local_tcp_listen_addrs(host) == [(4, "10.77.1.2", 4001)]


def test_predicted_addresses_leave_the_peerstore_after_a_punch() -> None:
    host = _host()
    punch = HolePunch(host, lambda name, h: h)
    peer = _peer()
    circuit = Multiaddr(f"/ip4/198.51.100.1/tcp/4001/p2p/{_peer()}/p2p-circuit")
    store = host.get_peerstore()
    store.add_addrs(peer, [circuit, Multiaddr("/ip4/203.0.113.7/tcp/4001")], 600)
    punch._forget_predicted(peer)
    assert store.addrs(peer) == [circuit]
    public = _peer()  # a peer without circuit addresses keeps what it has
    store.add_addrs(public, [Multiaddr("/ip4/203.0.113.8/tcp/4001")], 600)
    punch._forget_predicted(public)
    assert store.addrs(public) == [Multiaddr("/ip4/203.0.113.8/tcp/4001")]
    punch._forget_predicted(_peer())  # an unknown peer: nothing to forget, no error


def test_a_link_dcutr_made_direct_is_reported_upgraded() -> None:
    """By the connection a punch made: the relayed one closing (the library's grace)
    leaves it upgraded; another direct connection, from a plain dial, is direct."""
    a, b, c = str(_peer()), str(_peer()), str(_peer())
    punched, relayed = _Conn(False), _Conn(True)
    conns = {a: [_Conn(True)], b: [punched, relayed], c: [_Conn(False)]}
    host = _host(conns)
    assert [link_kind(host, p) for p in (a, b, c)] == ["relayed", "direct", "direct"]
    punch = HolePunch(host, lambda name, h: h)  # registers itself on the host, as the library does
    punch.made.add(punched)
    assert [link_kind(host, p) for p in (a, b, c)] == ["relayed", "upgraded", "direct"]
    punch.on_peer_disconnected(ID.from_base58(b))  # the relayed connection closes
    conns[b].remove(relayed)
    assert link_kind(host, b) == "upgraded"
    conns[b] = [_Conn(False)]  # the punched one lost, a plain dial made another
    assert link_kind(host, b) == "direct"


def test_without_an_outside_observation_it_offers_its_listen_addresses() -> None:
    """Two sites behind one NAT, or loopback: no gateway saw a public address, so the
    listen addresses themselves (never 0.0.0.0) - the library offered none, reading them
    from the circuits-only get_addrs."""
    import trio

    host = _host(transport=["/ip4/0.0.0.0/tcp/4001", "/ip4/10.1.2.3/tcp/4001",
                            "/ip4/10.1.2.3/udp/4001/quic-v1"])
    punch = HolePunch(host, lambda name, h: h)
    offered = trio.run(punch._get_observed_addrs)
    assert [str(Multiaddr(a)) for a in offered] == ["/ip4/10.1.2.3/tcp/4001"]


def test_a_peer_gets_one_session_at_a_time_and_three_until_its_link_is_made_again(
        monkeypatch: Any) -> None:
    """Each answered session makes this daemon dial the peer's addresses: a member opening
    sessions at once, or one after another, gets the library's attempt budget and no more."""
    import trio
    from libp2p.relay.circuit_v2 import dcutr

    release = trio.Event()
    answered: list[str] = []

    async def session(self: Any, stream: Any) -> None:
        answered.append(str(stream.muxed_conn.peer_id))
        await release.wait()
    monkeypatch.setattr(dcutr.DCUtRProtocol, "_handle_dcutr_stream", session)
    punch = HolePunch(_host(), lambda name, h: h)
    peer, other = _peer(), _peer()

    class Stream:
        def __init__(self, who: ID) -> None:
            self.muxed_conn = types.SimpleNamespace(peer_id=who)
            self.was_reset = False

        async def reset(self) -> None:
            self.was_reset = True

    async def run() -> list[bool]:
        streams = [Stream(peer), Stream(peer), Stream(other)]
        async with trio.open_nursery() as nursery:
            for s in streams:
                nursery.start_soon(punch._answer, s)
            await trio.sleep(0.1)
            release.set()
        for _ in range(3):  # one after another: the budget's rest, then no more
            s = Stream(peer)
            await punch._answer(s)
            streams.append(s)
        punch.on_peer_disconnected(peer)  # the link lost and made again: a fresh budget
        last = Stream(peer)
        await punch._answer(last)
        return [s.was_reset for s in [*streams, last]]

    resets = trio.run(run)
    assert sorted(resets[:2]) == [False, True]  # two at once: one answered (trio picks which)
    assert resets[2:] == [False, False, False, True, False]
    assert answered.count(str(peer)) == 4 and answered.count(str(other)) == 1
    assert punch.counts["holepunch_refused"] == 2
