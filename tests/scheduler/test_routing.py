"""RoutingMatrix: lookups, peers, msgpack round trip and strict decoding."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from proto.errors import (
    InvalidMessage,
    MalformedFrame,
    MessageTooLarge,
    ProtocolError,
    UnknownMessageType,
    UnsupportedVersion,
)
from proto.routing import INTER_CLUSTER, INTRA_CLUSTER, Channel, RoutingMatrix


def small(peers: list[str] | None = None) -> RoutingMatrix:
    # clients c0..c3 + server; c0,c1 on a; c2,c3 and the server on b; star plus ring c0-c1-c2.
    return RoutingMatrix.from_edges(
        job_id="j", clusters=["a", "b"], node_cluster=np.array([0, 0, 1, 1, 1]),
        edges=np.array([[0, 4], [1, 4], [2, 4], [4, 3], [0, 1], [2, 1]]), num_clients=4,
        aggregators=["server"], communities=np.array([0, 0, 1, 1]), peers=peers)


def test_channel_lookup_by_index_and_name() -> None:
    m = small()
    assert m.channel(0, 1) == Channel(INTRA_CLUSTER, "a", "")
    assert m.channel("c0", "server") == Channel(INTER_CLUSTER, "b", "")
    assert m.channel("server", "c0") == Channel(INTER_CLUSTER, "a", "")
    assert m.channel(3, 4).kind == INTRA_CLUSTER
    assert list(m.neighbours("server")) == [0, 1, 2, 3]
    assert list(m.neighbours(1)) == [0, 2, 4]
    assert m.cluster_of("server") == "b" and m.cluster_of("c1") == "a"
    with pytest.raises(KeyError, match="not an edge"):
        m.channel(0, 3)
    with pytest.raises(KeyError, match="not in the routing matrix"):
        m.channel("c9", "c0")


def test_edge_counts_match_edges() -> None:
    m = small()
    kinds = [k for _, _, k in m.edges()]
    assert len(kinds) == 6
    assert m.edge_counts() == (kinds.count(INTRA_CLUSTER), kinds.count(INTER_CLUSTER)) == (3, 3)


def test_a_channel_names_the_neighbours_peer_if_known() -> None:
    m = small(peers=["", "12D3KooWb"])
    assert m.channel(0, 4) == Channel(INTER_CLUSTER, "b", "12D3KooWb")
    assert m.channel(4, 0) == Channel(INTER_CLUSTER, "a", "")


def test_bytes_round_trip_is_equal_and_plain_msgpack() -> None:
    m = small(peers=["pa", "pb"])
    data = m.to_bytes()
    back = RoutingMatrix.from_bytes(data)
    assert back == m
    assert back.channel(2, 1) == m.channel(2, 1)
    assert list(back.communities) == [0, 0, 1, 1]  # type: ignore[arg-type]
    obj = msgpack.unpackb(data)
    assert obj["type"] == "routing_matrix" and obj["v"] == 2


def star_matrix() -> RoutingMatrix:
    # c0..c3 with the server on b: the plan of a star round (schema v2)
    return RoutingMatrix.from_edges(
        job_id="j", clusters=["a", "b"], node_cluster=np.array([0, 0, 1, 1, 1]),
        edges=np.array([[0, 4], [1, 4], [2, 4], [3, 4]]), num_clients=4,
        aggregators=["server"], kind="star", parent=np.array([4, 4, 4, 4, -1]))


def test_v2_carries_kind_parents_and_exchange_period() -> None:
    m = star_matrix()
    back = RoutingMatrix.from_bytes(m.to_bytes())
    assert back == m and back.kind == "star" and back.exchange_period == 1
    assert back.parent_of("c2") == "server" and back.parent_of("server") is None
    assert m.to_dict(readable=True)["nodes"]["c0"]["parent"] == "server"


def _star_mutated(**changes: object) -> bytes:
    obj = star_matrix().to_dict()
    obj.update(changes)
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize(("changes", "needle"), [
    ({"kind": "tree"}, "unknown topology kind"),
    ({"exchange_period": 0}, "exchange_period"),
    ({"parent": np.array([4, 4, 4, -1, -1], "<i4").tobytes()}, "c3 has no parent"),
    ({"parent": np.array([4, 4, 4, 0, -1], "<i4").tobytes()}, "not a client"),
    ({"parent": np.array([4, 4, 4, 4, 4], "<i4").tobytes()}, "not linked"),
    ({"parent": np.array([4, 4, 4, 4], "<i4").tobytes()}, "one per node"),
    ({"kind": "ring"}, "no aggregators"),
])
def test_v2_plan_fields_are_validated(changes: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidMessage) as info:
        RoutingMatrix.from_bytes(_star_mutated(**changes))
    assert needle in str(info.value)


def test_parent_must_be_linked_and_acyclic() -> None:
    edges = np.array([[0, 2], [1, 3], [2, 3]])
    base = dict(job_id="j", clusters=["a"], node_cluster=np.zeros(4), edges=edges,
                num_clients=2, aggregators=["agg", "server"], kind="hierarchical")
    RoutingMatrix.from_edges(**base, parent=np.array([2, 3, 3, -1]))  # type: ignore[arg-type]
    with pytest.raises(InvalidMessage, match="not linked"):
        RoutingMatrix.from_edges(**base, parent=np.array([3, 3, 3, -1]))  # type: ignore[arg-type]
    with pytest.raises(InvalidMessage, match="cycle"):
        RoutingMatrix.from_edges(**base, parent=np.array([2, 3, 3, 2]))  # type: ignore[arg-type]


def test_readable_json_lists_neighbours_by_kind() -> None:
    readable = small().to_dict(readable=True)
    assert readable["edges"] == {"intra": 3, "inter": 3}
    assert readable["nodes"]["c0"] == {"cluster": "a", "intra": ["c1"], "inter": {"server": "b"}}


def _mutated(**changes: object) -> bytes:
    obj = small().to_dict()
    obj.update(changes)
    return msgpack.packb({k: v for k, v in obj.items() if v is not None}, use_bin_type=True)


def _u4(values: list[int]) -> bytes:
    return np.array(values, dtype="<u4").tobytes()


@pytest.mark.parametrize(("data", "error", "needle"), [
    (b"\xc1garbage", MalformedFrame, "msgpack"),
    (_mutated(type="job"), UnknownMessageType, "routing_matrix"),
    (_mutated(v=1), UnsupportedVersion, "version 1"),
    (_mutated(extra=1), InvalidMessage, "extra"),
    (_mutated(job_id=5), InvalidMessage, "job_id"),
    (_mutated(clusters=["a", "a"]), InvalidMessage, "distinct"),
    (_mutated(peers=["x"]), InvalidMessage, "peers"),
    (_mutated(node_cluster=np.array([0, 0, 1, 1, 7], "<u2").tobytes()), InvalidMessage,
     "node_cluster"),
    (_mutated(node_cluster=b"\x00"), InvalidMessage, "multiple of 2"),
    (_mutated(indices=_u4([4, 1, 0, 2, 4, 1, 4, 0, 1, 2, 3, 9])), InvalidMessage, "indices"),
    # c0 lists c1 but c1 does not list c0
    (_mutated(indices=_u4([1, 4, 2, 2, 4, 1, 4, 4, 0, 1, 2, 3])), InvalidMessage, "indices"),
    (_mutated(indptr=np.array([0, 2], "<u8").tobytes()), InvalidMessage, "indptr"),
    (_mutated(communities=np.array([0], "<i4").tobytes()), InvalidMessage, "communities"),
    (msgpack.packb([1, 2]), InvalidMessage, "map"),
])
def test_from_bytes_rejects_bad_input(data: bytes, error: type[ProtocolError], needle: str) -> None:
    with pytest.raises(error) as info:
        RoutingMatrix.from_bytes(data)
    assert needle in str(info.value)
    assert isinstance(info.value, ProtocolError)


def test_from_bytes_enforces_size_limit() -> None:
    data = small().to_bytes()
    with pytest.raises(MessageTooLarge):
        RoutingMatrix.from_bytes(data, max_size=len(data) - 1)


def test_self_loop_rejected() -> None:
    with pytest.raises(InvalidMessage, match="own neighbour"):
        RoutingMatrix(job_id="j", clusters=["a"], node_cluster=np.zeros(2), num_clients=2,
                      indptr=np.array([0, 1, 1]), indices=np.array([0]))
