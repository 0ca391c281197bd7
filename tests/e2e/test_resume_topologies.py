"""Checkpoint and resume for every topology: a job interrupted mid-way and resumed from its
last checkpoint ends with the uninterrupted run's model, byte for byte.

Three clusters in this process (the production driver, executors, engine and transport);
what decides training is all exercised: a stateful server optimizer (FedAdam's moments at
roots and hybrid groups; FedAvgM's momentum at decentralized nodes, where adaptive
optimizers are refused), sampled
participants (client_fraction), and topk compression, whose per-edge references both ends
of every inter-cluster edge must take back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load as st_load

from fedpilot.loopback import LoopbackMesh
from proto.job import TOPOLOGIES, JobSpec
from proto.rounds import RoundRecord
from scheduler.run.checkpoint import Checkpoint, load_checkpoint, node_files, write_checkpoint
from scheduler.run.driver import Driver, JobResult
from worker.context import ExecutionContext, InProcessContext
from worker.executor.runtime import runtime_factory

ROUNDS = 4
CLIENTS = 9


class Interrupted(Exception):
    pass


def job(kind: str, tmp_path: Path, compression: str = "topk") -> JobSpec:
    topology: dict[str, Any] = {"kind": kind}
    if kind == "custom":
        adjacency = np.zeros((CLIENTS, CLIENTS))
        for i in range(CLIENTS):
            adjacency[i, (i + 2) % CLIENTS] = adjacency[(i + 2) % CLIENTS, i] = 1
        np.savetxt(tmp_path / "adj.csv", adjacency, delimiter=",")
        topology["adjacency_file"] = str(tmp_path / "adj.csv")
    if kind == "hierarchical":
        topology.update(hierarchy_levels=2, hierarchy_branching=3)
    return JobSpec.from_dict({
        "job": {"id": f"resume-{kind}", "seed": 11},
        "data": {"number_of_clients": CLIENTS, "dirichlet_beta": 0.5},
        "training": {"federated_learning_rounds": ROUNDS, "number_of_epochs": 1,
                     "client_fraction": 0.7},
        "topology": topology,
        "aggregation": {"name": "fedavgm" if kind in ("ring", "k_connected", "custom")
                        else "fedadam"},
        "placement": {"strategy": "locality", "max_materialized": 2},
        "transfer": {"compression": compression, "topk_ratio": 0.2},
        "faults": {"checkpoint_every": 2}})


def run(spec: JobSpec, out: Path, *, stop_after: int = 0, resume: bool = False,
        context: ExecutionContext | None = None) -> JobResult:
    mesh = LoopbackMesh(["cluster-1", "cluster-2", "cluster-3"],
                        lambda cid: runtime_factory(context or InProcessContext(), cid),
                        capacity=4)

    def progress(record: RoundRecord, total: int) -> None:
        if record.round == stop_after:
            raise Interrupted(f"stopped after round {record.round}")

    driver = Driver(spec, mesh.clusters(), mesh, backend="inprocess", timeout=120,
                    progress=progress, run_dir=out,
                    resume=load_checkpoint(out) if resume else None)
    try:
        return driver.run()
    finally:
        driver.close()


def tensor_bytes(model: bytes | None) -> dict[str, bytes]:
    assert model is not None
    return {name: value.tobytes() for name, value in st_load(model).items()}


@pytest.mark.parametrize("kind", [*TOPOLOGIES, "k_connected:fp16"])
def test_interrupted_and_resumed_gives_the_uninterrupted_model_bytes(tmp_path: Path,
                                                                      kind: str) -> None:
    # fp16: a node's model goes once to each neighbouring cluster (topk: once per edge)
    kind, _, compression = kind.partition(":")
    spec = job(kind, tmp_path, compression or "topk")
    whole = run(spec, tmp_path / "whole")
    out = tmp_path / "broken"
    with pytest.raises(Interrupted):  # round 3 ran, then the job stopped: it runs again
        run(spec, out, stop_after=3)
    checkpoint = load_checkpoint(out)
    assert checkpoint.round == 2
    if kind == "hybrid":  # the group aggregators' states, by their own names
        assert {"g:cluster-1", "g:cluster-2", "g:cluster-3"} <= set(checkpoint.models)
    resumed = run(spec, out, resume=True)
    assert [r.round for r in resumed.summary.rounds] == list(range(1, ROUNDS + 1))
    assert tensor_bytes(resumed.model) == tensor_bytes(whole.model)


def test_a_hybrid_job_exchanging_every_few_rounds_resumes_from_its_anchors(
        tmp_path: Path) -> None:
    """Hybrid groups under a server optimizer, exchanging every 2nd round, checkpointed at
    round 3: between exchanges each group trains alone and its optimizer's next step is
    taken from the last exchange's model (its anchor), which the checkpoint must hold."""
    base = job("hybrid", tmp_path, compression="none").to_dict()
    base["topology"]["inter_cluster_period"] = 2
    base["training"]["federated_learning_rounds"] = 6
    base["faults"]["checkpoint_every"] = 3
    spec = JobSpec.from_dict(base)
    whole = run(spec, tmp_path / "whole")
    out = tmp_path / "broken"
    with pytest.raises(Interrupted):
        run(spec, out, stop_after=4)
    checkpoint = load_checkpoint(out)
    assert checkpoint.round == 3
    from worker.executor.engine import ANCHOR
    from worker.executor.transport import AGGREGATOR
    from worker.payload import decode

    groups = [n for n in checkpoint.models if n.startswith("g:")]
    assert groups and all(any(k.startswith(AGGREGATOR + ANCHOR)
                              for k in decode(checkpoint.models[g]).tensors) for g in groups)
    resumed = run(spec, out, resume=True)
    assert tensor_bytes(resumed.model) == tensor_bytes(whole.model)


def test_a_stalled_decentralized_job_interrupted_and_resumed_stays_off_divergence(
        tmp_path: Path) -> None:
    """k_connected FedAvg whose clients train at learning rate 30 (the check off): the
    neighbourhoods' means diverge and every node goes back to its best model and halves
    its move (aggregation.on_stall). At client_fraction 0.7 a node that sat a round out
    mixed its trained neighbours' diverged models into its own, unevaluated: where the
    model a node goes back to has diverged too, it goes back to the job's initial model
    (before, rounds 2-5 here stayed diverged: losses 9.9 / 14.0 / 11.4 / 9.0).
    Interrupted after round 3 and resumed from round 2's checkpoint, which holds no best
    model (nothing is copied into it): each resumed node goes back to the model it began
    the stalled round from until it has seen a best again, with its halved move from the
    checkpoint. No round of the resumed job is diverged, and the resumed rounds act
    again."""
    import math

    from worker.aggregators.base import DIVERGED_LOSS

    base = job("k_connected", tmp_path, compression="none").to_dict()
    base["aggregation"] = {"name": "fedavg"}
    base["training"].update(learning_rate=30.0, learning_rate_check="off",
                            federated_learning_rounds=5)
    spec = JobSpec.from_dict(base)
    out = tmp_path / "broken"
    with pytest.raises(Interrupted):
        run(spec, out, stop_after=3)
    assert load_checkpoint(out).round == 2
    resumed = run(spec, out, resume=True).summary.rounds
    assert [r.round for r in resumed] == [1, 2, 3, 4, 5]
    losses = [r.loss for r in resumed]
    assert all(loss < DIVERGED_LOSS * math.log(10) for loss in losses), losses
    assert sum(r.stalls for r in resumed[2:]) >= 1, [r.stalls for r in resumed]


@pytest.mark.slow
def test_a_hybrid_job_on_ray_resumes_to_the_uninterrupted_model_bytes(tmp_path: Path, ray_session: None) -> None:
    """The same on the production backend: clients are Ray actors (batched calls), the
    models travel through Ray's object store; the job resumed on Ray ends with the model
    the in-process backend trains uninterrupted (the same bytes: each Ray job starts its
    actors' processes, 12-30 s of this test's, so the uninterrupted one runs in-process).
    On the session's Ray (conftest.py), which the worker tests share."""
    from worker.context import RayContext

    context = RayContext()
    try:
        spec = job("hybrid", tmp_path)
        whole = run(spec, tmp_path / "whole")
        out = tmp_path / "broken"
        with pytest.raises(Interrupted):
            run(spec, out, stop_after=3, context=context)
        assert load_checkpoint(out).round == 2
        resumed = run(spec, out, resume=True, context=context)
        assert [r.round for r in resumed.summary.rounds] == list(range(1, ROUNDS + 1))
        assert tensor_bytes(resumed.model) == tensor_bytes(whole.model)
    finally:
        context.shutdown()


def test_without_the_compression_references_a_resume_would_differ(tmp_path: Path) -> None:
    """The test above can fail: drop the references from the checkpoint and the resumed
    star job's model is another one."""
    spec = job("star", tmp_path)
    whole = run(spec, tmp_path / "whole")
    out = tmp_path / "broken"
    with pytest.raises(Interrupted):
        run(spec, out, stop_after=3)
    checkpoint = load_checkpoint(out)
    from worker.payload import decode, encode

    stripped = {}
    for node, payload in checkpoint.models.items():
        decoded = decode(payload)
        tensors = {k: v for k, v in decoded.tensors.items() if not k.startswith("codec/")}
        if tensors:
            stripped[node] = encode(tensors, kind=decoded.kind, samples=decoded.samples)
    assert len(stripped) < len(checkpoint.models)  # clients held references only
    checkpoint.models = stripped
    write_checkpoint(out, checkpoint)
    resumed = run(spec, out, resume=True)
    assert tensor_bytes(resumed.model) != tensor_bytes(whole.model)


def test_any_node_name_is_checkpointed_and_read_back(tmp_path: Path) -> None:
    names = ["g:cluster-1", "c0", "../../etc/passwd", "a/b", ".", "é:ü", "x" * 256, "100%"]
    models = {name: name.encode() for name in names}
    write_checkpoint(tmp_path, Checkpoint(round=1, epoch=0, spec={}, rounds=[], models=models))
    assert load_checkpoint(tmp_path).models == models
    files = node_files(names)
    where = tmp_path / "checkpoints" / "round-000001"
    assert sorted(p.name for p in where.iterdir()) == sorted([*files.values(), "state.json"])
    assert all("/" not in f and not f.startswith(".") for f in files.values())


def test_a_tampered_file_name_is_refused(tmp_path: Path) -> None:
    import json

    from scheduler.errors import JobFailed

    write_checkpoint(tmp_path, Checkpoint(round=1, epoch=0, spec={}, rounds=[],
                                          models={"g:a": b"x"}))
    state_path = tmp_path / "checkpoints" / "round-000001" / "state.json"
    state = json.loads(state_path.read_text())
    state["nodes"] = {"g:a": "../../secret.safetensors"}
    state_path.write_text(json.dumps(state))
    with pytest.raises(JobFailed, match="cannot be read"):
        load_checkpoint(tmp_path)
