"""TopologyManager: local delivery by reference, remote delivery through a transport."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence

import numpy as np
import pytest

from worker.context import InProcessContext
from worker.topology import (
    Message,
    RoutingError,
    TopologyManager,
    decode_message,
    encode_message,
    ring,
    star,
)


class LoopbackTransport:
    """Two managers' remote halves meeting in one dict (what fabricd does between clusters)."""

    def __init__(self) -> None:
        self.boxes: dict[tuple[Hashable, int], dict[Hashable, bytes]] = defaultdict(dict)
        self.sent: list[tuple[Hashable, Hashable, int, int]] = []

    def send(self, src: Hashable, dst: Hashable, weights_bytes: bytes, round: int) -> None:
        assert isinstance(weights_bytes, bytes)
        self.boxes[(dst, round)][src] = weights_bytes
        self.sent.append((src, dst, round, len(weights_bytes)))

    def receive(self, dst: Hashable, round: int, senders: Sequence[Hashable]
                ) -> list[tuple[Hashable, bytes]]:
        box = self.boxes[(dst, round)]
        return [(s, box[s]) for s in senders if s in box]


W = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, dtype=np.float32)}


def test_message_round_trip_keeps_samples() -> None:
    back = decode_message(encode_message(Message(W, 17)))
    assert back.num_samples == 17
    np.testing.assert_array_equal(back.weights["w"], W["w"])
    assert decode_message(encode_message(W)).num_samples == 0


def test_local_messages_are_references_shared_by_all_readers() -> None:
    with InProcessContext(2) as ctx:
        topo = TopologyManager(star(3), ctx)
        ref = ctx.put(W)
        topo.broadcast("server", [0, 1, 2], ref, 1, nbytes=36)
        got = [topo.receive(c, 1, ["server"]) for c in range(3)]
        assert all(g == [("server", ref)] for g in got)  # the same reference, no copies
        assert topo.take_traffic().bytes_intra == 3 * 36
        for c in (2, 0, 1):
            topo.send(c, "server", ctx.put(Message(W, c + 1)), 1, nbytes=36)
        inbox = topo.receive("server", 1, [0, 1, 2])
        assert [src for src, _ in inbox] == [0, 1, 2]  # sorted, whatever the send order
        assert topo.pending() == 6
        topo.end_round(1)
        assert topo.pending() == 0
        with pytest.raises(RoutingError, match="no message from local node"):
            topo.receive("server", 1, [0])


def test_remote_neighbours_go_through_the_transport() -> None:
    graph = ring(4)  # 0-1-2-3-0; cluster A has {0, 1}, cluster B has {2, 3}
    transport = LoopbackTransport()
    with InProcessContext(2) as ctx_a, InProcessContext(2) as ctx_b:
        a = TopologyManager(graph, ctx_a, [0, 1], transport)
        b = TopologyManager(graph, ctx_b, [2, 3], transport)
        for topo, ctx, nodes in ((a, ctx_a, (0, 1)), (b, ctx_b, (2, 3))):
            for n in nodes:
                ref = ctx.put(Message({"w": np.full(2, n, dtype=np.float32)}, 10 + n))
                topo.broadcast(n, topo.neighbours(n), ref, 5, nbytes=8)
        inbox = a.receive(0, 5, a.neighbours(0))  # neighbours 1 (local) and 3 (remote)
        assert [s for s, _ in inbox] == [1, 3]
        values = ctx_a.get([r for _, r in inbox])
        assert [float(v.weights["w"][0]) for v in values] == [1.0, 3.0]
        assert [v.num_samples for v in values] == [11, 13]
        t = a.take_traffic()
        assert (t.messages_intra, t.messages_inter) == (2, 2)  # 0<->1 local; 0->3, 1->2 remote
        assert t.bytes_inter == sum(n for s, _, _, n in transport.sent if s in (0, 1))
        with pytest.raises(RoutingError, match=r"did not receive from remote node\(s\) \[3\]"):
            a.receive(0, 6, [3])


def test_remote_nodes_need_a_transport() -> None:
    with InProcessContext(2) as ctx:
        with pytest.raises(RoutingError, match="no RemoteTransport was given"):
            TopologyManager(star(2), ctx, local_nodes=[0, 1])
        with pytest.raises(RoutingError, match="not in the star topology"):
            TopologyManager(star(2), ctx, local_nodes=[7], transport=LoopbackTransport())
        topo = TopologyManager(star(2), ctx, [0, 1], LoopbackTransport())
        with pytest.raises(RoutingError, match="'server' is not local"):
            topo.send("server", 0, ctx.put(W), 1, nbytes=0)
