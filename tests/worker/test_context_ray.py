"""RayContext against a real local Ray cluster (2 CPUs, session fixture)."""

from __future__ import annotations

import time

import pytest

from worker.context import PlacementError

pytestmark = pytest.mark.slow


class Counter:
    def __init__(self, start: int) -> None:
        self.value = start

    def add(self, amount: int) -> int:
        self.value += amount
        return self.value

    def pid(self) -> int:
        import os

        return os.getpid()


def test_ray_actors_and_refs(ray_context) -> None:  # type: ignore[no-untyped-def]
    ctx = ray_context
    counter = ctx.actor(Counter, ctx.put(10), name="counter", num_cpus=0.1)
    assert ctx.get([counter.add(1) for _ in range(5)]) == [11, 12, 13, 14, 15]
    ready, pending = ctx.wait([counter.add(0)], num_returns=1, timeout=30)
    assert len(ready) == 1 and pending == []
    import os

    assert ctx.get(counter.pid()) != os.getpid()  # a real worker process
    ctx.kill(counter)
    import ray

    # ray.kill is asynchronous: a call sent right after it may still be served, but the
    # actor must be gone (every call failing) within a few seconds
    with pytest.raises(ray.exceptions.RayActorError):
        for _ in range(100):
            ctx.get(counter.add(1), timeout=30)
            time.sleep(0.1)


def test_ray_placement_group_fails_at_once_with_what_exists(ray_context) -> None:  # type: ignore[no-untyped-def]
    ctx = ray_context
    with pytest.raises(PlacementError) as err:
        ctx.reserve([{"CPU": 1.0}] * 4, "SPREAD")
    text = str(err.value)
    assert "4 bundle(s) x {'CPU': 1.0} (SPREAD), total {CPU: 4}" in text
    assert "1 node(s), total {CPU: 2}" in text and "short of {CPU: 4}" in text
    with pytest.raises(PlacementError, match="STRICT_SPREAD needs 2 nodes"):
        ctx.reserve([{"CPU": 0.5}] * 2, "STRICT_SPREAD")
    reservation = ctx.reserve([{"CPU": 0.5}] * 2, "PACK")
    try:
        placed = ctx.actor(Counter, 1, name="placed", placement=reservation.bundle(1))
        assert ctx.get(placed.add(1), timeout=60) == 2
        ctx.kill(placed)
    finally:
        ctx.release(reservation)


def test_ray_placement_group_held_by_another_job_fails_after_a_short_wait(ray_context) -> None:  # type: ignore[no-untyped-def]
    from worker.context import RayContext

    hog = ray_context.reserve([{"CPU": 1.5}], "PACK")
    try:
        impatient = RayContext(placement_timeout=1.0)
        with pytest.raises(PlacementError) as err:
            impatient.reserve([{"CPU": 1.0}], "PACK")
        assert "not granted within 1s" in str(err.value)
        assert "total {CPU: 2}" in str(err.value)
    finally:
        ray_context.release(hog)
