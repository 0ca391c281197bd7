"""InProcessContext: actors, references, placement (the Ray twin is test_context_ray)."""

from __future__ import annotations

import threading

import pytest

from worker.context import ActorDiedError, InProcessContext, PlacementError


class Counter:
    def __init__(self, start: int) -> None:
        self.value = start
        self.threads: set[str] = set()

    def add(self, amount: int) -> int:
        self.threads.add(threading.current_thread().name)
        self.value += amount
        return self.value

    def seen_threads(self) -> int:
        return len(self.threads)

    def block(self, gate: threading.Event) -> bool:
        return gate.wait(10)

    def fail(self) -> None:
        raise ValueError("actor method failed")


def test_put_get_and_ref_arguments_are_resolved(inprocess_context: InProcessContext) -> None:
    ctx = inprocess_context
    counter = ctx.actor(Counter, ctx.put(7))
    assert ctx.get(counter.add(ctx.put(3))) == 10
    assert ctx.get([ctx.put(i) for i in range(4)]) == [0, 1, 2, 3]


def test_actor_calls_run_in_order_on_one_thread(inprocess_context: InProcessContext) -> None:
    ctx = inprocess_context
    counter = ctx.actor(Counter, ctx.put(10), name="counter")
    refs = [counter.add(1) for _ in range(50)]
    assert ctx.get(refs) == list(range(11, 61))
    assert ctx.get(counter.seen_threads()) == 1
    with pytest.raises(ValueError, match="actor method failed"):
        ctx.get(counter.fail())


def test_wait_returns_ready_and_pending(inprocess_context: InProcessContext) -> None:
    ctx = inprocess_context
    gate = threading.Event()
    slow = ctx.actor(Counter, 0).block(gate)
    fast = ctx.put(1)
    ready, pending = ctx.wait([slow, fast], num_returns=1, timeout=5)
    assert ready == [fast] and pending == [slow]
    ready, pending = ctx.wait([slow], num_returns=1, timeout=0.05)
    assert ready == [] and pending == [slow]
    gate.set()
    ready, _ = ctx.wait([slow, fast], num_returns=2, timeout=5)
    assert set(ready) == {slow, fast}


def test_kill_stops_actor(inprocess_context: InProcessContext) -> None:
    ctx = inprocess_context
    counter = ctx.actor(Counter, 0, name="c")
    assert ctx.get(counter.add(1)) == 1
    assert ctx.alive_actors() == 1
    ctx.kill(counter)
    assert ctx.alive_actors() == 0
    with pytest.raises(ActorDiedError, match="'c' was killed"):
        counter.add(1)


def test_failed_constructor_reports_actor_died(inprocess_context: InProcessContext) -> None:
    ctx = inprocess_context
    broken = ctx.actor(Counter, name="broken")  # missing argument
    with pytest.raises(ActorDiedError, match="'broken' failed to start"):
        ctx.get(broken.add(1))


def test_reserve_accounts_cpus_and_fails_with_what_was_asked() -> None:
    with InProcessContext(num_cpus=2) as ctx:
        first = ctx.reserve([{"CPU": 0.5}] * 2, "SPREAD")
        assert ctx.resources()["available"]["CPU"] == pytest.approx(1.0)
        with pytest.raises(PlacementError) as err:
            ctx.reserve([{"CPU": 0.5}] * 3, "PACK")
        text = str(err.value)
        assert "3 bundle(s) x {'CPU': 0.5} (PACK)" in text
        assert "total {CPU: 2}" in text and "available {CPU: 1}" in text
        ctx.release(first)
        second = ctx.reserve([{"CPU": 0.5}] * 3, "PACK")
        actor = ctx.actor(Counter, 0, name="placed", placement=second.bundle(2))
        assert ctx.get(actor.add(2)) == 2
        with pytest.raises(PlacementError, match="unknown placement strategy 'SPRED'"):
            ctx.reserve([{"CPU": 0.1}], "SPRED")
        with pytest.raises(PlacementError, match="GPU"):
            ctx.reserve([{"GPU": 1}], "PACK")
