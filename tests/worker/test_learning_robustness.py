"""Models and settings no default was tuned on still learn: a CNN with BatchNorm and
dropout through the engine, server optimizers on a CNN of small weights, and a stalled
job that acts. The user models are bench/usercnn.py's, by `module:Class`."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load as st_load

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from fedcore.data import client_data, load_dataset  # noqa: E402
from proto.job import AggregationSpec, JobSpec, JobSpecError  # noqa: E402
from tests.e2e.test_one_engine import job, run, tensor_bytes  # noqa: E402
from worker.aggregators import get_aggregator  # noqa: E402

CHANCE = 0.1
SERVER_OPTIMIZERS = ("fedadam", "fedyogi", "fedadagrad", "fedavgm")


def bn_job(aggregation: str) -> JobSpec:
    """BNCNN on digits, 9 clients, 3 rounds x 2 epochs, with a batch size that leaves one
    client a last batch of a single sample (BatchNorm cannot train on it)."""
    def spec(batch_size: int) -> JobSpec:
        return job("star", clients=9, rounds=3, model={"name": "usercnn:BNCNN"},
                   training={"number_of_epochs": 2, "batch_size": batch_size},
                   aggregation={"name": aggregation})

    base = spec(16)
    sizes = [len(p) for p in client_data(load_dataset("digits"), base.data,
                                         base.seed).train_indices]
    batch = next(b for b in range(8, 64) if any(n % b == 1 for n in sizes))
    return spec(batch)


@pytest.mark.parametrize("aggregation", ["fedavg", "fedadam"])
def test_a_batchnorm_dropout_cnn_learns_through_the_engine(aggregation: str) -> None:
    """Before: the round failed (BatchNorm raised on the batch of one), and a server
    optimizer stepped the running variances like weights. Now the buffers are pooled, never
    stepped, evaluated in eval mode, and the job leaves chance within 3 rounds."""
    result, _ = run(bn_job(aggregation))
    curve = [r.accuracy for r in result.summary.rounds]
    assert len(curve) == 3 and curve[-1] > CHANCE + 0.3, curve
    assert all(r.personalized_accuracy > CHANCE + 0.3 for r in result.summary.rounds[1:])


@pytest.mark.slow
def test_a_batchnorm_dropout_cnn_learns_on_ray(ray_context: Any) -> None:
    """The same job with its FederatedNode actors on Ray (its own processes: the model
    module from the user's PYTHONPATH) leaves chance within 3 rounds too, and ends with
    the in-process job's model bit for bit: dropout's masks follow (seed, step), not which
    process or thread trained the client before (they differed from round 1 when they
    came from each process's global generator as it happened to be)."""
    on_ray, _ = run(bn_job("fedavg"), context_for=lambda cid: ray_context)
    curve = [r.accuracy for r in on_ray.summary.rounds]
    assert len(curve) == 3 and curve[-1] > CHANCE + 0.3, curve
    in_process, _ = run(bn_job("fedavg"))
    assert [r.accuracy for r in in_process.summary.rounds] == curve
    assert tensor_bytes(in_process.model) == tensor_bytes(on_ray.model)


def test_local_batchnorm_trains_each_client_with_its_own_batchnorm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """aggregation.local_batchnorm (FedBN): from its second round on, a client trains from
    the round's model with its own BatchNorm tensors as it left them (weights and running
    statistics), everything else the round's; without the key no client gets any. The
    job still learns, and the global model carries the pooled BatchNorm tensors."""
    from worker.models import batchnorm_tensors, build_model
    from worker.nodes.federated import FederatedNode

    calls: list[tuple[int, int, dict[str, np.ndarray] | None, dict[str, np.ndarray]]] = []
    real = FederatedNode.train

    def recorded(self: FederatedNode, round_index: int, *incoming: Any) -> Any:
        update = real(self, round_index, *incoming)
        own = dict(incoming[1]) if len(incoming) == 2 else None
        calls.append((int(update.client_id), round_index, own, dict(update.weights)))
        return update

    monkeypatch.setattr(FederatedNode, "train", recorded)
    spec = job("star", clients=6, rounds=3, model={"name": "usercnn:BNCNN"},
               aggregation={"name": "fedavg", "local_batchnorm": True})
    result, _ = run(spec)
    names = batchnorm_tensors(build_model(spec.model, (8, 8), 10, seed=0))
    assert names and all(n.rpartition(".")[2] in ("weight", "bias", "running_mean",
                                                  "running_var", "num_batches_tracked")
                         for n in names)
    last: dict[int, dict[str, np.ndarray]] = {}
    for client, r, own, trained in sorted(calls, key=lambda c: (c[1], c[0])):
        if client in last:
            assert own is not None and set(own) == names, (client, r)
            assert all(np.array_equal(own[n], last[client][n]) for n in names), (client, r)
        else:
            assert own is None, (client, r)
        last[client] = trained
    assert {r for _, r, own, _ in calls if own is not None} == {2, 3}
    assert result.summary.rounds[-1].accuracy > CHANCE + 0.3
    calls.clear()
    run(job("star", clients=6, rounds=2, model={"name": "usercnn:BNCNN"},
            aggregation={"name": "fedavg"}))
    assert calls and all(own is None for _, _, own, _ in calls)


@pytest.mark.parametrize("topology", ["star", "hierarchical", "k_connected"])
def test_measured_batchnorm_statistics_are_served_never_trained_from(
        monkeypatch: pytest.MonkeyPatch, topology: str) -> None:
    """aggregation.norm_statistics = "measured" changes the model only as it is served:
    evaluated each round and delivered at the end, with BatchNorm running statistics of its
    own on its cluster's samples; the clients train from the pooled ones, as under
    "pooled". So every client's every round trains bit for bit the same under both, and
    the final models differ in those statistics alone. Before, the measured statistics
    went down to the clients too, which made the trained models depend on the cluster that
    measured them (where the root sits; in k_connected every cluster's own few samples)."""
    from worker.nodes.federated import FederatedNode

    trained: list[tuple[int, int, bytes]] = []
    real = FederatedNode.train

    def recorded(self: FederatedNode, round_index: int, *incoming: Any) -> Any:
        update = real(self, round_index, *incoming)
        trained.append((round_index, int(update.client_id),
                        b"".join(np.ascontiguousarray(update.weights[k]).tobytes()
                                 for k in sorted(update.weights))))
        return update

    monkeypatch.setattr(FederatedNode, "train", recorded)

    def final(how: str) -> tuple[dict[str, np.ndarray], list[float], list[Any]]:
        trained.clear()
        result, _ = run(job(topology, clients=6, rounds=3, model={"name": "usercnn:BNCNN"},
                            aggregation={"name": "fedavg", "norm_statistics": how}))
        return (dict(st_load(result.model)), [r.accuracy for r in result.summary.rounds],
                sorted(trained))

    (measured, curve_m, trained_m), (pooled, curve_p, trained_p) = final("measured"), final("pooled")
    assert len(trained_m) >= 3 * 6 and trained_m == trained_p
    statistics = {k for k in measured if k.endswith(("running_mean", "running_var"))}
    assert statistics and set(measured) == set(pooled)
    assert all(np.array_equal(measured[k], pooled[k]) for k in measured if k not in statistics)
    assert all(not np.allclose(measured[k], pooled[k]) for k in statistics)
    assert all(np.all(measured[k] > 0) for k in statistics if k.endswith("running_var"))
    assert curve_m != curve_p  # each round's model was evaluated as served


@pytest.mark.parametrize("aggregation", ["fedavg", "fedadam"])
def test_auto_serves_measured_statistics_only_where_the_pooled_ones_are_off(
        aggregation: str) -> None:
    """norm_statistics = "auto": a model whose running statistics are far from its
    activations on the cluster's samples (variances / 1e4: the untrained model's outputs
    blow up) is served with measured ones, and the same model with those measured
    statistics already in it as it is; under a server optimizer too (since stop 57: the
    measurement follows the federation's label mix)."""
    from worker.context import InProcessContext
    from worker.executor.runtime import NodeRuntime
    from worker.models import build_model
    from worker.serialization import model_weights

    spec = job("star", clients=6, rounds=1, model={"name": "usercnn:BNCNN"},
               aggregation={"name": aggregation, "norm_statistics": "auto"})
    runtime = NodeRuntime(spec, InProcessContext(), "a")
    runtime._local = [0, 1, 2]  # noqa: SLF001 - the cluster's clients, without actors
    weights = model_weights(build_model(spec.model, (8, 8), 10, seed=0))
    off = {k: v / 1e4 if k.endswith("running_var") else v for k, v in weights.items()}
    served = runtime.calibrate(off)
    variances = [k for k in off if k.endswith("running_var")]
    assert variances and all(np.all(served[k] > off[k] * 10) for k in variances)
    assert all(np.array_equal(served[k], off[k]) for k in off
               if not k.endswith(("running_mean", "running_var")))
    again = runtime.calibrate(served)
    assert all(np.array_equal(again[k], served[k]) for k in served)


def test_a_keras_port_whose_running_averages_lag_learns_on_measured_statistics() -> None:
    """usercnn:KerasBNCNN keeps 0.99 of its BatchNorm running averages a step (Keras's
    default; torch's is 0.9): after a round of local steps the clients' averages, and so
    their pooled mean, still describe the initial model. Served as they are ("pooled"),
    round 1's model scores 0.29 (measured); under the default "auto" the job serves
    statistics measured for the model it serves: 0.81, and every round above 0.6."""
    def curve(how: str) -> list[float]:
        result, _ = run(job("star", clients=6, rounds=3, model={"name": "usercnn:KerasBNCNN"},
                            aggregation={"name": "fedavg", "norm_statistics": how}))
        return [r.accuracy for r in result.summary.rounds]

    auto, pooled = curve("auto"), curve("pooled")
    assert all(a > CHANCE + 0.5 for a in auto), auto
    assert pooled[0] < auto[0] - 0.3, (pooled, auto)


def _pooled(weights: list[dict[str, np.ndarray]], shares: list[float], name: str,
            samples: list[int]) -> np.ndarray:
    """The clients' mean variance plus the spread of their means, less what a mean of n
    samples scatters by chance (var / n): an unbiased between-clients variance"""
    mean = sum(s * w[f"{name}.running_mean"] for w, s in zip(weights, shares, strict=True))
    within = sum(s * w[f"{name}.running_var"] for w, s in zip(weights, shares, strict=True))
    between = sum(s * ((w[f"{name}.running_mean"] - mean) ** 2 - w[f"{name}.running_var"] / n)
                  for w, s, n in zip(weights, shares, samples, strict=True))
    return within + np.maximum(between, 0.0)


@pytest.mark.parametrize("name", ["fedavg", *SERVER_OPTIMIZERS])
def test_batchnorm_statistics_are_pooled_never_stepped(name: str) -> None:
    """Two clients of 4 samples whose activations have means 0 and 4, variance 1: the
    population's variance is 1 + 4 - 1/4 (a 4-sample mean scatters by 1/4 by chance), not
    the mean of the variances (1); a server optimizer takes the same
    statistics (stepping them can make a variance negative: NaN at evaluation), and with
    such statistics in the model it moves no weight further than NORM_STEP_RATIO x FedAvg
    would (the statistics describe models around the clients' mean)."""
    from worker.aggregators.base import NORM_STEP_RATIO

    g = {"bn.weight": np.ones(2, np.float32), "bn.running_mean": np.zeros(2, np.float32),
         "bn.running_var": np.ones(2, np.float32), "bn.num_batches_tracked": np.array(5)}
    a = dict(g, **{"bn.weight": np.full(2, 1.5, np.float32)})
    b = dict(g, **{"bn.running_mean": np.full(2, 4.0, np.float32)})
    agg = get_aggregator(replace(AggregationSpec(), name=name), buffers=["bn.running_mean",
                                                                         "bn.running_var",
                                                                         "bn.num_batches_tracked"])
    for _ in range(3):   # several rounds: momentum would carry a step on a statistic on
        out = agg.aggregate(g, [(a, 4), (b, 4)])
        np.testing.assert_allclose(out["bn.running_mean"], [2.0, 2.0])
        np.testing.assert_allclose(out["bn.running_var"], _pooled([a, b], [0.5, 0.5], "bn", [4, 4]))
        np.testing.assert_allclose(out["bn.running_var"], [4.75, 4.75])
        assert out["bn.num_batches_tracked"].dtype == g["bn.num_batches_tracked"].dtype
        fedavg = np.linalg.norm([0.25, 0.25])   # the clients' mean moved bn.weight by 0.25
        assert np.linalg.norm(out["bn.weight"] - 1.0) <= NORM_STEP_RATIO * fedavg + 1e-6
    # two 2-sample clients of one population: means each 0.5 from theirs are chance (a
    # 2-sample mean scatters by var / 2 = 0.5), so the pooled variance is the clients' own
    # (the spread added, as before: 1.25)
    near = dict(g, **{"bn.running_mean": np.full(2, 1.0, np.float32)})
    out = get_aggregator(replace(AggregationSpec(), name=name)).aggregate(g, [(g, 2), (near, 2)])
    np.testing.assert_allclose(out["bn.running_var"], [1.0, 1.0])


def _cnn_round(seed: int) -> tuple[dict[str, np.ndarray], list[tuple[dict[str, np.ndarray], int]]]:
    """A CNN of small weights (5x5 kernels, 128 hidden units: fan-ins of 800 and 1,024)
    and two clients' updates after a real local epoch each on digits."""
    import torch
    from usercnn import WideCNN

    from proto.job import TrainingSpec
    from worker.serialization import load_weights, model_weights
    from worker.training import train_local

    torch.manual_seed(seed)
    data = load_dataset("digits")
    net = WideCNN(data.input_shape, data.num_classes)
    start = model_weights(net)
    updates = []
    for client in range(2):
        load_weights(net, start)
        idx = np.arange(client * 100, client * 100 + 100)
        train_local(net, data.x_train[idx], data.y_train[idx], TrainingSpec(), seed=client)
        updates.append((model_weights(net), 100))
    return start, updates


@pytest.mark.parametrize("name", SERVER_OPTIMIZERS)
def test_no_server_step_moves_a_small_cnn_further_than_twice_fedavgs(name: str) -> None:
    """At its defaults every server optimizer moves each tensor at most max_step_ratio (2)
    x FedAvg's own step, round after round. The literature's plain step (the former
    default) moves a small-weight CNN's tensors many times further than FedAvg would, by
    more than the weights' own size: what held such a CNN at chance for 15 rounds."""
    fedavg = get_aggregator(replace(AggregationSpec(), name="fedavg"))
    scaled = get_aggregator(replace(AggregationSpec(), name=name))
    plain = get_aggregator(replace(AggregationSpec(), name=name, server_step="plain"))
    weights = plain_weights = None
    plain_ratio = 0.0
    for seed in range(3):
        start, updates = _cnn_round(seed)
        weights = weights or start
        plain_weights = plain_weights or start
        shifted = [({k: v - start[k] + weights[k] for k, v in w.items()}, n) for w, n in updates]
        target = fedavg.aggregate(weights, shifted)
        out = scaled.aggregate(weights, shifted)
        for key, value in out.items():
            fed = float(np.linalg.norm(target[key] - weights[key]))
            assert float(np.linalg.norm(value - weights[key])) <= 2.0 * fed * (1 + 1e-5) + 1e-12, key
        shifted_plain = [({k: v - start[k] + plain_weights[k] for k, v in w.items()}, n)
                         for w, n in updates]
        plain_out = plain.aggregate(plain_weights, shifted_plain)
        plain_target = fedavg.aggregate(plain_weights, shifted_plain)
        key = "net.7.weight"   # the 3,136 x 128 dense layer: weights ~0.01
        plain_ratio = max(plain_ratio, float(
            np.linalg.norm(plain_out[key] - plain_weights[key])
            / np.linalg.norm(plain_target[key] - plain_weights[key])))
        weights, plain_weights = out, plain_out
    if name != "fedavgm":   # fedavgm's plain step is 1 + 0.9 + 0.81 x FedAvg's after 3 rounds
        assert plain_ratio > 5.0, plain_ratio   # (fedadagrad 9.5 at 8 batches an epoch)


def test_a_stalled_job_takes_its_on_stall_action() -> None:
    """A server step far too large (the plain step at server_learning_rate 3) wrecks the
    model: the aggregator goes back to the best model (or the first), halves its step and
    says so in the round's record (summary.json's rounds[].stalls); with on_stall = warn
    the same job does nothing of the kind."""
    def stalls(action: str) -> list[int]:
        spec = job("star", clients=9, rounds=5, aggregation={
            "name": "fedadam", "server_step": "plain", "server_learning_rate": 3.0,
            "on_stall": action})
        result, _ = run(spec)
        return [r.stalls for r in result.summary.rounds]

    acted = stalls("restore")
    assert sum(acted) >= 1, acted
    assert stalls("warn") == [0] * 5


@pytest.mark.parametrize("topology", ["star", "k_connected"])
def test_a_fedavg_job_whose_clients_diverge_goes_back_and_halves_its_move(topology: str) -> None:
    """FedAvg has a step too: its move to the clients' mean. Clients at learning rate 30
    (the check off) send models whose mean has diverged (loss 10-28 with on_stall = warn,
    a uniform guess's is 2.3); with the default the job goes back to where it started,
    moves half as far each time it stalls (a quarter, ...), and no round's model is
    diverged. Before, a FedAvg-family job never acted (there was 'no step to halve'),
    and a decentralized one not even then: each node now goes back to its best model (or
    its first) and halves its move to its neighbourhood's mean."""
    import math

    from worker.aggregators.base import DIVERGED_LOSS

    def rounds(action: str) -> list[Any]:
        spec = job(topology, clients=9, rounds=4, aggregation={"name": "fedavg",
                                                               "on_stall": action},
                   training={"learning_rate": 30.0, "learning_rate_check": "off"})
        result, _ = run(spec)
        return result.summary.rounds

    diverged = DIVERGED_LOSS * math.log(10)
    warned = rounds("warn")
    assert [r.stalls for r in warned] == [0] * 4
    assert max(r.loss for r in warned) > diverged, [r.loss for r in warned]
    acted = rounds("restore")
    assert sum(r.stalls for r in acted) >= 1, [r.stalls for r in acted]
    assert all(r.loss < diverged for r in acted), [r.loss for r in acted]


def test_a_client_refuses_own_tensors_the_model_lacks_and_keeps_its_model() -> None:
    """FederatedNode.train takes the round's model and at most the client's own tensors;
    own tensors the model does not have, or a third argument, are refused naming them, and
    the node's resident model is as it was."""
    from proto.job import ModelSpec, TrainingSpec
    from worker.nodes import NodeConfig
    from worker.nodes.federated import FederatedNode

    data = load_dataset("digits")
    parts = client_data(data, job("star", clients=3).data, 0)
    config = NodeConfig(job_id="j", seed=0, model=ModelSpec(name="usercnn:BNCNN"),
                        training=TrainingSpec(), aggregation=AggregationSpec(),
                        input_shape=tuple(data.input_shape), num_classes=data.num_classes)
    node = FederatedNode(config, data)
    node.load(0, parts.train_indices[0], parts.test_indices[0], None)
    before = node.weights().weights
    model = dict(before)
    with pytest.raises(ValueError, match=r"own tensors \['nope'\] are not in the model"):
        node.train(1, model, {"nope": np.zeros(1, np.float32)})
    with pytest.raises(ValueError, match="got 3 arguments"):
        node.train(1, model, {}, {})
    after = node.weights().weights
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_k_connected_at_its_defaults_learns_stars_model_within_its_traffic_budget() -> None:
    """A node's model crosses to each neighbouring cluster once, and the budget (3 x star's
    transfers) buys every edge that then costs nothing: on 3 clusters every node averages
    the whole federation each round, so the rounds score as star's do (before: each node
    mixed with its few neighbours, digits BNMLP beta 0.1 ended 0.07 below star)."""
    sections: dict[str, Any] = {"aggregation": {"name": "fedavg"},
                                "data": {"number_of_clients": 9, "dirichlet_beta": 0.1}}
    star, _ = run(job("star", **sections))
    graph, _ = run(job("k_connected", **sections, topology={
        "client_k_neighbors": 0, "k_connected_mode": "complementary", "mixing_steps": 0}))
    assert graph.placement["routing"]["mixing_steps"] == 1
    assert [r.accuracy for r in graph.summary.rounds] == pytest.approx(
        [r.accuracy for r in star.summary.rounds], abs=0.01)
    assert 0 < graph.summary.bytes_inter_total <= 3 * star.summary.bytes_inter_total


@pytest.mark.parametrize("aggregation", ["fedavg", "fedavgm"])
def test_k_connected_nodes_that_average_the_same_models_share_the_work(
        aggregation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On 3 clusters k_connected's budget joins every pair of nodes, so all 9 nodes
    average the same 9 models each round and end it with the same model. Each cluster
    computes that mean once and evaluates that model once (before: 9 of each a round),
    and the job learns exactly what it learns with every node doing its own work."""
    from worker.aggregators import base
    from worker.executor.engine import ClusterEngine
    from worker.executor.runtime import NodeRuntime

    counts = {"means": 0, "evaluations": 0}
    lock = threading.Lock()  # the engine's node threads count at once
    pooled, evaluate = base.pooled_mean, NodeRuntime.evaluate_global

    def counted_mean(*a: Any) -> Any:
        with lock:
            counts["means"] += 1
        return pooled(*a)

    def counted_evaluation(self: NodeRuntime, weights: Any) -> Any:
        with lock:
            counts["evaluations"] += 1
        return evaluate(self, weights)

    monkeypatch.setattr(base, "pooled_mean", counted_mean)
    monkeypatch.setattr(NodeRuntime, "evaluate_global", counted_evaluation)
    spec = job("k_connected", clients=9, rounds=3, aggregation={"name": aggregation},
               data={"number_of_clients": 9, "dirichlet_beta": 0.1},
               topology={"client_k_neighbors": 0, "k_connected_mode": "complementary",
                         "mixing_steps": 0})
    results = {}
    for share in (True, False):
        monkeypatch.setattr(ClusterEngine, "share_work", share)
        counts.update(means=0, evaluations=0)
        result, _ = run(spec)
        results[share] = result, dict(counts)
    (shared, work), (alone, own) = results[True], results[False]
    assert shared.placement["routing"]["mixing_steps"] == 1
    # (the rest: the final model's, once either way)
    assert own["means"] - work["means"] == (9 - 3) * 3
    assert own["evaluations"] - work["evaluations"] == (9 - 3) * 3
    assert [r.accuracy for r in shared.summary.rounds] == pytest.approx(
        [r.accuracy for r in alone.summary.rounds], abs=1e-9)
    a, b = st_load(shared.model), st_load(alone.model)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6)


def test_an_executor_runs_numpy_on_one_blas_thread() -> None:
    """The engine's node threads each aggregate; with OpenBLAS's pool of a thread per core
    they contend for it (k_connected + fedavgm: 225 s against 10.7 s, bench_mixing). In a
    fresh process without the test suite's OPENBLAS_NUM_THREADS=1."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    code = ("from threadpoolctl import threadpool_info\n"
            "import numpy\n"
            "before = max(i['num_threads'] for i in threadpool_info() if i['user_api'] == 'blas')\n"
            "from worker.executor.runtime import single_threaded_numerics\n"
            "single_threaded_numerics()\n"
            "after = max(i['num_threads'] for i in threadpool_info() if i['user_api'] == 'blas')\n"
            "print(before, after)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[2])
    before, after = (int(x) for x in out.stdout.split())
    assert after == 1
    assert before > 1 or os.cpu_count() == 1  # it had a pool to cut (OpenBLAS: one a core)


def test_batchnorm_statistics_are_measured_on_the_federations_label_mix_shuffled() -> None:
    """A cluster whose clients hold a skewed label mix measures served statistics on its
    own samples drawn to the federation's mix (each label it holds, at the pooled share),
    in a shuffled order, so no batch of the measurement holds one class only."""
    from worker.context import InProcessContext
    from worker.executor.runtime import NodeRuntime

    spec = job("star", clients=6, rounds=1, model={"name": "usercnn:BNCNN"},
               data={"number_of_clients": 6, "dirichlet_beta": 0.1})
    runtime = NodeRuntime(spec, InProcessContext(), "a")
    runtime._local = [0, 1]  # noqa: SLF001 - the cluster's clients, without actors
    idx = runtime._calibration_indices()  # noqa: SLF001
    y = np.asarray(runtime.dataset.y_train)
    own = np.concatenate([runtime.partition.train_indices[c] for c in (0, 1)])
    held = np.unique(y[own])
    pooled = np.asarray(runtime._config.pooled_labels, dtype=float)[held]  # noqa: SLF001
    want = pooled / pooled.sum()
    got = np.array([(y[idx] == label).sum() for label in held]) / len(idx)
    mine = np.array([(y[own] == label).sum() for label in held]) / len(own)
    assert np.abs(got - want).max() < 0.01 < np.abs(mine - want).max()
    assert set(idx) <= set(own)
    first = y[idx[:256]]
    assert len(np.unique(first)) == len(held) and not np.all(np.diff(idx) >= 0)
    again = NodeRuntime(spec, InProcessContext(), "a")
    again._local = [0, 1]  # noqa: SLF001
    assert np.array_equal(again._calibration_indices(), idx)  # noqa: SLF001 - a fixed draw


def _user_models() -> list[str]:
    import inspect

    import usercnn
    from torch import nn
    return [f"usercnn:{name}" for name, cls in inspect.getmembers(usercnn, inspect.isclass)
            if issubclass(cls, nn.Module) and cls.__module__ == "usercnn"
            and not name.startswith("_")]


@pytest.mark.parametrize("name", _user_models())
def test_every_probe_model_builds_by_name_for_images_and_tables(name: str) -> None:
    """The grid's user models (bench/usercnn.py) build by `module:Class` for an image and a
    table, identically from one seed, and give one score per class in both modes."""
    import torch

    from proto.job import ModelSpec
    from worker.models.registry import build_model

    one = build_model(ModelSpec(name=name), (1, 8, 8), 10, seed=3)
    for shape, classes in (((1, 8, 8), 10), ((30,), 2)):
        if len(shape) == 1 and any(isinstance(m, torch.nn.Conv2d) for m in one.modules()):
            continue   # 2-D convolutions (the image model just built): images only
        one, two = (build_model(ModelSpec(name=name), shape, classes, seed=3) for _ in range(2))
        assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(),
                                                     two.state_dict().values(), strict=True))
        x = torch.randn(4, *shape)
        for train in (True, False):
            one.train(train)
            assert one(x).shape == (4, classes)


@pytest.fixture(scope="module")
def mnist_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    import bench_learning as bl

    return bl.mnist_npz(tmp_path_factory.mktemp("mnist"), 100, 30)


def test_a_learning_rate_that_kills_the_model_is_halved_before_the_job_starts(
        mnist_file: str) -> None:
    """The tutorials' BatchNorm CNN at sgd 0.05 with momentum 0.9 (the defaults): its units
    die in the first steps, centralized too, and every round of every job sat at 0.100,
    loss ln 10. The trial halves the rate until the model learns and its half gains no
    more; a model the job's rate trains keeps it after one trial run."""
    import torch

    from fedcore.data.datasets import load_dataset as load
    from proto.job import TrainingSpec
    from worker.models import build_model
    from worker.training import TRIAL_LEARNED, learning_rate_trial

    data = load(mnist_file)

    def trial(name: str) -> Any:
        spec = job("star", model={"name": name}).model
        return learning_rate_trial(lambda: build_model(spec, data.input_shape, 10, seed=0),
                                   data.x_train, data.y_train, TrainingSpec(), 10, seed=0)

    torch.set_num_threads(1)
    tutorial = trial("usercnn:TutorialCNN")
    (first, dead), *halves = tutorial.losses
    assert first == 0.05 and dead > TRIAL_LEARNED * tutorial.uniform_loss, tutorial
    assert tutorial.lowered and tutorial.learning_rate < 0.05
    kept = dict(tutorial.losses)[tutorial.learning_rate]
    assert kept < TRIAL_LEARNED * tutorial.uniform_loss and kept < dead / 2, tutorial
    assert all(rate == 0.05 / 2 ** (i + 1) for i, (rate, _) in enumerate(halves))
    small = trial("usercnn:SmallCNN")
    assert small.learning_rate == 0.05 and len(small.losses) == 1 and not small.lowered


def test_a_model_on_a_plateau_keeps_the_jobs_rate() -> None:
    """A user's CNN initialized 100 x smaller than torch's default sits on a plateau: every
    rate's trial run ends a hair below a uniform guess's (0.05: 2.299, 0.025: 2.298 on
    digits), and the trial took the half for that hair, at which every job and the
    reference loop sat at 0.100 for 15 rounds (at 0.05: 0.577, fedadam 0.813)."""
    import torch

    from fedcore.data.datasets import load_dataset as load
    from proto.job import TrainingSpec
    from worker.models import build_model
    from worker.training import TRIAL_MIN_GAIN, learning_rate_trial

    data = load("digits")
    spec = job("star", model={"name": "usercnn:SmallInitCNN"}).model
    torch.set_num_threads(1)
    found = learning_rate_trial(lambda: build_model(spec, data.input_shape, 10, seed=0),
                                data.x_train, data.y_train, TrainingSpec(), 10, seed=0)
    (first, loss), (half, half_loss) = found.losses
    assert (first, half) == (0.05, 0.025) and found.learning_rate == 0.05, found
    # the plateau: both a hair below a uniform guess's, the half no better by the margin
    assert 0 < found.uniform_loss - loss < TRIAL_MIN_GAIN * found.uniform_loss, found
    assert half_loss > loss - TRIAL_MIN_GAIN * found.uniform_loss, found


@pytest.mark.parametrize(("losses", "chosen", "runs"), [
    # the tutorials' CNN, seed 1: dead at 0.05, a little less at 0.025 (before: kept 0.05)
    ({0.05: 2.301, 0.025: 2.126, 0.0125: 0.765, 0.00625: 0.633}, 0.0125, 4),
    # MNIST Conv1dBN seed 1: learns a little at 0.05 in the trial, then dies (before: kept)
    ({0.05: 1.676, 0.025: 1.145, 0.0125: 1.323}, 0.025, 3),
    ({0.05: 1.345, 0.025: 1.106}, 0.05, 2),     # a half not markedly better: kept
    ({0.05: 2.25, 0.025: 2.28}, 0.05, 2),       # a slow model (GRURows): its half no better
    ({0.05: 0.5}, 0.05, 1),                     # learns well: one run
    # a newcomer's CNN (zero last layer) at rate 10: at 4 halvings the trial ended at 0.625,
    # still gaining without a rate that learned, and the job ran at 10, at chance
    ({10: 6.883, 5: math.nan, 2.5: math.nan, 1.25: 11418138.557, 0.625: 2.415,
      0.3125: 2.359, 0.15625: 1.022, 0.078125: 0.528, 0.0390625: 0.484}, 0.078125, 9),
    # none learned: the rate whose run ended lowest, not the job's (before: the job's)
    ({10: 6.883, 5: math.nan, 2.5: 2.41, 1.25: 2.36, 0.625: 2.39}, 1.25, 5),
    # a model on a plateau (usercnn:SmallInitCNN, digits): a half a hair lower is no gain
    # (before: 0.025 taken, and every job sat at chance)
    ({0.05: 2.299, 0.025: 2.298}, 0.05, 2),
])
def test_the_trials_rule_on_the_losses_measured(monkeypatch: pytest.MonkeyPatch,
                                                losses: dict[float, float], chosen: float,
                                                runs: int) -> None:
    """The trial's halving rule on the losses the real models ended at (the runs above and
    bench_learning's probes): each rate's run scripted, the rule alone tested."""
    from types import SimpleNamespace

    import worker.training as training
    from proto.job import TrainingSpec

    ran: list[float] = []
    monkeypatch.setattr(training, "train_local",
                        lambda model, x, y, spec, seed: ran.append(spec.learning_rate))
    monkeypatch.setattr(training, "evaluate",
                        lambda model, x, y: SimpleNamespace(loss=losses[ran[-1]]))
    found = training.learning_rate_trial(lambda: None, np.zeros((8, 2)), np.arange(8) % 10,
                                         TrainingSpec(learning_rate=next(iter(losses))), 10,
                                         seed=0)
    assert found.learning_rate == chosen and len(found.losses) == runs, found
    assert not found.exhausted and not found.diverged


def test_a_trial_that_runs_out_of_halvings_still_gaining_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No rate learned and the smallest still gained on the ones before: the job's rate
    is kept and the trial `exhausted` (preflight refuses the job naming the rate to go
    below); one that stopped because a half gained nothing is not."""
    from types import SimpleNamespace

    import worker.training as training
    from proto.job import TrainingSpec

    def trial(losses: list[float]) -> Any:
        ran: list[float] = []
        monkeypatch.setattr(training, "train_local",
                            lambda model, x, y, spec, seed: ran.append(spec.learning_rate))
        monkeypatch.setattr(training, "evaluate",
                            lambda model, x, y: SimpleNamespace(loss=losses[len(ran) - 1]))
        return training.learning_rate_trial(lambda: None, np.zeros((8, 2)),
                                            np.arange(8) % 10, TrainingSpec(learning_rate=8.0),
                                            10, seed=0)

    falling = [2.3 - 0.04 * i for i in range(training.TRIAL_HALVINGS + 1)]
    found = trial(falling)
    assert found.exhausted and not found.diverged and found.learning_rate == 8.0, found
    assert len(found.losses) == training.TRIAL_HALVINGS + 1
    flat = trial([2.3, 2.25, 2.255])
    assert not flat.exhausted and flat.learning_rate == 4.0 and len(flat.losses) == 3
    # gaining less than TRIAL_MIN_GAIN x a uniform guess's a half: a plateau, not a trend
    creeping = trial([2.3 - 0.01 * i for i in range(training.TRIAL_HALVINGS + 1)])
    assert not creeping.exhausted and creeping.learning_rate == 8.0, creeping
    assert len(creeping.losses) == 2


def test_a_learning_rate_that_diverges_is_halved_and_one_that_always_does_is_refused(
) -> None:
    """A step that overshoots ends far above a uniform guess's loss (finite or not): its
    half is tried like a dead model's, not taken for a slow model's. Where every rate
    tried diverges the job is refused naming training.learning_rate, with each rate's
    loss and the rate to go below."""
    import torch
    from torch import nn

    from proto.job import JobSpec, TrainingSpec
    from worker.preflight import trial_learning_rate
    from worker.training import (
        TRIAL_HALVINGS,
        TRIAL_LEARNED,
        learning_rate_trial,
        trial_diverged,
    )

    torch.set_num_threads(1)
    data = load_dataset("digits")

    def linear() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    def trial(lr: float) -> Any:
        return learning_rate_trial(linear, data.x_train, data.y_train,
                                   TrainingSpec(learning_rate=lr), 10, seed=0)

    found = trial(32.0)  # 32 and 16 overshoot (losses ~19); before, 32 was kept
    assert trial_diverged(found.losses[0][1], found.uniform_loss), found
    assert found.learning_rate < 16 and not found.diverged, found
    assert dict(found.losses)[found.learning_rate] < TRIAL_LEARNED * found.uniform_loss
    gone = trial(1e5)  # losses in the thousands at every half
    assert gone.diverged and len(gone.losses) == TRIAL_HALVINGS + 1, gone
    assert gone.learning_rate == 1e5, gone
    spec = JobSpec.from_dict({"data": {"dataset": "digits"},
                              "model": {"name": "usercnn:SmallCNN"},
                              "training": {"learning_rate": 1000.0}})
    # 1000 down to 7.8 diverge; 3.9 ends at 2.74, above a uniform guess's and still falling
    with pytest.raises(JobSpecError, match=r"training\.learning_rate 1000 does not train "
                       r"model 'usercnn:SmallCNN' on digits.*1000: .*3\.90625: 2\.\d+\), and still falling "
                       r"at the smallest; set a learning_rate below 3\.90625.*\"off\"") as exc:
        trial_learning_rate(spec, data, "job.toml")
    assert exc.value.key == "training.learning_rate"
    with pytest.raises(JobSpecError, match=r"1e\+30: nan, 5e\+29: nan"):  # not a number
        trial_learning_rate(replace(spec, training=replace(spec.training,
                                                           learning_rate=1e30)), data)
    kept = trial_learning_rate(replace(spec, training=replace(spec.training,
                                                              learning_rate=0.05)), data)
    assert kept["learning_rate"] == 0.05 and kept["trial"][0][0] == 0.05
    # a built-in model trains at the job's rate: submit does not try it, so plan does not
    assert trial_learning_rate(replace(spec, model=replace(spec.model, name="mlp")), data) == {}


def test_the_trials_progress_reaches_the_user_and_a_stuck_check_is_killed(
        capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """submit and plan check a user model in a child Python: each trial run's loss is a
    line on our stderr as it comes (a large model's trial takes a while), and a child
    past its time is killed and the job refused naming model.name."""
    import uuid

    from fedcore.data.preflight import PROGRESS, check_model_in_child
    from worker.training import TRIAL_HALVINGS

    bench = str(Path(__file__).resolve().parents[2] / "bench")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([bench, str(Path.cwd())]))
    spec = JobSpec.from_dict({"data": {"dataset": "digits", "number_of_clients": 4},
                              "model": {"name": "usercnn:SmallCNN"},
                              "training": {"learning_rate": 1000.0}})
    with pytest.raises(JobSpecError) as exc:
        check_model_in_child(spec, "job.toml")
    assert exc.value.key == "training.learning_rate"
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith(PROGRESS)]
    assert len(lines) == TRIAL_HALVINGS + 1, lines
    assert "'usercnn:SmallCNN': 1000 -> loss" in lines[0], lines
    source = f"stuck-{uuid.uuid4().hex}.toml"
    with pytest.raises(JobSpecError, match=r"model.name 'usercnn:SmallCNN': checking .* "
                       r"longer than 0.5 s.*learning_rate_check") as exc:
        check_model_in_child(spec, source, timeout=0.5)
    assert exc.value.key == "model.name"

    def cmdline(path: Path) -> bytes:
        try:
            return path.read_bytes()
        except OSError:  # gone since the listing
            return b""

    left = [p for p in Path("/proc").glob("[0-9]*/cmdline") if source.encode() in cmdline(p)]
    assert not left, left


def test_a_check_killed_mid_trial_is_refused_naming_the_signal_and_the_way_on(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The child checking a user model dies by SIGKILL (what the OOM killer sends) in the
    middle of its learning-rate trial: the job is refused naming model.name, the signal
    and what to do, not "exit code -9" or a traceback."""
    from fedcore.data.preflight import PROGRESS, check_model_in_child

    (tmp_path / "dies.py").write_text(
        "import os, signal, torch\n"
        "class DiesInTrial(torch.nn.Module):\n"
        "    calls = 0\n"
        "    def __init__(self, input_shape, num_classes):\n"
        "        super().__init__()\n"
        "        self.head = torch.nn.Linear(64, num_classes)\n"
        "    def forward(self, x):\n"
        "        if self.training:\n"
        "            DiesInTrial.calls += 1\n"
        "            if DiesInTrial.calls == 100:  # a run is 64 steps: in the second rate's\n"
        "                os.kill(os.getpid(), signal.SIGKILL)\n"
        "        return self.head(x.reshape(x.shape[0], -1))\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(Path.cwd())]))
    spec = JobSpec.from_dict({"data": {"dataset": "digits", "number_of_clients": 4},
                              "model": {"name": "dies:DiesInTrial"},
                              "training": {"learning_rate": 1000.0}})
    with pytest.raises(JobSpecError) as exc:
        check_model_in_child(spec, "job.toml")
    said = str(exc.value)
    assert exc.value.key == "model.name" and "'dies:DiesInTrial'" in said, said
    assert "killed by SIGKILL" in said and "out-of-memory" in said, said
    assert 'learning_rate_check = "off"' in said and "exit code" not in said, said
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith(PROGRESS)]
    assert lines and "'dies:DiesInTrial': 1000 -> loss" in lines[0], lines  # it was mid-trial


@pytest.mark.slow
def test_submit_trains_at_the_trials_learning_rate_and_off_keeps_the_jobs(
        mnist_file: str, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through `fedpilot.run` (submit's path, in-process clusters): the job leaves chance
    in 2 rounds where, at the rate as given (learning_rate_check = "off"), it sits at a
    uniform guess; the line on stderr names the key, both rates and the way out."""
    import fedpilot

    monkeypatch.chdir(Path(__file__).resolve().parents[2] / "bench")   # usercnn, for the check
    def run_job(check: str) -> list[float]:
        spec = {"job": {"id": f"tutorial-{check}"},
                "data": {"dataset": mnist_file, "number_of_clients": 6},
                "model": {"name": "usercnn:TutorialCNN"},
                "training": {"federated_learning_rounds": 2, "number_of_epochs": 1,
                             "learning_rate_check": check},
                "topology": {"kind": "star"}, "aggregation": {"name": "fedavg"}}
        fedpilot.run(spec, local=2, backend="inprocess", quiet=True,
                     out=str(tmp_path / check), workdir=str(tmp_path / f"tb-{check}"))
        rounds = json.loads((tmp_path / check / "summary.json").read_text())["rounds"]
        return [r["accuracy"] for r in rounds]

    assert max(run_job("off")) < CHANCE + 0.05
    assert "learning_rate_check" not in capsys.readouterr().err
    curve = run_job("auto")
    said = capsys.readouterr().err
    assert curve[-1] > CHANCE + 0.3, curve
    assert ("training.learning_rate 0.05 did not train model.name 'usercnn:TutorialCNN'" in said
            and 'learning_rate_check = "off"' in said), said


def test_a_bench_cell_trains_all_its_tasks_at_the_trials_learning_rate(tmp_path: Path) -> None:
    """bench_learning measures a cell as submit would run it: centralized training, the
    reference loop and every job at the rate the trial chose (else centralized and the
    reference loop sat at chance with the jobs, and the cell judged nothing)."""
    import bench_learning as bl

    tasks, _refused, _rows, _clusters = bl.cell_tasks(
        ("mnist", "usercnn:TutorialCNN", 0.3, 20, 0, 3), [("star", "fedavg")], tmp_path, 1)
    rates = {name: job["training"].get("learning_rate") for _kind, name, job in tasks}
    assert set(rates) == {"centralized", "reference_fedavg", "star+fedavg"}
    assert len(set(rates.values())) == 1 and 0 < rates["star+fedavg"] < 0.05, rates
    tasks, *_ = bl.cell_tasks(("mnist", "usercnn:SmallCNN", 0.3, 20, 0, 3),
                              [("star", "fedavg")], tmp_path, 1)
    assert all("learning_rate" not in job["training"] for *_, job in tasks)


def test_a_model_that_fails_to_train_is_refused_naming_the_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose forward pass works in eval mode but raises in training: one line
    naming model.name and the way to skip the trial, before any cluster trains it."""
    from fedcore.data import load_dataset as load
    from proto.job import JobSpecError
    from worker.preflight import trial_learning_rate

    (tmp_path / "trainfails.py").write_text(
        "import torch\n"
        "class TrainModeFails(torch.nn.Module):\n"
        "    def __init__(self, input_shape, num_classes):\n"
        "        super().__init__()\n"
        "        self.head = torch.nn.Linear(64, num_classes)\n"
        "    def forward(self, x):\n"
        "        if self.training:\n"
        "            raise RuntimeError('no training here')\n"
        "        return self.head(x.reshape(x.shape[0], -1))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = job("star", model={"name": "trainfails:TrainModeFails"})
    with pytest.raises(JobSpecError) as raised:
        trial_learning_rate(spec, load("digits"), "job.toml")
    said = str(raised.value)
    assert raised.value.key == "model.name" and "trainfails:TrainModeFails" in said
    assert "fails to train" in said and "no training here" in said
    assert 'learning_rate_check = "off"' in said
    off = job("star", model={"name": "trainfails:TrainModeFails"},
              training={"learning_rate_check": "off"})
    assert trial_learning_rate(off, load("digits")) == {}


def test_an_unknown_learning_rate_check_is_refused_naming_the_key() -> None:
    from proto.job import JobSpecError

    with pytest.raises(JobSpecError) as raised:
        JobSpec.from_dict({"training": {"learning_rate_check": "maybe"}}, source="job.toml")
    assert raised.value.key == "training.learning_rate_check"
    assert "auto, off" in str(raised.value) and str(raised.value).startswith("job.toml")
