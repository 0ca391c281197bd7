"""Logical topology edge lists, checked against hand-built graphs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from proto.job import TopologySpec, k_neighbors
from scheduler.errors import PlanError
from scheduler.planning.placement.histograms import synthetic_histograms
from scheduler.planning.topology import build_topology, similarity_edges


def pairs(edges: np.ndarray) -> set[tuple[int, int]]:
    return {(int(a), int(b)) for a, b in edges}


def test_star() -> None:
    t = build_topology(TopologySpec(kind="star"), 4)
    assert t.aggregator_names == ("server",) and t.num_nodes == 5
    assert pairs(t.edges) == {(0, 4), (1, 4), (2, 4), (3, 4)}


def test_hierarchical_levels() -> None:
    t = build_topology(TopologySpec(kind="hierarchical", hierarchy_levels=3,
                                    hierarchy_branching=2), 5)
    # clients 0..4; level 1: agg1_0{0,1} agg1_1{2,3} agg1_2{4}; level 2: agg2_0{agg1_0,agg1_1}
    # agg2_1{agg1_2}; level 3: server.
    assert t.aggregator_names == ("agg1_0", "agg1_1", "agg1_2", "agg2_0", "agg2_1", "server")
    assert pairs(t.edges) == {(0, 5), (1, 5), (2, 6), (3, 6), (4, 7), (5, 8), (6, 8), (7, 9),
                              (8, 10), (9, 10)}


def test_ring_and_full() -> None:
    assert pairs(build_topology(TopologySpec(kind="ring"), 4).edges) == {
        (0, 1), (1, 2), (2, 3), (0, 3)}
    assert build_topology(TopologySpec(kind="full"), 6).num_edges == 15


def test_k_connected_random_is_regular_and_seeded() -> None:
    spec = TopologySpec(kind="k_connected", k_connected_mode="random", client_k_neighbors=3)
    t = build_topology(spec, 20, seed=1)
    degree = np.bincount(t.edges.ravel(), minlength=20)
    assert (degree == 3).all()
    assert pairs(t.edges) == pairs(build_topology(spec, 20, seed=1).edges)
    assert pairs(t.edges) != pairs(build_topology(spec, 20, seed=2).edges)


def test_k_connected_default_k_grows_with_the_federation() -> None:
    """client_k_neighbors = 0 (the default): k = ceil(log2 n) + 1, at least 3, at most n - 1;
    an explicit k is kept."""
    for n, k in ((40, 7), (1000, 11), (8, 4), (5, 4), (3, 2)):
        t = build_topology(TopologySpec(kind="k_connected", k_connected_mode="random"), n,
                           seed=0)
        assert np.bincount(t.edges.ravel(), minlength=n).min() == k, (n, k)
        assert k_neighbors(TopologySpec(), n) == k
    explicit = TopologySpec(kind="k_connected", k_connected_mode="random", client_k_neighbors=2)
    assert (np.bincount(build_topology(explicit, 40).edges.ravel(), minlength=40) == 2).all()


def test_k_connected_similarity_links_most_similar() -> None:
    h = np.array([[10, 0, 0], [9, 1, 0], [0, 10, 0], [0, 9, 1], [0, 0, 10], [1, 0, 9]])
    t = build_topology(TopologySpec(kind="k_connected", client_k_neighbors=1,
                                    k_connected_mode="similarity"), 6, histograms=h)
    assert pairs(t.edges) == {(0, 1), (2, 3), (4, 5)}


def test_k_connected_complementary_neighbourhoods_hold_the_classes_a_client_lacks() -> None:
    """Label-skewed clients (Dirichlet 0.1): a complementary neighbourhood (a client and its
    neighbours) holds a far more even label mix than a similarity one; the degrees hold."""
    h = synthetic_histograms(200, beta=0.1, seed=4)
    share = h.sum(axis=0) / h.sum()

    def mix_gap(mode: str) -> float:
        t = build_topology(TopologySpec(kind="k_connected", client_k_neighbors=3,
                                        k_connected_mode=mode), 200, histograms=h, seed=0)
        hood = h.astype(float).copy()
        for a, b in t.edges:
            hood[a] += h[b]
            hood[b] += h[a]
        assert np.bincount(t.edges.ravel(), minlength=200).min() >= 3
        mix = hood / hood.sum(axis=1, keepdims=True)
        return float(np.abs(mix - share).sum(axis=1).mean())   # total variation x 2

    complementary, similarity = mix_gap("complementary"), mix_gap("similarity")
    assert complementary < 0.6 * similarity, (complementary, similarity)


def test_scalable_similarity_neighbours_close_to_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    h = synthetic_histograms(3000, beta=0.1, seed=3)
    exact = pairs(similarity_edges(h, 3))
    monkeypatch.setattr("scheduler.planning.topology.EXACT_KNN_LIMIT", 100)
    approx = pairs(similarity_edges(h, 3))
    u = h / np.linalg.norm(h, axis=1, keepdims=True)
    sim = lambda es: np.mean([u[a] @ u[b] for a, b in es])  # noqa: E731
    # The block search finds neighbours nearly as similar as the exact ones.
    assert sim(approx) > 0.97 * sim(exact)


def test_custom_csv(tmp_path: Path) -> None:
    path = tmp_path / "adj.csv"
    path.write_text("0,1,0\n1,0,2\n0,2,0\n")
    t = build_topology(TopologySpec(kind="custom", adjacency_file=str(path)), 3)
    assert pairs(t.edges) == {(0, 1), (1, 2)}
    assert sorted(t.weights.tolist()) == [1.0, 2.0]


@pytest.mark.parametrize(("text", "needle"), [
    ("0,1\n1,0\n", "2x2, expected 3x3"),
    ("0,1,0\n0,0,1\n0,1,0\n", "not symmetric (row 0, column 1"),
    ("0,x,0\n1,0,1\n0,1,0\n", "cannot read the adjacency CSV"),
])
def test_custom_csv_errors(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "adj.csv"
    path.write_text(text)
    with pytest.raises(PlanError, match="adj.csv") as info:
        build_topology(TopologySpec(kind="custom", adjacency_file=str(path)), 3)
    assert needle in str(info.value)


def test_hybrid_heads_named_after_groups() -> None:
    t = build_topology(TopologySpec(kind="hybrid", inter_cluster_period=2), 4,
                       groups=np.array([0, 2, 0, 2]), group_names=("a", "b", "c"))
    assert t.aggregator_names == ("g:a", "g:c")
    assert pairs(t.edges) == {(0, 4), (2, 4), (1, 5), (3, 5), (4, 5)}
    assert t.weights[-1] == 0.5


def test_full_topology_too_large_is_clear_error() -> None:
    with pytest.raises(PlanError, match="use k_connected or hybrid"):
        build_topology(TopologySpec(kind="full"), 100_000)
