"""Checkpoints and resume on the in-process backend: a job interrupted after round 5 and
resumed from its round-4 checkpoint ends with exactly the model of an uninterrupted run,
and metrics.csv holds every round once."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load as st_load

from fedpilot.loopback import LoopbackMesh
from proto.job import JobSpec
from proto.rounds import RoundRecord
from scheduler.run.checkpoint import load_checkpoint
from scheduler.run.driver import Driver, JobResult
from scheduler.rundir.results import write_results
from scheduler.rundir.status import RunRecorder
from worker.context import InProcessContext
from worker.executor.runtime import runtime_factory

ROUNDS = 6


def spec(kind: str, aggregation: str) -> JobSpec:
    return JobSpec.from_dict({
        "job": {"id": f"resume-{kind}", "seed": 5},
        "data": {"number_of_clients": 6},
        "training": {"federated_learning_rounds": ROUNDS, "number_of_epochs": 1},
        "topology": {"kind": kind},
        "aggregation": {"name": aggregation},
        "placement": {"strategy": "round_robin", "max_materialized": 2},
        "faults": {"checkpoint_every": 2}})


class Interrupted(Exception):
    pass


def run(job: JobSpec, out: Path, *, stop_after: int = 0, resume: bool = False) -> JobResult:
    mesh = LoopbackMesh(["a", "b"], lambda cid: runtime_factory(InProcessContext(), cid),
                        capacity=4)
    recorder = RunRecorder.for_job(out, job, backend="inprocess")
    checkpoint = load_checkpoint(out) if resume else None
    if checkpoint is not None:
        recorder.summary.rounds.extend(RoundRecord.from_dict(d) for d in checkpoint.rounds)

    def progress(record: RoundRecord, total: int) -> None:
        recorder(record, total)
        if record.round == stop_after:
            raise Interrupted(f"stopped after round {record.round}")

    driver = Driver(job, mesh.clusters(), mesh, backend="inprocess", timeout=120,
                    progress=progress, run_dir=out, resume=checkpoint)
    try:
        result = driver.run()
    finally:
        driver.close()
    write_results(out, result.summary, placement=result.placement, model_bytes=result.model)
    return result


def tensors(model: bytes | None) -> dict[str, np.ndarray]:
    assert model is not None
    return dict(st_load(model))


@pytest.mark.parametrize(("kind", "aggregation"), [("star", "fedadam"), ("ring", "fedavg")])
def test_resumed_job_ends_with_the_uninterrupted_model(tmp_path: Path, kind: str,
                                                        aggregation: str) -> None:
    job = spec(kind, aggregation)
    whole = run(job, tmp_path / "whole")
    out = tmp_path / "broken"
    with pytest.raises(Interrupted):
        run(job, out, stop_after=5)
    assert load_checkpoint(out).round == 4  # every 2 rounds; round 5 was not checkpointed
    resumed = run(job, out, resume=True)
    expected, got = tensors(whole.model), tensors(resumed.model)
    assert expected.keys() == got.keys()
    for name in expected:
        assert np.array_equal(expected[name], got[name]), name
    with (out / "metrics.csv").open() as f:
        rounds = [int(row["round"]) for row in csv.DictReader(f)]
    assert rounds == list(range(1, ROUNDS + 1))
    # (the order in which a cluster's nodes finish sums their scores: equal to the last bit
    # only up to that order)
    assert [r.accuracy for r in resumed.summary.rounds] == pytest.approx(
        [r.accuracy for r in whole.summary.rounds], rel=1e-12)


def test_a_checkpoint_is_replaced_atomically(tmp_path: Path) -> None:
    from scheduler.run.checkpoint import Checkpoint, write_checkpoint

    def ckpt(r: int) -> Checkpoint:
        return Checkpoint(round=r, epoch=0, spec={}, rounds=[], models={"s0": bytes([r])})

    for r in (2, 4, 6):
        write_checkpoint(tmp_path, ckpt(r))
    # a crash mid-write leaves a temporary directory, never a half checkpoint in LATEST
    (tmp_path / "checkpoints" / ".tmp-round-000008-1").mkdir()
    latest = load_checkpoint(tmp_path)
    assert latest.round == 6 and latest.models == {"s0": bytes([6])}
    kept = sorted(p.name for p in (tmp_path / "checkpoints").glob("round-*"))
    assert kept == ["round-000004", "round-000006"]


def test_resume_without_a_checkpoint_says_how_to_get_one(tmp_path: Path) -> None:
    from scheduler.run.driver import JobFailed

    with pytest.raises(JobFailed, match="checkpoint_every"):
        load_checkpoint(tmp_path)


