"""NodeManager on a real Ray cluster: actors really exist, and never more than the cap."""

from __future__ import annotations

import pytest

from fedcore.data import client_data, load_dataset
from proto.job import JobSpec
from worker.nodes import NodeConfig, NodeManager

pytestmark = pytest.mark.slow

SPEC = JobSpec(job_id="nodes-ray")


def manager_for(ctx: object, clients: int, cap: int, prefix: str, recycle: bool) -> NodeManager:
    ds = load_dataset("digits")
    cfg = NodeConfig(SPEC.job_id, SPEC.seed, SPEC.model, SPEC.training, SPEC.aggregation,
                     ds.input_shape, ds.num_classes)
    return NodeManager(ctx, cfg, ds, client_data(ds, SPEC.data, SPEC.seed),  # type: ignore[arg-type]
                       list(range(clients)), max_materialized=cap, cpus_per_node=0.5,
                       recycle=recycle, name_prefix=prefix)


def ray_actors(prefix: str) -> dict[str, str]:
    """name -> state of every actor Ray's GCS knows under `prefix` (alive and dead)."""
    from ray._private import state

    return {a["Name"]: a["State"] for a in state.actors().values()
            if a.get("Name", "").startswith(prefix)}


def alive_named(prefix: str) -> int:
    import ray

    return sum(1 for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith(prefix))


def test_ray_actors_are_created_and_capped_in_kill_mode(ray_context) -> None:  # type: ignore[no-untyped-def]
    ctx, prefix = ray_context, "test-kill"
    manager = manager_for(ctx, 4, 2, prefix, recycle=False)
    peak = 0
    with manager:
        for c in range(4):
            update = ctx.get(manager.call(c, "train", 1), timeout=120)
            assert update.client_id == c
            peak = max(peak, alive_named(prefix))
    assert peak == 2
    assert manager.stats.created == 4 and manager.stats.max_alive == 2
    actors = ray_actors(prefix)
    assert len(actors) == 4  # Ray saw exactly the actors the manager counted
    assert set(actors.values()) == {"DEAD"}
    assert alive_named(prefix) == 0


def test_ray_recycled_actors_serve_all_clients(ray_context) -> None:  # type: ignore[no-untyped-def]
    ctx, prefix = ray_context, "test-recycle"
    manager = manager_for(ctx, 6, 2, prefix, recycle=True)
    with manager:
        pids = set(ctx.get([manager.call(c, "ping") for c in range(6)], timeout=120))
        updates = ctx.get([manager.call(c, "train", 1) for c in range(6)], timeout=120)
        assert [u.client_id for u in updates] == list(range(6))
        assert alive_named(prefix) == 2
    assert len(pids) == 2 and manager.stats.created == 2
    assert manager.stats.materializations == 12 and manager.stats.dematerializations == 10
    assert len(ray_actors(prefix)) == 2
