"""A lost cluster does not end the job: with `on_cluster_loss = "continue"` its nodes are
re-planned onto the survivors, restored from the last checkpoint, and the interrupted
round runs again; summary.faults records it. Real daemons, in-process executors."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from proto.job import JobSpec
from proto.rounds import RoundRecord
from scheduler.run.driver import JobFailed
from scheduler.testbed import LocalTestbed
from tests.e2e._faults import drive, kill, wait_for_executor

pytestmark = pytest.mark.slow
ROUNDS = 8


def spec(job_id: str, **faults: Any) -> JobSpec:
    return JobSpec.from_dict({
        "job": {"id": job_id, "seed": 6},
        "data": {"number_of_clients": 6},
        "training": {"federated_learning_rounds": ROUNDS, "number_of_epochs": 1},
        "topology": {"kind": "star"},
        "aggregation": {"name": "fedadam"},
        "placement": {"strategy": "round_robin", "max_materialized": 2},
        "faults": {"lease_seconds": 6, "checkpoint_every": 1, "on_cluster_loss": "continue",
                   **faults}})


def run(tb: LocalTestbed, clusters: Any, job: JobSpec, out: Path, what: str) -> Any:
    victim = tb.cluster_ids[0]

    killed: list[int] = []

    def kill_at_round_3(record: RoundRecord, total: int) -> None:
        if record.round == 3:
            kill(tb, victim, what)
            killed.append(record.round)
        elif what == "executor" and killed == [3] and victim not in record.by_cluster:
            # a round without it: its daemon stayed, so a new executor is starting there
            wait_for_executor(tb, victim, job.job_id)
            killed.append(record.round)

    return drive(tb, clusters, job, kill_at_round_3, out), victim


@pytest.mark.parametrize("what", ["daemon", "executor"])
def test_the_job_goes_on_without_a_killed_cluster(three_clusters: Any, tmp_path: Path,
                                                   what: str) -> None:
    tb, clusters = three_clusters
    result, victim = run(tb, clusters, spec(f"go-on-{what}"), tmp_path / "run", what)
    summary = result.summary
    assert [r.round for r in summary.rounds] == list(range(1, ROUNDS + 1))
    fault = summary.faults[0]
    assert fault["event"] == "lost"
    assert fault["cluster"] == victim and fault["round"] in (3, 4)  # its checkpoint or next round
    assert fault["nodes_moved"] >= 2 and victim not in fault["moved_to"]
    assert fault["detect_seconds"] >= 0 and fault["recover_seconds"] > 0
    if what == "daemon":
        # the rounds after the loss ran on the two survivors only, with every client
        assert [f["event"] for f in summary.faults] == ["lost"]
        for record in summary.rounds[4:]:
            assert set(record.by_cluster) == set(tb.cluster_ids) - {victim}
        assert {c.cluster_id for c in summary.clusters} == set(tb.cluster_ids) - {victim}
    else:
        # its daemon stayed: the cluster is re-admitted (a fresh executor) at the next
        # round boundary and trains again
        assert [f["event"] for f in summary.faults] == ["lost", "returned"]
        back = summary.faults[1]
        assert back["cluster"] == victim and back["round"] > fault["round"]
        for record in summary.rounds[back["round"] - 1:]:
            assert set(record.by_cluster) == set(tb.cluster_ids)
        assert {c.cluster_id for c in summary.clusters} == set(tb.cluster_ids)
    assert all(record.participants == 6 for record in summary.rounds)
    assert not math.isnan(summary.rounds[-1].accuracy)


def test_below_min_clusters_the_job_fails_naming_what_is_missing(three_clusters: Any,
                                                                 tmp_path: Path) -> None:
    tb, clusters = three_clusters
    with pytest.raises(JobFailed, match="min_clusters = 3"):
        run(tb, clusters, spec("too-few", min_clusters=3, return_wait=2), tmp_path / "run",
            "daemon")


@pytest.fixture()
def tight_testbed(tmp_path: Path) -> Any:
    """Room for every client only while all three clusters are up."""
    with LocalTestbed(3, backend="inprocess", workdir=str(tmp_path / "tb"), capacity=2) as tb:
        clusters = tb.start(timeout=60)
        yield tb, clusters


@pytest.mark.parametrize("what", ["daemon", "executor"])
def test_clients_the_survivors_cannot_hold_sit_out_until_their_cluster_returns(
        tight_testbed: Any, tmp_path: Path, what: str) -> None:
    """Degrade, don't die: 6 clients on 3 clusters of capacity 2; one is lost, the two
    left hold 4, so 2 clients sit out (the job goes on, fewer train); when the cluster
    returns (its executor alone was killed) every client trains again."""
    tb, clusters = tight_testbed
    result, victim = run(tb, clusters, spec(f"degrade-{what}"), tmp_path / "run", what)
    summary = result.summary
    assert [r.round for r in summary.rounds] == list(range(1, ROUNDS + 1))
    lost = summary.faults[0]
    assert lost["event"] == "lost" and lost["cluster"] == victim
    assert lost["clients_sitting_out"] == 2
    after_loss = [r for r in summary.rounds if r.round > lost["round"]]
    if what == "daemon":
        assert all(r.participants == 4 for r in after_loss)
    else:
        back = summary.faults[1]
        assert back["event"] == "returned" and back["clients_sitting_out"] == 0
        assert any(r.participants == 4 for r in after_loss)
        assert all(r.participants == 6 for r in summary.rounds if r.round > back["round"])
    assert not math.isnan(summary.rounds[-1].accuracy)


def test_a_cluster_lost_mid_round_under_secure_aggregation(three_clusters: Any,
                                                            tmp_path: Path) -> None:
    """The masks of a round are fixed over its clusters; one lost mid-round aborts it, and
    the survivors run it again under fresh masks (the attempt is in every mask's label):
    their masked updates sum to their plain mean, so the job learns on (a wrong unmask
    would leave uniform ring values, +-clip_range a weight, and a loss in the hundreds)."""
    tb, clusters = three_clusters
    job = JobSpec.from_dict({**spec("go-on-secagg").to_dict(),
                             "privacy": {"secure_aggregation": True}})
    result, victim = run(tb, clusters, job, tmp_path / "run", "daemon")
    summary = result.summary
    assert [r.round for r in summary.rounds] == list(range(1, ROUNDS + 1))
    assert [f["event"] for f in summary.faults] == ["lost"]
    assert summary.privacy["secure_aggregation"]
    for record in summary.rounds[4:]:
        assert set(record.by_cluster) == set(tb.cluster_ids) - {victim}
    losses = [r.loss for r in summary.rounds]
    assert all(math.isfinite(x) for x in losses)
    assert max(losses[4:]) < losses[0]
    assert summary.rounds[-1].accuracy > 0.5
