"""One libp2p connection per pair of members: members that learn of each other at the same
moment (from each other's heartbeats) must not dial each other at once and keep both
connections (py-libp2p 0.8.1 keeps both; each side then opens its streams on the one it
prefers, so one link runs as two yamux sessions)."""

from __future__ import annotations

import itertools
import time
import types

import pytest

from fabricd.discovery import _link_details
from tests.fabricd._harness import Node, bridge_status, init_node, wait_until

JOINERS = ("l1", "l2", "l3")


def _rows(node: Node) -> dict[str, dict]:  # type: ignore[type-arg]
    return {row["cluster_id"]: row for row in bridge_status(node)["clusters"]}


@pytest.mark.slow
def test_members_that_find_each_other_at_once_keep_one_connection(mesh) -> None:  # type: ignore[no-untyped-def]
    a_addr = mesh.nodes["a"].addr()
    # Started together, each learns of the others from their heartbeats (via a) at about
    # the same time: before the tie-break, each pair dialled each other at once.
    nodes = [init_node(mesh.root, name, mesh.ca, [a_addr]) for name in JOINERS]
    try:
        for node in nodes:
            mesh.nodes[node.name] = node
            node.start()
        for node in nodes:
            node.wait_ready()

        def all_connected() -> bool:
            for node in nodes:
                rows = _rows(node)
                if not all(rows.get(o.name, {}).get("connected") for o in nodes if o is not node):
                    return False
            return True

        wait_until(all_connected, timeout=120, interval=0.1)
        # Both sides of every pair, over several status rounds (a second connection, if
        # any, is made by the other side's dial loop within a second of the first).
        links: dict[tuple[str, str], set[int]] = {}
        for _ in range(10):
            for x, y in itertools.permutations(nodes, 2):
                links.setdefault((x.name, y.name), set()).add(_rows(x)[y.name]["links"])
            time.sleep(0.3)
        # the whole picture on failure (pytest shortens a dict): which side holds the
        # extra connection, of which kind, and when each member joined the other
        assert all(seen == {1} for seen in links.values()), "\n".join(
            [f"links seen {sorted(links.items())}"]
            + [f"{x.name} -> {y.name}: {_rows(x)[y.name]}" for x, y in itertools.permutations(nodes, 2)])
    finally:
        for node in nodes:
            node.stop()
            mesh.nodes.pop(node.name, None)


class _Conn:
    def __init__(self, initiator: bool, age: float, streams: int) -> None:
        self.muxed_conn = types.SimpleNamespace(is_initiator_value=initiator)
        self._created_at = time.time() - age
        self._streams = streams

    def get_streams(self) -> tuple[object, ...]:
        return (object(),) * self._streams


def test_a_second_connection_is_described_in_the_status_row() -> None:
    """What `fabricd status` shows when a pair holds two connections (the failure above
    prints it): which side dialled each, its age and its open streams."""
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    peer = str(ID.from_pubkey(create_new_key_pair().public_key))
    network = types.SimpleNamespace(get_connections=lambda pid: [_Conn(True, 30.0, 4), _Conn(False, 2.0, 0)]
                                    if str(pid) == peer else [])
    host = types.SimpleNamespace(get_network=lambda: network)
    details = _link_details(host, peer)
    assert [d["dialled"] for d in details] == ["by us", "by them"]
    assert [d["streams"] for d in details] == [4, 0]
    assert 29 < details[0]["age_s"] < 40 and 1 < details[1]["age_s"] < 10
