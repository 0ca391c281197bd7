"""[privacy] through the whole job pipeline in one process (driver, executors, engine,
loopback link, torch training on digits): the root sees only masked updates and learns
the same model; central DP reports the epsilon spent and stops at its budget."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load as st_load

from fedpilot.loopback import LoopbackMesh
from proto.job import JobSpec
from scheduler.run.driver import Driver, JobFailed
from tests.e2e.test_pinned_loopback import Losing
from worker.context import InProcessContext
from worker.executor.runtime import runtime_factory
from worker.privacy import Privacy, dp, flatten, secagg


def job(rounds: int = 3, kind: str = "star", **privacy: Any) -> JobSpec:
    return JobSpec.from_dict({
        "job": {"id": "private", "seed": 5},
        "data": {"number_of_clients": 9, "dirichlet_beta": 0.5},
        "training": {"federated_learning_rounds": rounds, "number_of_epochs": 1,
                     "client_fraction": 0.7},
        "topology": {"kind": kind},
        "aggregation": {"name": "fedavgm"},
        "placement": {"max_materialized": 2, "strategy": "round_robin"},
        "privacy": privacy,
    })


def run(spec: JobSpec) -> Any:
    mesh = LoopbackMesh(["a", "b", "c"], lambda cid: runtime_factory(InProcessContext(), cid),
                        capacity=4)
    driver = Driver(spec, mesh.clusters(), mesh, backend="inprocess", timeout=120)
    try:
        return driver.run()
    finally:
        driver.close()


def test_curious_root_sees_only_masked_updates_and_the_result_is_unchanged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[np.ndarray] = []
    combine = Privacy.combine

    def recording(self: Privacy, current: Any, updates: list[Any], node: str = "") -> Any:
        seen.extend(flatten(w) for w, _ in updates)  # what the aggregating executor receives
        return combine(self, current, updates, node)

    monkeypatch.setattr(Privacy, "combine", recording)
    masked = run(job(secure_aggregation=True)).summary
    assert seen and len(seen) == sum(r.participants for r in masked.rounds)
    for vector in seen:
        assert np.all(vector == np.rint(vector)) and vector.min() >= 0
        assert vector.max() < 2 ** secagg.RING_BITS
        assert abs(np.mean(vector) / 2 ** secagg.RING_BITS - 0.5) < 0.05  # not a model
    monkeypatch.setattr(Privacy, "combine", combine)
    plain = run(job()).summary
    assert [r.participants for r in masked.rounds] == [r.participants for r in plain.rounds]
    for a, b in zip(masked.rounds, plain.rounds, strict=True):
        assert a.accuracy == pytest.approx(b.accuracy, abs=0.01)
        assert a.loss == pytest.approx(b.loss, rel=0.01)
    assert masked.privacy["secure_aggregation"] and not plain.privacy
    assert math.isnan(masked.rounds[-1].epsilon)


def test_hybrid_groups_exchange_only_masked_models(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[np.ndarray] = []
    mask = Privacy.mask

    def recording(self: Privacy, *args: Any) -> Any:
        sent = mask(self, *args)
        if args[-1] == "exchange":  # what a group sends every other group
            seen.append(flatten(sent))
        return sent

    monkeypatch.setattr(Privacy, "mask", recording)
    masked = run(job(kind="hybrid", secure_aggregation=True)).summary
    assert len(seen) == 3 * len(masked.rounds)  # a group a cluster, each round
    for vector in seen:
        assert np.all(vector == np.rint(vector)) and vector.min() >= 0
        assert abs(np.mean(vector) / 2 ** secagg.RING_BITS - 0.5) < 0.05
    monkeypatch.setattr(Privacy, "mask", mask)
    plain = run(job(kind="hybrid")).summary
    for a, b in zip(masked.rounds, plain.rounds, strict=True):
        assert a.accuracy == pytest.approx(b.accuracy, abs=0.01)
        assert a.loss == pytest.approx(b.loss, rel=0.01)


def test_central_dp_reports_epsilon_and_stops_at_its_budget() -> None:
    spec = job(rounds=6, dp="central", clip_norm=1.0, noise_multiplier=2.0, epsilon=3.0,
               secure_aggregation=True)
    allowed = next(r for r in range(7) if dp.epsilon(2.0, 0.7, r + 1, 1e-5) > 3.0)
    assert 0 < allowed < 6
    summary = run(spec).summary
    assert [r.round for r in summary.rounds] == list(range(1, allowed + 1))
    spent = [r.epsilon for r in summary.rounds]
    assert spent == [pytest.approx(dp.epsilon(2.0, 0.7, r, 1e-5)) for r in range(1, allowed + 1)]
    assert spent == sorted(spent) and spent[-1] <= 3.0
    assert f"round {allowed + 1} would spend more" in summary.privacy["stopped"]
    assert summary.privacy["epsilon"] == spent[-1]
    # adaptive clipping: its noised count is split off z, the epsilon is z's
    target = run(job(rounds=3, dp="central", epsilon=8.0, clip_norm=1.0,
                     clip_quantile=0.5)).summary
    z = target.privacy["noise_multiplier"]
    assert target.privacy["clip_quantile"] == 0.5
    assert [r.epsilon for r in target.rounds] == [
        pytest.approx(dp.epsilon(z, 0.7, r, 1e-5)) for r in (1, 2, 3)]
    assert target.rounds[-1].epsilon == pytest.approx(8.0, rel=0.01)
    with pytest.raises(JobFailed, match="privacy budget"):
        run(job(rounds=2, dp="central", noise_multiplier=0.5, epsilon=0.5))


def test_local_dp_on_a_hierarchy_reports_epsilon() -> None:
    spec = JobSpec.from_dict({**job(rounds=2).to_dict(),
                              "topology": {"kind": "hierarchical", "hierarchy_branching": 3},
                              "privacy": {"dp": "local", "noise_multiplier": 4.0,
                                          "clip_norm": 0.5}})
    summary = run(spec).summary
    assert [r.epsilon for r in summary.rounds] == [
        pytest.approx(dp.epsilon(4.0, 1.0, r, 1e-5)) for r in (1, 2)]  # local: q = 1
    assert all(math.isfinite(r.accuracy) for r in summary.rounds)
    assert summary.privacy["dp"] == "local" and not summary.privacy["stopped"]


def run_losing_b_in_round_3(spec: JobSpec, out: Path) -> Any:
    """`spec` on clusters a, b, c; b dies while it trains round 3 and answers nothing more
    (its clients' masked updates never reach the root; the survivors' carry pair masks
    with b)."""
    held: dict[str, Any] = {"released": threading.Event()}  # b's thread ends with the job
    mesh = held["mesh"] = Losing(["a", "b", "c"], lambda cid: killing(cid, held), capacity=6)
    driver = held["driver"] = Driver(spec, mesh.clusters(), mesh, backend="inprocess",
                                     timeout=120, run_dir=out)
    try:
        return driver.run()
    finally:
        held["released"].set()
        driver.close()


def killing(cid: str, held: dict[str, Any]) -> Any:
    make = runtime_factory(InProcessContext(), cid)

    def factory(spec: JobSpec) -> Any:
        runtime = make(spec)
        train = runtime.train

        def train_or_die(node: str, model: Any, round_index: int) -> Any:
            if cid == "b" and round_index == 3:
                with held.setdefault("lock", threading.Lock()):
                    if "b" not in getattr(held["mesh"], "dead", set()):
                        asked = time.monotonic()  # b holds a lease (the keeper judges it)
                        held["driver"].leases.renew_now()
                        while held["driver"].leases.answered_at("b") <= asked:
                            time.sleep(0.05)
                        held["mesh"].kill("b")
                held["released"].wait()
                raise RuntimeError("cluster b died while it trained round 3")
            return train(node, model, round_index)

        runtime.train = train_or_die
        return runtime
    return factory


@pytest.mark.slow
def test_a_cluster_lost_mid_round_leaves_the_model_of_the_plain_job(tmp_path: Path) -> None:
    """Secure aggregation's masks of round 3 include b, which dies in it: the round runs
    again on the survivors under fresh masks (no mask of a lost contributor is left in a
    sum), and the job ends with the model of the same job without secure aggregation,
    within fixed point's rounding (a mask left in would put uniform ring values of
    +-clip_range into the model)."""
    def losing(**privacy: Any) -> JobSpec:
        return JobSpec.from_dict({**job(rounds=5).to_dict(),
                                  "faults": {"on_cluster_loss": "continue", "lease_seconds": 4,
                                             "checkpoint_every": 1},
                                  "privacy": privacy})

    masked = run_losing_b_in_round_3(losing(secure_aggregation=True), tmp_path / "masked")
    plain = run_losing_b_in_round_3(losing(), tmp_path / "plain")
    for result in (masked, plain):
        summary = result.summary
        assert [r.round for r in summary.rounds] == [1, 2, 3, 4, 5]
        assert [(f["cluster"], f["event"], f["round"]) for f in summary.faults] == [
            ("b", "lost", 3)]
        assert all(set(r.by_cluster) == {"a", "c"} for r in summary.rounds[2:])
    assert masked.summary.privacy["secure_aggregation"]
    a, b = st_load(masked.model), st_load(plain.model)
    assert set(a) == set(b)
    diff = max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a)
    assert diff < 1e-4, diff
