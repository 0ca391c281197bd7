"""A cluster that stalls (its daemon and executor stopped past the heartbeat timeout, as a
starved container or a paused VM) and then resumes: the job goes on without it and
finishes every round; the stalled cluster's late messages and its stale round do not
fail the survivors' repeated round. Real daemons, in-process executors."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from proto.job import JobSpec
from proto.rounds import RoundRecord
from scheduler.testbed import LocalTestbed
from tests.e2e._faults import drive, executor_pid

pytestmark = pytest.mark.slow
ROUNDS = 10
STALL_SECONDS = 8.0  # past the heartbeat timeout (5 s) and the lease (6 s)


@pytest.mark.parametrize("topology", ["star", "hybrid"])
def test_a_stalled_cluster_that_resumes_does_not_fail_the_job(tmp_path: Path, topology: str) -> None:
    job = JobSpec.from_dict({
        "job": {"id": f"stall-{topology}", "seed": 6},
        "data": {"number_of_clients": 6},
        "training": {"federated_learning_rounds": ROUNDS, "number_of_epochs": 1},
        "topology": {"kind": topology},
        "aggregation": {"name": "fedavg"},
        "placement": {"strategy": "round_robin", "max_materialized": 2},
        "faults": {"lease_seconds": 6, "checkpoint_every": 1, "on_cluster_loss": "continue"}})
    with LocalTestbed(3, backend="inprocess", workdir=str(tmp_path / "tb"), capacity=3) as tb:
        clusters = tb.start(timeout=60)
        victim = tb.cluster_ids[0]
        stalled: list[int] = []
        events: list[str] = []

        def resume() -> None:
            for pid in stalled:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

        def chaos(record: RoundRecord, total: int) -> None:
            if record.round == 3 and not events:
                stalled.extend([tb.procs[victim].pid, executor_pid(tb, victim)])
                for pid in stalled:
                    os.kill(pid, signal.SIGSTOP)
                events.append(f"stopped {time.monotonic()}")
            elif len(events) == 1 and victim not in record.by_cluster:
                # a round ran without it: it was declared lost. It wakes up now, while the
                # job goes on: its old executor and daemon find the job moved on
                stopped_at = float(events[0].split()[1])
                time.sleep(max(0.0, stopped_at + STALL_SECONDS - time.monotonic()))
                resume()
                events.append("resumed")

        try:
            result = drive(tb, clusters, job, chaos, tmp_path / "run")
        finally:
            resume()  # never leave a stopped process behind
        assert events[1:] == ["resumed"]
        summary = result.summary
        assert [r.round for r in summary.rounds] == list(range(1, ROUNDS + 1))
        lost = [f for f in summary.faults if f["event"] == "lost"]
        assert lost and lost[0]["cluster"] == victim
        for record in summary.rounds:
            assert record.accuracy is not None and record.accuracy > 0.0
        # the survivors trained every round after the stall
        after = [r for r in summary.rounds if r.round > lost[0]["round"]]
        assert all(set(tb.cluster_ids) - {victim} <= set(r.by_cluster) for r in after)
