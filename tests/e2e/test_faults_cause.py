"""Fail fast with the cause: a client that cannot train ends the round at once, and the
job's error says why and what to change (not "did not answer within 900 s")."""

from __future__ import annotations

from typing import Any

import pytest

from fedpilot.loopback import LoopbackMesh
from proto.job import JobSpec
from scheduler.run.driver import Driver, JobFailed
from worker.context import InProcessContext
from worker.executor.failures import explain_failure
from worker.executor.runtime import NodeRuntime


class OutOfMemoryError(RuntimeError):
    """Named like Ray's: the memory monitor's kill of an actor."""


class StarvedRuntime(NodeRuntime):
    """Round 2's training on cluster b fails the way Ray reports an actor killed for memory."""

    def train(self, node: str, model: Any, round_index: int) -> Any:
        if round_index == 2 and self.cluster_id == "b":
            raise OutOfMemoryError("Task was killed due to the node running low on memory.")
        return super().train(node, model, round_index)


def test_an_actor_killed_for_memory_fails_the_round_with_what_to_change() -> None:
    spec = JobSpec.from_dict({
        "job": {"id": "oom", "seed": 1}, "data": {"number_of_clients": 4},
        "training": {"federated_learning_rounds": 3, "number_of_epochs": 1},
        "placement": {"strategy": "round_robin", "max_materialized": 3}})
    mesh = LoopbackMesh(["a", "b"], lambda cid: (lambda s: StarvedRuntime(s, InProcessContext(),
                                                                         cid)), capacity=3)
    rounds: list[int] = []
    # executors' waits are 120 s on the loopback mesh: an answer at all means "at once"
    driver = Driver(spec, mesh.clusters(), mesh, backend="inprocess", timeout=600,
                    progress=lambda record, total: rounds.append(record.round))
    try:
        with pytest.raises(JobFailed) as failed:
            driver.run()
    finally:
        driver.close()
    message = str(failed.value)
    assert rounds == [1]
    assert "cluster b failed round 2: out of memory" in message, message
    assert "max_materialized (now 3)" in message and "object_store_memory" in message
    assert "Task was killed due to the node running low on memory" in message


def test_other_failures_keep_their_own_text() -> None:
    text = explain_failure(ValueError("bad tensor"), "x", 4, None)
    assert text == "cluster x failed round 4: ValueError: bad tensor"
    long = explain_failure(OutOfMemoryError("x" * 5000), "x", 1, None)
    assert len(long) == 1000 and long.startswith("cluster x failed round 1: out of memory")
