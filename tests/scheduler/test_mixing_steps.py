"""Auto mixing steps (topology.mixing_steps = 0): the graph's mixing factor, the steps it
asks for, and how the plan carries them to the executors."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from proto.errors import InvalidMessage
from proto.job import MAX_MIXING_STEPS, JobSpec
from proto.routing import RoutingMatrix
from scheduler.planning import topology as topo_mod
from scheduler.planning.clusters import ClusterSlot
from scheduler.planning.plan import plan_job
from scheduler.planning.topology import (
    MIXING_TARGET,
    auto_mixing_steps,
    mixing_factor,
    random_k_edges,
    ring_edges,
)


def engine_matrix(n: int, edges: np.ndarray, samples: np.ndarray) -> np.ndarray:
    """The engine's mixing rule as a dense matrix: a node averages itself and its
    neighbours, weighted by their samples."""
    a = np.eye(n)
    a[edges[:, 0], edges[:, 1]] = a[edges[:, 1], edges[:, 0]] = 1.0
    w = a * samples[None, :]
    return w / w.sum(axis=1, keepdims=True)


def second_modulus(w: np.ndarray) -> float:
    return float(np.sort(np.abs(np.linalg.eigvals(w)))[-2])


def test_the_factor_is_the_engine_matrixs_second_eigenvalue() -> None:
    rng = np.random.default_rng(3)
    edges = random_k_edges(60, 5, seed=3)
    samples = rng.integers(10, 300, size=60).astype(float)
    want = second_modulus(engine_matrix(60, edges, samples))
    assert mixing_factor(edges, samples) == pytest.approx(want, abs=1e-9)
    # a complete graph with equal weights mixes in one step; two parts never do
    full = np.array([(i, j) for i in range(6) for j in range(i + 1, 6)])
    assert mixing_factor(full, np.ones(6)) == pytest.approx(0.0, abs=1e-9)
    split = np.array([(0, 1), (1, 2), (3, 4), (4, 5)])
    assert mixing_factor(split, np.ones(6)) == pytest.approx(1.0)


def test_power_iteration_above_the_dense_limit_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    edges = random_k_edges(400, 6, seed=1)
    samples = np.random.default_rng(1).integers(20, 200, size=400).astype(float)
    exact = mixing_factor(edges, samples)
    monkeypatch.setattr(topo_mod, "DENSE_MIXING_LIMIT", 100)
    approx = mixing_factor(edges, samples, iterations=400)
    assert approx == pytest.approx(exact, rel=0.02)
    assert approx <= exact + 1e-9  # from below: never more steps than the graph needs


def test_steps_reach_the_target_and_no_more() -> None:
    edges = random_k_edges(40, 7, seed=0)
    samples = np.full(40, 100.0)
    factor = mixing_factor(edges, samples)
    steps = auto_mixing_steps(edges, samples)
    assert 1 < steps <= MAX_MIXING_STEPS
    assert factor ** steps <= MIXING_TARGET < factor ** (steps - 1)


def test_graphs_that_mix_too_slowly_or_at_once_take_one_step() -> None:
    assert auto_mixing_steps(ring_edges(40), np.ones(40)) == 1          # factor ~0.99
    full = np.array([(i, j) for i in range(8) for j in range(i + 1, 8)])
    assert auto_mixing_steps(full, np.ones(8)) == 1                      # factor 0
    assert auto_mixing_steps(np.array([(0, 1), (2, 3)]), np.ones(4)) == 1  # disconnected


def plan(topology: dict[str, object], aggregation: str | None = None,
         fraction: float = 1.0) -> RoutingMatrix:
    job: dict[str, object] = {"job": {"id": "mix", "seed": 0},
                              "data": {"number_of_clients": 40, "dirichlet_beta": 0.3},
                              "training": {"client_fraction": fraction},
                              "topology": topology}
    if aggregation:
        job["aggregation"] = {"name": aggregation}
    spec = JobSpec.from_dict(job)
    return plan_job(spec, [ClusterSlot(c, 20) for c in "ab"]).routing


def test_the_plan_carries_the_steps_auto_or_as_set() -> None:
    auto = plan({"kind": "k_connected", "traffic_budget": 0}, "fedavg")
    assert auto.mixing_steps > 1  # a log-degree graph: 0.5-0.7 a step, so 3-4 steps
    assert plan({"kind": "k_connected", "mixing_steps": 2}, "fedavg").mixing_steps == 2
    assert plan({"kind": "k_connected"}).mixing_steps == 1  # fedavgm (momentum): one
    assert plan({"kind": "k_connected"}, "median").mixing_steps == 1   # not measured: one
    assert plan({"kind": "ring"}).mixing_steps == 1
    assert plan({"kind": "star"}).mixing_steps == 1
    back = RoutingMatrix.from_bytes(auto.to_bytes())
    assert back == auto and back.mixing_steps == auto.mixing_steps
    assert auto.to_dict(readable=True)["mixing_steps"] == auto.mixing_steps


def test_a_sampled_round_mixes_over_the_whole_graph() -> None:
    """A round mixes its participants and their neighbours (engine.Draw), so the
    fraction does not thin the graph the steps are chosen for."""
    full = plan({"kind": "k_connected", "traffic_budget": 0}, "fedavg")
    for fraction in (0.05, 0.3):
        sampled = plan({"kind": "k_connected", "traffic_budget": 0}, "fedavg", fraction)
        assert sampled.mixing_steps == full.mixing_steps > 1


@pytest.mark.parametrize(("kind", "steps", "needle"), [
    ("k_connected", 0, "'mixing_steps': must be in 1..4, got"),
    ("k_connected", MAX_MIXING_STEPS + 1, "'mixing_steps': must be in 1..4, got"),
    ("star", 2, "'mixing_steps': must be 1 on star, got 2"),
])
def test_a_plans_mixing_steps_are_validated(kind: str, steps: int, needle: str) -> None:
    routing = plan({"kind": kind})
    obj = routing.to_dict()
    obj["mixing_steps"] = steps
    with pytest.raises(InvalidMessage, match=needle):
        RoutingMatrix.from_bytes(msgpack.packb(obj, use_bin_type=True))
    # a matrix that leaves the key out (one step, or a plan from before it) reads as 1
    obj.pop("mixing_steps")
    assert RoutingMatrix.from_bytes(msgpack.packb(obj, use_bin_type=True)).mixing_steps == 1


@pytest.mark.parametrize("clients", [12, 40, 100, 300])
def test_k_connected_keeps_to_its_traffic_budget(clients: int) -> None:
    """At most topology.traffic_budget x star's inter-cluster transfers on the same
    placement (a node's model crossing once to each cluster it has neighbours on); every
    node keeps its degree (edges inside its cluster make it up) and the graph stays
    connected (its mixing factor is below 1). Up to FREE_DEGREE + 1 clients, a budget that
    pays for every model to reach every cluster buys every pair: one step averages all."""
    def planned(budget: float) -> Any:
        spec = JobSpec.from_dict({"job": {"id": "budget", "seed": 0},
                                  "data": {"number_of_clients": clients, "dirichlet_beta": 0.3},
                                  "topology": {"kind": "k_connected", "traffic_budget": budget}})
        cap = int(1.5 * clients / 4) + 1
        return plan_job(spec, [ClusterSlot(c, cap) for c in "abcd"])

    free = planned(0.0)
    star = free.summary()["star_inter_cluster_transfers_per_round"]
    assert free.summary()["inter_cluster_transfers_per_round"] > star  # a budget of 1 acts
    before = np.bincount(free.topology.edges.ravel(), minlength=clients)
    plans = {budget: planned(budget) for budget in (1.0, 3.0)}  # each planned once (seconds at 300)
    for budget, budgeted in plans.items():
        s = budgeted.summary()
        assert s["star_inter_cluster_transfers_per_round"] == star
        assert 0 < s["inter_cluster_transfers_per_round"] <= budget * star
        after = np.bincount(budgeted.topology.edges.ravel(), minlength=clients)
        index = budgeted.placement.cluster_index
        room = np.bincount(index)[index] - 1      # a node cannot have more peers in its cluster
        assert np.all(after >= np.minimum(before, room))
        assert mixing_factor(budgeted.topology.edges, np.ones(clients)) < 0.99
    everyone = plans[3.0].topology
    if clients <= topo_mod.FREE_DEGREE + 1:
        assert everyone.num_edges == clients * (clients - 1) // 2 and everyone.mixing_steps == 1
    else:  # a node would average too many models: the graph as the budget leaves it
        assert everyone.num_edges < clients * topo_mod.FREE_DEGREE // 2
