"""The one round engine on a real Ray cluster: the same trainings and model bytes as
in-process (3 clusters, client_fraction, decentralized mixing)."""

from __future__ import annotations

from typing import Any

import pytest
from safetensors.numpy import load as st_load

from tests.e2e.test_one_engine import job, run, tensor_bytes


@pytest.mark.slow
def test_one_engine_on_ray_matches_inprocess(ray_context: Any) -> None:
    spec = job("ring", clients=6, rounds=2, training={"client_fraction": 0.5})
    local, counted_local = run(spec)
    on_ray, counted_ray = run(spec, context_for=lambda cid: ray_context)
    assert counted_ray.trained == counted_local.trained
    assert tensor_bytes(on_ray.model) == tensor_bytes(local.model)  # bit-identical: single-threaded torch everywhere
    assert [r.accuracy for r in on_ray.summary.rounds] == [
        r.accuracy for r in local.summary.rounds]
    weights = st_load(on_ray.model)
    assert weights and all(v.dtype.kind == "f" for v in weights.values())


@pytest.mark.slow
def test_a_decentralized_stall_on_ray_restores_as_in_process(ray_context: Any) -> None:
    """k_connected FedAvg whose clients diverge (learning rate 30): each node's aggregator
    keeps its best and first models by reference, on Ray views of the object store's, and
    goes back to them; the job stalls in the same rounds and ends with the same model
    bytes as in-process."""
    spec = job("k_connected", clients=6, rounds=3, aggregation={"name": "fedavg"},
               training={"learning_rate": 30.0, "learning_rate_check": "off"})
    local, _ = run(spec)
    on_ray, _ = run(spec, context_for=lambda cid: ray_context)
    stalls = [r.stalls for r in local.summary.rounds]
    assert sum(stalls) >= 1, stalls
    assert [r.stalls for r in on_ray.summary.rounds] == stalls
    assert tensor_bytes(on_ray.model) == tensor_bytes(local.model)
