"""Every topology builder against a hand-computed graph, and the custom CSV errors."""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import numpy as np
import pytest

from proto.job import TopologySpec
from worker.topology import (
    AdjacencyError,
    TopologyError,
    aggregators_by_level,
    build_topology,
    children,
    clients_of,
    full,
    hierarchical,
    hybrid,
    k_connected_random,
    k_connected_similar,
    load_adjacency,
    ring,
    star,
)


def edges(graph: nx.Graph) -> set[frozenset[object]]:
    return {frozenset(e) for e in graph.edges()}


def test_star() -> None:
    g = star(4)
    assert edges(g) == {frozenset({i, "server"}) for i in range(4)}
    assert clients_of(g) == [0, 1, 2, 3]
    assert aggregators_by_level(g) == [["server"]]
    assert children(g, "server") == [0, 1, 2, 3]


def test_hierarchical_levels_by_hand() -> None:
    # 7 clients, branching 3, 3 levels:
    # level 1: agg1_0={0,1,2} agg1_1={3,4,5} agg1_2={6}
    # level 2: agg2_0={agg1_0,agg1_1,agg1_2}; level 3: server={agg2_0}
    g = hierarchical(7, levels=3, branching=3)
    assert aggregators_by_level(g) == [["agg1_0", "agg1_1", "agg1_2"], ["agg2_0"], ["server"]]
    assert children(g, "agg1_0") == [0, 1, 2]
    assert children(g, "agg1_1") == [3, 4, 5]
    assert children(g, "agg1_2") == [6]
    assert children(g, "agg2_0") == ["agg1_0", "agg1_1", "agg1_2"]
    assert children(g, "server") == ["agg2_0"]
    assert nx.is_tree(g)
    # two levels, 30 clients, branching 5: six edge aggregators under the server
    g2 = build_topology(TopologySpec(kind="hierarchical"), 30)
    assert [len(level) for level in aggregators_by_level(g2)] == [6, 1]
    assert children(g2, "agg1_5") == [25, 26, 27, 28, 29]
    # one level is a star
    assert edges(hierarchical(3, levels=1, branching=2)) == edges(star(3))
    with pytest.raises(TopologyError, match="hierarchy_branching must be >= 2"):
        hierarchical(3, levels=2, branching=1)


def test_ring_neighbours() -> None:
    g = ring(5)
    assert {i: sorted(g.neighbors(i)) for i in range(5)} == {
        0: [1, 4], 1: [0, 2], 2: [1, 3], 3: [2, 4], 4: [0, 3]}
    assert edges(ring(2)) == {frozenset({0, 1})}
    assert edges(ring(1)) == set()


def test_full() -> None:
    g = full(4)
    assert g.number_of_edges() == 6
    assert all(d == 3 for _, d in g.degree())


def test_k_connected_random_is_regular_and_seeded() -> None:
    g = k_connected_random(10, 3, seed=1)
    assert sorted(dict(g.degree()).values()) == [3] * 10
    assert edges(g) == edges(k_connected_random(10, 3, seed=1))
    with pytest.raises(TopologyError, match="must be even"):
        k_connected_random(5, 3, seed=0)
    with pytest.raises(TopologyError, match="client_k_neighbors must be in 1..4"):
        k_connected_random(5, 5, seed=0)


def test_k_connected_similarity_by_hand() -> None:
    # clients 0,1 hold class 0; 2,3 class 1; 4 is half/half (cosine 0.707 to all)
    hist = np.array([[10, 0], [5, 0], [0, 3], [0, 7], [4, 4]])
    g = k_connected_similar(hist, 1)
    # nearest: 0->1, 1->0, 2->3, 3->2, 4->0 (tie with 1,2,3: lowest id)
    assert edges(g) == {frozenset({0, 1}), frozenset({2, 3}), frozenset({4, 0})}
    g2 = k_connected_similar(hist, 2)
    # 0 -> {1, 4}, 1 -> {0, 4}, 2 -> {3, 4}, 3 -> {2, 4}, 4 -> {0, 1}
    assert edges(g2) == {frozenset(e) for e in [(0, 1), (0, 4), (1, 4), (2, 3), (2, 4), (3, 4)]}
    assert min(d for _, d in g2.degree()) >= 2
    spec = TopologySpec(kind="k_connected", client_k_neighbors=2)
    assert edges(build_topology(spec, 5, histograms=hist)) == edges(g2)


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "adj.csv"
    path.write_text(text)
    return str(path)


def test_custom_csv_graph_and_weights(tmp_path: Path) -> None:
    path = write(tmp_path, "a,b,c\n0,1,0\n1,0,2.5\n0,2.5,1\n")
    g = build_topology(TopologySpec(kind="custom", adjacency_file=path), 3)
    assert edges(g) == {frozenset({0, 1}), frozenset({1, 2})}
    assert g.edges[1, 2]["weight"] == 2.5
    assert not g.has_edge(2, 2)  # diagonal ignored


@pytest.mark.parametrize(
    ("text", "n", "message"),
    [
        ("0,1\n1,0,1\n", 2, "row 2 has 3 columns but the file has 2 rows"),
        ("0,1\n0,0\n", 2, "not symmetric: row 1, column 2 is 1 but row 2, column 1 is 0"),
        ("0,x\n1,0\n", 2, "row 1, column 2 is 'x', not a number"),
        ("0,-1\n-1,0\n", 2, "row 1, column 2 is '-1'; entries must be finite and >= 0"),
        ("0,1\n1,0\n", 3, "is 2x2 but the job has 3 clients"),
        ("\n", 2, "has no data rows"),
    ],
)
def test_custom_csv_errors_name_file_row_col(tmp_path: Path, text: str, n: int,
                                             message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(AdjacencyError) as err:
        build_topology(TopologySpec(kind="custom", adjacency_file=path), n)
    assert path in str(err.value) and message in str(err.value)


def test_custom_missing_file_and_directed_matrix(tmp_path: Path) -> None:
    with pytest.raises(AdjacencyError, match="cannot read adjacency file"):
        load_adjacency(tmp_path / "nope.csv")
    path = write(tmp_path, "0,1\n0,0\n")
    assert load_adjacency(path, symmetric=False).tolist() == [[0, 1], [0, 0]]


def test_hybrid_groups() -> None:
    g = hybrid([[0, 1], [2, 3, 4]], inter_cluster_period=3)
    assert g.graph["inter_cluster_period"] == 3
    assert children(g, "group0") == [0, 1]
    assert children(g, "group1") == [2, 3, 4]
    assert g.edges["group0", "group1"]["kind"] == "inter"
    assert g.edges[0, "group0"]["kind"] == "intra"
    # default groups: chunks of hierarchy_branching clients
    d = build_topology(TopologySpec(kind="hybrid", hierarchy_branching=4), 10)
    assert [children(d, a) for a in aggregators_by_level(d)[0]] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with pytest.raises(TopologyError, match="cover clients 0..n-1 exactly once"):
        hybrid([[0, 1], [1, 2]], 1)


def test_unknown_kind() -> None:
    with pytest.raises(TopologyError, match="unknown topology.kind 'tree'; allowed: star"):
        build_topology(TopologySpec(kind="tree"), 3)
