"""VirtualNode and NodeManager on the in-process context (Ray twin: test_nodes_ray)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from fedcore.data import client_data, load_dataset
from proto.job import JobSpec
from worker.context import InProcessContext, PlacementError
from worker.nodes import NodeConfig, NodeManager, VirtualNode, client_seed


def config(spec: JobSpec) -> NodeConfig:
    ds = load_dataset(spec.data.dataset)
    return NodeConfig(spec.job_id, spec.seed, spec.model, spec.training, spec.aggregation,
                      ds.input_shape, ds.num_classes)


SPEC = JobSpec(job_id="nodes")


def setup_manager(ctx: InProcessContext, clients: int, cap: int, **kw: object) -> NodeManager:
    ds = load_dataset("digits")
    parts = client_data(ds, SPEC.data, SPEC.seed)
    return NodeManager(ctx, config(SPEC), ds, parts, list(range(clients)), max_materialized=cap,
                       cpus_per_node=0.25, **kw)  # type: ignore[arg-type]


def two_rounds(ctx: InProcessContext, manager: NodeManager, clients: int) -> list[np.ndarray]:
    """Each client trains twice from its own state; returns the final first-layer weights."""
    with manager:
        for round_index in (1, 2):
            refs = [manager.call(c, "train", round_index) for c in range(clients)]
            updates = ctx.get(refs)
            assert [u.client_id for u in updates] == list(range(clients))
        first = next(iter(updates[0].weights))
        return [np.asarray(u.weights[first]) for u in updates]


def test_virtual_node_is_tiny() -> None:
    node = VirtualNode(3, config(SPEC))
    assert not hasattr(node, "__dict__")
    assert sys.getsizeof(node) <= 56
    assert node.node_id == 3 and "nodes" in repr(node)


def test_client_seed_differs_per_client_and_round() -> None:
    seeds = {client_seed(0, c, r) for c in range(5) for r in range(5)}
    assert len(seeds) == 25
    assert client_seed(1, 2, 3) == client_seed(1, 2, 3)


def test_lru_recycling_keeps_state_and_caps_actors() -> None:
    clients = 5
    with InProcessContext(num_cpus=2) as ctx:
        churn = setup_manager(ctx, clients, 2)
        churned = two_rounds(ctx, churn, clients)
        assert churn.stats.created == 2
        assert churn.stats.max_alive == 2
        assert churn.stats.materializations == 10  # every client, both rounds
        assert churn.stats.dematerializations == 8
    with InProcessContext(num_cpus=2) as ctx:
        resident = setup_manager(ctx, clients, clients)
        stayed = two_rounds(ctx, resident, clients)
        assert resident.stats.created == clients
        assert resident.stats.materializations == clients
        assert resident.stats.dematerializations == 0
    # saving and reloading state mid-job changes nothing
    for a, b in zip(churned, stayed, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(churned[0], churned[1])


def test_kill_mode_creates_fresh_actors_and_never_exceeds_the_cap() -> None:
    clients = 4
    with InProcessContext(num_cpus=2) as ctx:
        manager = setup_manager(ctx, clients, 2, recycle=False)
        with manager:
            for round_index in (1, 2):
                for c in range(clients):
                    ctx.get(manager.call(c, "train", round_index))
                    assert ctx.alive_actors() <= 2
        assert manager.stats.created == 8 == ctx.actors_created
        assert manager.stats.killed == 8  # 6 evictions + 2 at close
        assert manager.stats.max_alive == 2
        assert ctx.alive_actors() == 0


def test_placement_failure_happens_before_any_actor() -> None:
    with InProcessContext(num_cpus=1) as ctx:
        manager = setup_manager(ctx, 8, 8)
        with pytest.raises(PlacementError, match=r"8 bundle\(s\) x \{'CPU': 0.25\}"):
            manager.start()
        assert ctx.actors_created == 0
        with pytest.raises(RuntimeError, match="start"):
            manager.call(0, "ping")
        assert ctx.actors_created == 0


def test_a_trained_model_travels_as_an_update_payload() -> None:
    from worker.payload import decode, encode

    with InProcessContext(num_cpus=2) as ctx:
        source = setup_manager(ctx, 3, 3)
        with source:
            ctx.get(source.call(1, "train", 1))
            weights = ctx.get(source.call(1, "weights")).weights
    data = encode(weights, kind="state", samples=0)
    assert isinstance(data, bytes) and b"pickle" not in data
    back = decode(data).tensors
    for name, value in weights.items():
        np.testing.assert_array_equal(back[name], value)


def test_without_kept_state_a_switch_only_binds_data_and_training_uses_the_given_model() -> None:
    """The engine's mode: every call brings its model, so nothing is saved or reloaded."""
    with InProcessContext(num_cpus=2) as ctx:
        stateful = setup_manager(ctx, 4, 1)
        stateless = setup_manager(ctx, 4, 1, keep_state=False)
        with stateful, stateless:
            model = ctx.get(stateful.call(0, "weights")).weights
            for c in (0, 1, 2, 3, 0):  # one slot: every call switches clients
                a = ctx.get(stateful.call(c, "train", 1, dict(model)))
                b = ctx.get(stateless.call(c, "train", 1, dict(model)))
                for name in a.weights:
                    np.testing.assert_array_equal(a.weights[name], b.weights[name])
            assert stateless._states == {} and len(stateful._states) == 4
            assert stateless.stats.dematerializations == stateful.stats.dematerializations == 4


def test_without_kept_state_calls_share_the_actors_that_train_at_once() -> None:
    """The engine's mode: one call per client (the final personalized score, local
    BatchNorm's training) binds clients in turn to the `batch_slots` actors; before, each
    started an actor of its own up to max_materialized (Ray on 2 CPUs: 30 s of actor
    starts after a job's last round)."""
    with InProcessContext(num_cpus=2) as ctx:
        manager = setup_manager(ctx, 6, 6, keep_state=False)
        manager.batch_slots = 2
        with manager:
            model = ctx.get(manager.call(0, "weights")).weights
            updates = ctx.get([manager.call(c, "train", 1, dict(model)) for c in range(6)])
            assert [u.client_id for u in updates] == list(range(6))
            assert manager.stats.created == 2
            # a client bound again after others took its actor trains on its own data
            again = ctx.get(manager.call(1, "train", 1, dict(model)))
            assert again.client_id == 1 and again.num_samples == updates[1].num_samples
            assert manager.stats.created == 2


def test_personal_epochs_score_a_fine_tuned_copy_and_send_the_trained_model() -> None:
    """training.personal_epochs: the personalized figure comes from a fine-tuned copy; the
    update (what is aggregated) is the same as without it."""
    from dataclasses import replace

    ds = load_dataset("digits")
    parts = client_data(ds, SPEC.data, SPEC.seed)
    tuned = replace(SPEC, training=replace(SPEC.training, personal_epochs=3))
    with InProcessContext(num_cpus=2) as ctx:
        plain = NodeManager(ctx, config(SPEC), ds, parts, [0], max_materialized=1,
                            cpus_per_node=0.25, keep_state=False)
        personal = NodeManager(ctx, config(tuned), ds, parts, [0], max_materialized=1,
                               cpus_per_node=0.25, keep_state=False)
        with plain, personal:
            # (no model sent: the client's own scores alone, not weighed against one
            # received; both start from the same seeded model)
            a = ctx.get(plain.call(0, "train", 1))
            b = ctx.get(personal.call(0, "train", 1))
    for name in a.weights:
        np.testing.assert_array_equal(a.weights[name], b.weights[name])
    assert a.local_samples == b.local_samples > 0
    assert a.local_accuracy != b.local_accuracy  # three more epochs moved the scored model


def test_a_batchnorm_models_personalized_score_uses_statistics_of_the_clients_own_data(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The personalized figure of a model with BatchNorm: its statistics measured on the
    client's own training samples (as the engine's global model's), not the running
    averages of its last training batches; the update keeps training's own statistics."""
    from dataclasses import replace

    from worker.models import build_model
    from worker.serialization import load_weights
    from worker.training import batchnorm_statistics, evaluate

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    spec = replace(SPEC, model=replace(SPEC.model, name="usercnn:BNMLP"))
    ds = load_dataset("digits")
    parts = client_data(ds, spec.data, spec.seed)
    with InProcessContext(num_cpus=2) as ctx:
        nodes = NodeManager(ctx, config(spec), ds, parts, [0], max_materialized=1,
                            cpus_per_node=0.25, keep_state=False)
        with nodes:
            # (no model sent: the trained model's score alone, not weighed against one
            # received)
            update = ctx.get(nodes.call(0, "train", 1))
    net = build_model(spec.model, ds.input_shape, ds.num_classes, seed=spec.seed)
    train, test = parts.train_indices[0], parts.test_indices[0]
    load_weights(net, update.weights)
    left = evaluate(net, ds.x_train[test], ds.y_train[test])
    measured = batchnorm_statistics(net, ds.x_train[train])
    assert measured and any(not np.allclose(measured[k], update.weights[k]) for k in measured)
    load_weights(net, {**update.weights, **measured})
    scored = evaluate(net, ds.x_train[test], ds.y_train[test])
    assert update.local_accuracy == pytest.approx(scored.accuracy)
    # the statistics change what the model outputs (its 9 held-out samples' accuracy
    # can tie: the loss does not)
    assert scored.loss != pytest.approx(left.loss)


def test_a_client_whose_training_hurts_it_is_scored_with_the_model_it_received() -> None:
    """Personalized accuracy is per held-out sample the better of the trained and the
    received model (by their loss on the client's other held-out samples): a client whose
    training diverges (learning rate 1000) scores what the model it received scores."""
    from dataclasses import replace

    from worker.models import build_model
    from worker.serialization import load_weights, model_weights
    from worker.training import evaluate, train_local

    ds = load_dataset("digits")
    parts = client_data(ds, SPEC.data, SPEC.seed)
    net = build_model(SPEC.model, ds.input_shape, ds.num_classes, seed=SPEC.seed)
    train_local(net, ds.x_train, ds.y_train, SPEC.training, seed=0)
    good = model_weights(net)
    test = parts.test_indices[0]
    received = evaluate(net, ds.x_train[test], ds.y_train[test]).accuracy
    wild = replace(SPEC, training=replace(SPEC.training, learning_rate=1000.0))
    with InProcessContext(num_cpus=2) as ctx:
        nodes = NodeManager(ctx, config(wild), ds, parts, [0], max_materialized=1,
                            cpus_per_node=0.25, keep_state=False)
        with nodes:
            update = ctx.get(nodes.call(0, "train", 1, dict(good)))
    load_weights(net, update.weights)
    assert evaluate(net, ds.x_train[test], ds.y_train[test]).accuracy < received - 0.3
    assert update.local_samples == len(test) > 0
    assert update.local_accuracy == pytest.approx(received)


def test_a_client_without_held_out_samples_trains_from_a_received_model() -> None:
    """A client whose test split is empty (client_test_fraction small, few samples) trains
    from the model it received and reports no personalized samples: nothing to choose
    between (before: the choice's mean of no samples was NaN and failed the round)."""
    from worker.models import build_model
    from worker.nodes.federated import FederatedNode
    from worker.serialization import model_weights

    ds = load_dataset("digits")
    parts = client_data(ds, SPEC.data, SPEC.seed)
    node = FederatedNode(config(SPEC), ds)
    node.bind(0, parts.train_indices[0], np.zeros(0, dtype=np.int64))
    received = model_weights(build_model(SPEC.model, ds.input_shape, ds.num_classes, seed=1))
    update = node.train(1, received)
    assert (update.local_accuracy, update.local_samples) == (0.0, 0)
    assert update.held_out_hits.shape == (0,)
    assert node.held_out_hits(received).shape == (2, 0)


def test_a_client_whose_training_diverges_sends_the_model_it_received() -> None:
    """Training to NaN (learning rate 1e30) sends the model the client started from, so
    the round goes on: where it arrived, a NaN update was refused and the round failed
    (table BNMLP beta 0.1, 50 clients, k_connected fedavg: the job failed in round 3)."""
    from dataclasses import replace

    from worker.models import build_model
    from worker.nodes.federated import FederatedNode
    from worker.serialization import model_weights

    ds = load_dataset("digits")
    parts = client_data(ds, SPEC.data, SPEC.seed)
    wild = replace(SPEC, training=replace(SPEC.training, learning_rate=1e30))
    node = FederatedNode(config(wild), ds)
    node.bind(0, parts.train_indices[0], parts.test_indices[0])
    received = model_weights(build_model(SPEC.model, ds.input_shape, ds.num_classes, seed=1))
    update = node.train(1, dict(received))
    assert update.extra.get("diverged") == 1.0
    assert all(np.array_equal(update.weights[k], received[k]) for k in received)
    sane = FederatedNode(config(SPEC), ds)
    sane.bind(0, parts.train_indices[0], parts.test_indices[0])
    moved = sane.train(1, dict(received))
    assert "diverged" not in moved.extra
    assert not all(np.array_equal(moved.weights[k], received[k]) for k in received)
