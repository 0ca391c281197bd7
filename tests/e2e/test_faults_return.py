"""A lost cluster that comes back is re-admitted: its daemon, restarted with the same
config during the job, gets a fresh executor at the next round boundary, the placement
gives it nodes again (they migrate back with their state) and its clients train; below
`min_clusters` the job waits for it (`return_wait`). Real daemons, in-process executors."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest

from proto.rounds import RoundRecord
from scheduler.testbed import LocalTestbed
from tests.e2e._faults import drive, kill_and_restart
from tests.e2e.test_faults_continue import ROUNDS, spec

pytestmark = pytest.mark.slow


def test_a_restarted_cluster_is_readmitted_and_trains_again(tmp_path: Path) -> None:
    # cluster-1 is every other daemon's bootstrap peer: it has none to dial itself, so the
    # others must find it again (the harder case; a restarted cluster-2 dials cluster-1)
    victim = "cluster-1"
    job = spec(f"back-{victim}")
    with LocalTestbed(3, backend="inprocess", workdir=str(tmp_path / "tb"), capacity=3) as tb:
        clusters = tb.start(timeout=60)
        events: list[str] = []
        chaos = kill_and_restart(tb, victim, job.job_id, events)

        summary = drive(tb, clusters, job, chaos, tmp_path / "run").summary
    assert events == ["killed", "restarted", "started"]
    assert [r.round for r in summary.rounds] == list(range(1, ROUNDS + 1))
    assert [(f["event"], f["cluster"]) for f in summary.faults] == [("lost", victim),
                                                                   ("returned", victim)]
    lost, back = summary.faults
    assert back["round"] > lost["round"] and back["nodes_moved"] >= 1
    assert back["away_seconds"] > 0 and back["recover_seconds"] > 0
    # from its return on, it trains its clients again, and every client takes part
    returned = [r for r in summary.rounds if r.round >= back["round"]]
    assert returned and all(victim in r.by_cluster for r in returned)
    assert all(r.by_cluster[victim]["participants"] >= 1 for r in returned)
    assert all(r.participants == 6 for r in summary.rounds)
    assert {c.cluster_id for c in summary.clusters} == set(tb.cluster_ids)
    assert not math.isnan(summary.rounds[-1].accuracy)


def test_below_min_clusters_the_job_waits_for_the_cluster_to_return(tmp_path: Path) -> None:
    job = spec("wait-back", min_clusters=3, return_wait=120)
    victim = "cluster-3"
    with LocalTestbed(3, backend="inprocess", workdir=str(tmp_path / "tb"), capacity=3) as tb:
        clusters = tb.start(timeout=60)
        restarter: list[threading.Thread] = []

        def chaos(record: RoundRecord, total: int) -> None:
            if record.round == 2:
                tb.kill(victim)

                def later() -> None:  # the operator needs a few seconds
                    time.sleep(3)
                    tb.restart(victim)
                restarter.append(threading.Thread(target=later, daemon=True))
                restarter[0].start()

        summary = drive(tb, clusters, job, chaos, tmp_path / "run").summary
    assert [r.round for r in summary.rounds] == list(range(1, ROUNDS + 1))
    assert [(f["event"], f["cluster"]) for f in summary.faults] == [("lost", victim),
                                                                   ("returned", victim)]
    lost, back = summary.faults
    # the job never ran a round without it: it waited, and its nodes went back to it
    assert back["round"] == lost["round"] and back["nodes_moved"] >= 1
    assert lost["moved_to"] == [victim]
    assert all(set(r.by_cluster) == set(tb.cluster_ids) for r in summary.rounds)
