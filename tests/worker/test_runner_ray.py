"""The digits job on a real Ray cluster: >= 0.80 and the same accuracy as in-process."""

from __future__ import annotations

import pytest

from proto.job import DataSpec, JobSpec, PlacementSpec, TopologySpec, TrainingSpec
from worker.context import InProcessContext
from worker.runner import run_job

pytestmark = pytest.mark.slow


def gcs_actors(prefix: str) -> dict[str, str]:
    from ray._private import state

    return {a["Name"]: a["State"] for a in state.actors().values()
            if a.get("Name", "").startswith(prefix)}


def test_digits_star_fedavg_on_ray_matches_inprocess(ray_context, digits_star_metrics) -> None:  # type: ignore[no-untyped-def]
    # the same job as the in-process fixture (30 clients, dirichlet 0.5, star, fedavg,
    # 30 rounds, 2 local epochs); max_materialized = 8 recycled actors
    spec = JobSpec(job_id="digits-star", seed=0)
    local = [m.accuracy for m in digits_star_metrics]
    job = run_job(spec, ray_context)
    prefix = job.nodes.name_prefix
    on_ray = []
    for metrics in job:
        on_ray.append(metrics.accuracy)
        if metrics.round == 1:
            live = gcs_actors(prefix)
            assert len(live) == 8 and set(live.values()) == {"ALIVE"}
    assert on_ray[-1] >= 0.80
    assert on_ray == local  # bit-identical: same seeds, single-threaded torch everywhere
    assert job.nodes.stats.created == 8 and job.nodes.stats.max_alive == 8
    actors = gcs_actors(prefix)
    assert len(actors) == 8 and set(actors.values()) == {"DEAD"}  # closed after the last round


def test_ring_with_churning_actors_on_ray_matches_inprocess(ray_context) -> None:  # type: ignore[no-untyped-def]
    spec = JobSpec(job_id="ring-ray", data=DataSpec(number_of_clients=4),
                   topology=TopologySpec(kind="ring"),
                   training=TrainingSpec(federated_learning_rounds=2, number_of_epochs=1),
                   placement=PlacementSpec(max_materialized=2, placement_group_strategy="PACK"))
    with InProcessContext(num_cpus=2) as ctx:
        local = [(m.accuracy, m.extra) for m in run_job(spec, ctx)]
    job = run_job(spec, ray_context)
    on_ray = [(m.accuracy, m.extra) for m in job]
    assert on_ray == local  # node states saved and reloaded between train and mix phases
    assert job.nodes.stats.created == 2 and job.nodes.stats.dematerializations >= 8
    assert len(gcs_actors(job.nodes.name_prefix)) == 2
