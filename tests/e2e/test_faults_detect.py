"""A lost cluster is noticed in seconds (lease, mesh connection), not by a round timeout;
round deadlines follow measured round times."""

from __future__ import annotations

import time
from typing import Any

import pytest

from fedpilot.loopback import LoopbackMesh
from proto.job import JobSpec
from proto.rounds import RoundRecord
from scheduler.run.driver import Driver, JobFailed
from scheduler.run.leases import ClusterLost
from tests.e2e._faults import job_driver, kill
from worker.context import InProcessContext
from worker.executor.runtime import runtime_factory

ROUND_TIMEOUT = 900.0  # what a lost cluster used to cost


def spec(job_id: str, rounds: int, **faults: Any) -> JobSpec:
    return JobSpec.from_dict({
        "job": {"id": job_id, "seed": 4},
        "data": {"number_of_clients": 6},
        "training": {"federated_learning_rounds": rounds, "number_of_epochs": 1},
        "topology": {"kind": "star"},
        "placement": {"strategy": "round_robin", "max_materialized": 2},
        "faults": {"lease_seconds": 6, **faults}})


class Recording(LoopbackMesh):
    """The loopback mesh, remembering every round.run body it carried."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.round_bodies: list[dict[str, Any]] = []

    def request(self, cluster_id: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        if body.get("kind") == "round.run":
            self.round_bodies.append(dict(body))
        return super().request(cluster_id, body, timeout)


def test_round_deadlines_follow_the_slowest_round() -> None:
    job = spec("deadline", 4, round_deadline_floor=1, round_deadline_factor=3)
    mesh = Recording(["a", "b"], lambda cid: runtime_factory(InProcessContext(), cid),
                     capacity=4)
    seconds: list[float] = []
    driver = Driver(job, mesh.clusters(), mesh, backend="inprocess", timeout=ROUND_TIMEOUT,
                    progress=lambda record, total: seconds.append(record.seconds))
    try:
        driver.run()
    finally:
        driver.close()
    deadlines = {int(b["round"]): float(b["deadline"]) for b in mesh.round_bodies}
    assert deadlines[1] == ROUND_TIMEOUT  # nothing measured yet: the user's timeout
    for r in (2, 3, 4):
        assert deadlines[r] == pytest.approx(max(1.0, 3 * max(seconds[:r - 1])))


@pytest.mark.slow
@pytest.mark.parametrize("what", ["daemon", "executor"])
def test_a_killed_cluster_fails_the_job_in_seconds_naming_it(three_clusters: Any, what: str) -> None:
    tb, clusters = three_clusters
    victim = tb.cluster_ids[1]
    killed: list[float] = []

    def kill_at_round_3(record: RoundRecord, total: int) -> None:
        if record.round == 3:
            kill(tb, victim, what)
            killed.append(time.monotonic())

    job = spec(f"detect-{what}", 200, on_cluster_loss="fail")
    with (job_driver(tb, clusters, job, timeout=ROUND_TIMEOUT, progress=kill_at_round_3) as driver,
          pytest.raises(JobFailed) as failed):
        driver.run()
    message = str(failed.value)
    print(f"failed {time.monotonic() - killed[0]:.1f} s after the kill: {message}")
    assert f"cluster {victim}" in message and "on_cluster_loss = 'fail'" in message, message
    # noticed by the lease / the mesh (a lost cluster, its loss measured from its last
    # answer), not by a round's deadline (a JobFailed naming the deadline; 900 s here)
    assert isinstance(failed.value, ClusterLost) and set(failed.value.lost) == {victim}, message
    assert "deadline" not in message, message
