"""fabricd._relay.dial_circuits_too: one dial per peer at a time. When a link is lost, the
lease, a resent request, discovery and the membership exchange all ask for it at once;
they share one circuit (and, if it fails, its error), where each used to make its own."""

from __future__ import annotations

from typing import Any

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from fabricd import _relay

RELAY = ID.from_pubkey(create_new_key_pair().public_key)
PEER = ID.from_pubkey(create_new_key_pair().public_key)
OWN = ID.from_pubkey(create_new_key_pair().public_key)
CIRCUIT = f"/ip4/127.0.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PEER}"


class _Host:
    """As much of a host as dial_circuits_too uses: the peer known by its circuit only."""

    def __init__(self) -> None:
        self.connections: dict[ID, list[str]] = {}

    def addrs(self, peer_id: ID) -> list[Any]:  # the peerstore's
        return [multiaddr.Multiaddr(CIRCUIT)]

    def get_network(self) -> Any:
        return self

    def get_peerstore(self) -> Any:
        return self

    def get_id(self) -> ID:
        return OWN

    def get_connections(self, peer_id: ID) -> list[str]:
        return self.connections.get(peer_id, [])

    async def dial_peer(self, peer_id: ID) -> list[str]:
        raise AssertionError("no direct address to dial")


@pytest.mark.trio
@pytest.mark.parametrize("fails", [False, True])
async def test_callers_at_once_share_one_dial_and_its_outcome(monkeypatch: pytest.MonkeyPatch,
                                                              fails: bool) -> None:
    host = _Host()
    circuits: list[str] = []

    async def dial(host_: Any, circuit: str, peer_id: ID, **_: Any) -> None:
        circuits.append(circuit)
        await trio.sleep(0.2)  # a circuit and its handshakes take a while
        if fails:
            raise ConnectionError(f"relay {circuit.partition('/p2p-circuit')[0]} unreachable: gone")
        host.connections[peer_id] = ["conn"]

    monkeypatch.setattr(_relay, "dial", dial)
    _relay.dial_circuits_too(host, timeout=10.0)  # type: ignore[arg-type]
    outcomes: list[str] = []

    async def ask() -> None:
        try:
            outcomes.append(str(await host.dial_peer(PEER)))
        except ConnectionError as exc:
            outcomes.append(str(exc))

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(ask)
    assert circuits == [CIRCUIT]
    assert len(outcomes) == 5 and len(set(outcomes)) == 1, outcomes
    assert ("unreachable: gone" in outcomes[0]) if fails else outcomes[0] == "['conn']"


@pytest.mark.trio
async def test_a_dial_given_up_by_its_caller_leaves_the_others_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    host = _Host()
    circuits: list[str] = []

    async def dial(host_: Any, circuit: str, peer_id: ID, **_: Any) -> None:
        circuits.append(circuit)
        await trio.sleep(0.2)
        host.connections[peer_id] = ["conn"]

    monkeypatch.setattr(_relay, "dial", dial)
    _relay.dial_circuits_too(host, timeout=10.0)  # type: ignore[arg-type]
    got: list[Any] = []

    async def impatient() -> None:
        with trio.move_on_after(0.05):
            await host.dial_peer(PEER)

    async def patient() -> None:
        await trio.sleep(0.01)
        got.append(await host.dial_peer(PEER))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(impatient)
        nursery.start_soon(patient)
    assert got == [["conn"]] and len(circuits) == 2
