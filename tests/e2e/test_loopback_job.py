"""The whole job pipeline in one process: driver, executor services, round engine,
hybrid transport, real torch training on digits. Only fabricd is replaced by a loopback
link (the subprocess tests cover the daemons)."""

from __future__ import annotations

from typing import Any

import pytest
from safetensors.numpy import load as st_load

from fedpilot.loopback import LoopbackMesh
from proto.job import JobSpec
from proto.routing import RoutingMatrix
from scheduler.run.driver import Driver, JobFailed
from worker.context import InProcessContext
from worker.executor.runtime import runtime_factory


def job(**sections: Any) -> JobSpec:
    base: dict[str, Any] = {
        "job": {"id": "loop", "seed": 3},
        "data": {"number_of_clients": 9, "dirichlet_beta": 0.5},
        "training": {"federated_learning_rounds": 2, "number_of_epochs": 1},
        "placement": {"max_materialized": 2},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return JobSpec.from_dict(base)


def run(spec: JobSpec, clusters: tuple[str, ...] = ("a", "b", "c"), capacity: int = 4
        ) -> tuple[Any, LoopbackMesh]:
    # each cluster has its own context, as each real cluster has its own Ray
    mesh = LoopbackMesh(list(clusters), lambda cid: runtime_factory(InProcessContext(), cid),
                        capacity=capacity)
    driver = Driver(spec, mesh.clusters(), mesh, backend="inprocess", timeout=120)
    try:
        return driver.run(), mesh
    finally:
        driver.close()


@pytest.mark.parametrize("kind", ["star", "hybrid", "ring", "hierarchical"])
def test_job_runs_and_counts_inter_cluster_bytes_exactly(kind: str) -> None:
    result, mesh = run(job(topology={"kind": kind, "hierarchy_branching": 3}))
    summary = result.summary
    assert [r.round for r in summary.rounds] == [1, 2]
    assert all(0.0 <= r.accuracy <= 1.0 and 0.0 <= r.personalized_accuracy <= 1.0
               for r in summary.rounds)
    # every inter-cluster byte the executors account is a byte the link carried
    assert summary.bytes_inter_total == sum(mesh.bytes_sent.values())
    assert sum(c.clients for c in summary.clusters) == 9
    # at most max_materialized actors per cluster were needed (slots are recycled)
    assert all(c.actors_materialized <= 2 for c in summary.clusters)
    assert any(c.actors_materialized > 0 for c in summary.clusters)
    weights = st_load(result.model)
    assert weights and all(v.dtype.kind == "f" for v in weights.values())


def test_hybrid_locality_sends_fewer_inter_bytes_than_star_random() -> None:
    hybrid, _ = run(job(topology={"kind": "hybrid"}, placement={"strategy": "locality"},
                        data={"dirichlet_beta": 0.1}))
    star, _ = run(job(topology={"kind": "star"}, placement={"strategy": "random"},
                      data={"dirichlet_beta": 0.1}))
    assert 0 < hybrid.summary.bytes_inter_total < star.summary.bytes_inter_total


@pytest.mark.parametrize("method", ["fp16", "int8", "topk"])
def test_compression_shrinks_inter_cluster_bytes(method: str) -> None:
    plain, _ = run(job(topology={"kind": "star"}, placement={"strategy": "round_robin"}))
    packed, mesh = run(job(topology={"kind": "star"}, placement={"strategy": "round_robin"},
                           transfer={"compression": method, "topk_ratio": 0.1}))
    assert packed.summary.bytes_inter_total == sum(mesh.bytes_sent.values())
    assert packed.summary.bytes_inter_total < 0.6 * plain.summary.bytes_inter_total


def test_replanning_migrates_nodes_with_their_state() -> None:
    spec = job(topology={"kind": "star"}, training={"federated_learning_rounds": 4},
               placement={"strategy": "random", "clustering_period": 1})
    result, _ = run(spec)
    assert result.summary.replans == 3
    assert result.summary.migrations > 0
    assert len(result.summary.rounds) == 4


def test_same_seed_gives_the_same_accuracy() -> None:
    spec = job(topology={"kind": "hybrid"})
    first, _ = run(spec)
    second, _ = run(spec)
    assert [r.accuracy for r in first.summary.rounds] == [r.accuracy for r in second.summary.rounds]


def test_impossible_capacity_fails_before_training() -> None:
    with pytest.raises(Exception, match="capacity"):
        run(job(), capacity=2)


def test_executor_rejects_a_routing_matrix_for_another_job() -> None:
    mesh = LoopbackMesh(["a"], lambda cid: runtime_factory(InProcessContext(), cid), capacity=9)
    spec = job()
    mesh.request("a", {"kind": "job.start", "job_id": spec.job_id, "job": spec.to_dict(),
                       "clients": [0]}, 60)
    import numpy as np

    other = RoutingMatrix.from_edges(job_id="someone-else", clusters=["a"],
                                     node_cluster=np.zeros(2, dtype=np.int64),
                                     edges=np.array([[0, 1]]), num_clients=1,
                                     aggregators=["server"])
    with pytest.raises(JobFailed, match="routing matrix is for job 'someone-else'"):
        mesh.request("a", {"kind": "job.plan", "job_id": spec.job_id,
                           "routing": other.to_bytes(), "imports": []}, 60)
    with pytest.raises(JobFailed, match="unknown control message kind"):
        mesh.request("a", {"kind": "job.launch-missiles", "job_id": spec.job_id}, 60)
    with pytest.raises(JobFailed, match="this executor runs 'loop'"):
        mesh.request("a", {"kind": "round.run", "job_id": "other", "round": 1}, 60)


def test_a_migrated_node_arrives_with_the_model_it_had() -> None:
    import threading

    import numpy as np

    from scheduler.planning.clusters import ClusterSlot
    from scheduler.run.driver import plan_epoch

    # a ring: decentralized nodes hold their own models (a star's clients start each round
    # from the server's, so only the server's state would be worth moving)
    spec = job(topology={"kind": "ring"}, placement={"strategy": "round_robin"},
               aggregation={"name": "fedavgm"})  # each node mixes with its own momentum
    mesh = LoopbackMesh(["a", "b"], lambda cid: runtime_factory(InProcessContext(), cid),
                        capacity=9)
    from proto.control import read_histograms

    histograms = np.zeros((9, 10), dtype=np.int64)
    for k, cid in enumerate(["a", "b"]):
        reply = mesh.request(cid, {"kind": "job.start", "job_id": spec.job_id,
                                   "job": spec.to_dict(), "clients": list(range(k, 9, 2))}, 60)
        histograms[k::2] = read_histograms(reply, len(range(k, 9, 2)))
    plan = plan_epoch(spec, histograms, [ClusterSlot("a", 9), ClusterSlot("b", 9)], epoch=0)
    for cid in ("a", "b"):
        mesh.request(cid, {"kind": "job.plan", "job_id": spec.job_id,
                           "routing": plan.routing.to_bytes(), "imports": []}, 60)
    # one round, so that c1 holds a trained model rather than the initial one
    threads = [threading.Thread(target=mesh.request,
                                args=(cid, {"kind": "round.run", "job_id": spec.job_id,
                                            "round": 1}, 60)) for cid in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    source = plan.routing.cluster_of("c1")
    target = "a" if source == "b" else "b"
    before = mesh.services[source].runtime.resolve(mesh.services[source].engine.current_model("c1"))
    moments = mesh.services[source].engine.aggregator_state("c1")
    assert moments  # FedAvgM keeps its momentum after a round
    sent = mesh.request(source, {"kind": "node.export", "job_id": spec.job_id,
                                 "nodes": {"c1": target}, "epoch": 1}, 60)["sent"]
    assert sent == ["c1"]
    # the state travelled as an update stream, not inside the control reply
    assert mesh.bytes_sent[source] > 0
    before_plan = plan.routing
    moved = RoutingMatrix.from_edges(
        job_id=spec.job_id, clusters=["a", "b"], epoch=1, kind="ring",
        node_cluster=np.array([["a", "b"].index(target) if n == 1
                               else int(before_plan.node_cluster[n]) for n in range(9)]),
        edges=np.array([[i, (i + 1) % 9] for i in range(9)]), num_clients=9)
    mesh.request(target, {"kind": "job.plan", "job_id": spec.job_id,
                          "routing": moved.to_bytes(), "imports": ["c1"]}, 60)
    after = mesh.services[target].runtime.resolve(mesh.services[target].engine.current_model("c1"))
    assert set(after) == set(before)
    assert all(np.array_equal(after[k], before[k]) for k in before)
    moved_moments = mesh.services[target].engine.aggregator_state("c1")
    assert set(moved_moments) == set(moments)
    assert all(np.array_equal(moved_moments[k], moments[k]) for k in moments)
    initial = mesh.services[target].runtime.initial_weights
    assert not all(np.array_equal(after[k], initial[k]) for k in initial)


def test_the_last_rounds_personalized_accuracy_is_scored_against_the_final_model() -> None:
    """job.score: the last round's personalized accuracy sets each client's trained model
    against the job's final model (per held-out sample, held_out_choice), not against the
    model the round started from (a one-round job: the untrained initial model), under
    the policy the other clusters' counts pick for each cluster (personal_choice)."""
    from fedcore.data import client_data, load_dataset
    from proto.rounds import personal_choice
    from worker.executor.graph import client_index
    from worker.models import build_model
    from worker.nodes import NodeConfig
    from worker.nodes.federated import FederatedNode
    from worker.serialization import model_weights
    from worker.training import held_out_choice

    spec = job(topology={"kind": "star"}, training={"federated_learning_rounds": 1})
    result, mesh = run(spec)
    ds = load_dataset(spec.data.dataset)
    parts = client_data(ds, spec.data, spec.seed)
    config = NodeConfig(spec.job_id, spec.seed, spec.model, spec.training, spec.aggregation,
                        ds.input_shape, ds.num_classes,
                        pooled_labels=tuple(int(n) for n in parts.histograms.sum(axis=0)))
    node = FederatedNode(config, ds)
    initial = model_weights(build_model(spec.model, ds.input_shape, ds.num_classes,
                                        seed=spec.seed))
    final = dict(st_load(result.model))
    counts, against_final, against_start, total = {}, 0, 0, 0
    for cid, service in mesh.services.items():
        reply = {"total": 0, "global": 0, "local": [0, 0], "shifted": [0, 0]}
        for c in map(client_index, service.engine.local_clients()):
            node.bind(c, parts.train_indices[c], parts.test_indices[c])
            trained = node.train(1, initial).held_out_hits
            plain, shifted = node.held_out_hits(final)
            reply["total"] += len(trained)
            reply["global"] += int(plain.sum())
            for policy, received in (("local", plain), ("shifted", shifted)):
                chosen = held_out_choice(trained, received)
                reply[policy][0] += int((chosen & ~plain).sum())
                reply[policy][1] += int((plain & ~chosen).sum())
            against_final += int(held_out_choice(trained, shifted).sum())
            against_start += int(held_out_choice(trained, node.held_out_hits(initial)[1]).sum())
            total += len(trained)
        counts[cid] = reply
    correct, scored, _chosen = personal_choice(counts)
    assert scored == total
    personalized = result.summary.rounds[-1].personalized_accuracy
    assert personalized == pytest.approx(correct / total)
    assert abs(against_final - against_start) / total > 0.02  # the old number was another
    # the scheduler streamed the model to each cluster once, as final-model bytes
    assert result.summary.final_model["score_bytes"] == 3 * len(result.model)
    assert sum(mesh.bytes_final.values()) >= result.summary.final_model["score_bytes"]


def test_a_model_to_score_comes_only_from_the_cluster_the_scheduler_named() -> None:
    import numpy as np

    from proto.control import JobScore
    from worker import payload as wire
    from worker.errors import WorkerError
    from worker.executor.graph import FINAL, STATE
    from worker.executor.service import ControlError

    spec = job(topology={"kind": "star"}, training={"federated_learning_rounds": 1})
    result, mesh = run(spec)
    service = mesh.services["a"]
    sent = {"job_id": spec.job_id, "round": 0, "source_node": "score", "target_node": "score"}
    with pytest.raises(ControlError, match="unexpected model to score"):  # none expected
        service.deliver(source_cluster=mesh.local_cluster, payload=result.model, **sent)
    service.handle(JobScore(spec.job_id, phase="expect", round=1,
                            source_cluster=mesh.local_cluster).to_body())
    with pytest.raises(ControlError, match="unexpected model to score"):  # a member posing
        service.deliver(source_cluster="b", payload=result.model, **sent)
    state = wire.encode({"w": np.zeros(2, np.float32)}, kind=STATE, samples=0)
    with pytest.raises(ControlError, match="'state' payload"):
        service.deliver(source_cluster=mesh.local_cluster, payload=state, **sent)
    # a model that is not the job's (other tensors; NaN) is refused as it arrives, and
    # nothing is kept for the apply to score
    held = len(service.mailbox)
    other = wire.encode({"w": np.zeros(2, np.float32)}, kind=FINAL, samples=0)
    with pytest.raises(WorkerError, match="tensors differ from the job's model"):
        service.deliver(source_cluster=mesh.local_cluster, payload=other, **sent)
    tensors = {k: np.array(v) for k, v in st_load(result.model).items()}
    first = next(iter(tensors))
    tensors[first] = np.full_like(tensors[first], np.nan)
    with pytest.raises(WorkerError, match="NaN or infinite"):
        service.deliver(source_cluster=mesh.local_cluster,
                        payload=wire.encode(tensors, kind=FINAL, samples=0), **sent)
    assert len(service.mailbox) == held


def test_a_checkpoints_node_state_comes_only_from_the_cluster_and_for_the_nodes_named(
        ) -> None:
    """job.restore's streams pass the same gate as job.score's (_take_expected): refused
    when none is expected, from another cluster, for a node not named, or of another kind;
    nothing is kept."""
    import numpy as np

    from proto.control import JobRestore
    from worker import payload as wire
    from worker.executor.graph import FINAL, STATE
    from worker.executor.service import ControlError

    spec = job(topology={"kind": "star"}, training={"federated_learning_rounds": 1})
    _result, mesh = run(spec)
    cid, service = next((c, s) for c, s in mesh.services.items() if s.engine.local_clients())
    node = service.engine.local_clients()[0]
    state = wire.encode({"w": np.zeros(2, np.float32)}, kind=STATE, samples=0)
    sent = {"job_id": spec.job_id, "round": 0, "target_node": "restore"}
    held = len(service.mailbox)
    with pytest.raises(ControlError, match="unexpected restore"):  # none expected
        service.deliver(source_cluster=mesh.local_cluster, source_node=node, payload=state,
                        **sent)
    service.handle(JobRestore(spec.job_id, phase="expect", source_cluster=mesh.local_cluster,
                              nodes=(node,)).to_body())
    with pytest.raises(ControlError, match="unexpected restore"):  # a member posing
        service.deliver(source_cluster=cid, source_node=node, payload=state, **sent)
    with pytest.raises(ControlError, match="unexpected restore"):  # a node not named
        service.deliver(source_cluster=mesh.local_cluster, source_node="server",
                        payload=state, **sent)
    with pytest.raises(ControlError, match="restore for job 'other'"):
        service.deliver(source_cluster=mesh.local_cluster, source_node=node, payload=state,
                        **{**sent, "job_id": "other"})
    final = wire.encode({"w": np.zeros(2, np.float32)}, kind=FINAL, samples=0)
    with pytest.raises(ControlError, match="'final' payload"):
        service.deliver(source_cluster=mesh.local_cluster, source_node=node, payload=final,
                        **sent)
    assert len(service.mailbox) == held
    assert service.deliver(source_cluster=mesh.local_cluster, source_node=node,
                           payload=state, **sent)
    assert len(service.mailbox) == held + 1


def test_a_cluster_that_cannot_score_the_final_model_leaves_the_job_as_it_was(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """job.score is best effort: a failure there keeps the last round's own number and
    the job's result; a reply that is not a count is not summed."""
    from worker.executor.runtime import NodeRuntime

    spec = job(topology={"kind": "star"}, training={"federated_learning_rounds": 1})
    scored, _ = run(spec)

    def broken(self: NodeRuntime, *args: Any) -> dict[str, Any]:
        raise RuntimeError("actor died")

    monkeypatch.setattr(NodeRuntime, "final_personal", broken)
    with caplog.at_level("WARNING", logger="fedpilot.scheduler"):
        failed, _ = run(spec)
    assert "event=final_personal_skipped" in caplog.text and "actor died" in caplog.text
    same = st_load(failed.model), st_load(scored.model)
    assert all((same[0][k] == v).all() for k, v in same[1].items())
    assert failed.summary.final_accuracy == scored.summary.final_accuracy > 0
    assert (failed.summary.rounds[-1].personalized_accuracy
            != scored.summary.rounds[-1].personalized_accuracy)

    monkeypatch.setattr(NodeRuntime, "final_personal",  # lies: more right than it holds
                        lambda self, *a: {"total": 3, "global": 5, "local": [0, 0],
                                          "shifted": [0, 0]})
    caplog.clear()
    with caplog.at_level("WARNING", logger="fedpilot.scheduler"):
        lied, _ = run(spec)
    assert "are not counts" in caplog.text
    assert (lied.summary.rounds[-1].personalized_accuracy
            == failed.summary.rounds[-1].personalized_accuracy)


def test_the_driver_says_what_it_waits_for_before_the_first_round_and_after_the_last() -> None:
    """`submit` prints these lines: on Ray the clusters' start (Ray, data, actors) took
    30 s with nothing on the screen before round 1's bar."""
    spec = job()
    mesh = LoopbackMesh(["a", "b"], lambda cid: runtime_factory(InProcessContext(), cid),
                        capacity=6)
    seen: list[str] = []
    driver = Driver(spec, mesh.clusters(), mesh, backend="inprocess", timeout=120,
                    stage=seen.append,
                    progress=lambda record, total: seen.append(f"round {record.round}/{total}"))
    try:
        driver.run()
    finally:
        driver.close()
    assert seen[0].startswith("starting job loop on 2 cluster(s)")
    assert seen[1].startswith("2 cluster(s) started in ") and "placing 9 clients" in seen[1]
    assert seen[2].startswith("placed: ") and seen[2].endswith("round 1 of 2")
    assert seen[3:5] == ["round 1/2", "round 2/2"]
    assert seen[5].startswith("rounds done") and len(seen) == 6


def test_the_progress_watch_takes_chance_from_the_clients_pooled_labels(tmp_path: Any) -> None:
    """A table of 88% one label: the watch behind the progress line counts a model that
    always says that label as at chance (its share, from the profiled histograms), not
    1 / classes."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 4))
    y = (x[:, 0] > 1.2).astype(int)
    path = tmp_path / "skewed.csv"
    rows = ["a,b,c,d,label"] + [",".join(f"{v:.4f}" for v in r) + f",{c}" for r, c in zip(x, y, strict=True)]
    path.write_text("\n".join(rows) + "\n")
    spec = job(data={"dataset": f"csv:{path}", "number_of_clients": 6},
               topology={"kind": "star"})
    mesh = LoopbackMesh(["a", "b"], lambda cid: runtime_factory(InProcessContext(), cid),
                        capacity=4)
    driver = Driver(spec, mesh.clusters(), mesh, backend="inprocess", timeout=120)
    try:
        driver.run()
        pooled = driver._pooled_labels
        assert len(pooled) == 2 and sum(pooled) > 0
        assert driver.health.chance == pytest.approx(max(pooled) / sum(pooled))
        assert driver.health.chance > 0.8 and driver.health.majority == 0
    finally:
        driver.close()
