"""`fedpilot.run(job, local=N)`: the notebook's way to run a job, with the CLI's summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fedpilot
from proto.job import JobSpecError

JOB = {
    "job": {"id": "api-job", "seed": 2},
    "data": {"number_of_clients": 4, "dirichlet_beta": 0.5},
    "training": {"federated_learning_rounds": 2, "number_of_epochs": 1},
    "topology": {"kind": "star"},
    "placement": {"strategy": "round_robin", "max_materialized": 2},
}


def test_where_must_be_said_once_and_options_are_the_clis() -> None:
    with pytest.raises(ValueError, match="exactly one of local=N"):
        fedpilot.run(JOB)
    with pytest.raises(ValueError, match="exactly one of local=N"):
        fedpilot.run(JOB, local=2, mesh="scheduler.toml")
    with pytest.raises(ValueError, match="backend = 'local'; use 'ray' or 'inprocess'"):
        fedpilot.run(JOB, local=2, backend="local")
    with pytest.raises(TypeError, match="unknown submit option.*round_timeout"):
        fedpilot.run(JOB, local=2, round_timout=5)
    with pytest.raises(JobSpecError, match="fedpilot.run: unknown table \\[trainig\\]"):
        fedpilot.run({"trainig": {}}, local=2)


@pytest.mark.slow
def test_run_returns_the_summary_submit_prints(tmp_path: Path) -> None:
    out = tmp_path / "out"
    summary = fedpilot.run(JOB, local=2, backend="inprocess", out=str(out),
                           workdir=str(tmp_path / "tb"), capacity=3)
    assert set(summary) == {"job_id", "out", "clusters", "rounds", "final_accuracy",
                            "personalized_accuracy", "bytes_inter_total", "bytes_intra_total",
                            "seconds"}
    assert summary["job_id"] == "api-job" and summary["rounds"] == 2
    assert summary["clusters"] == ["cluster-1", "cluster-2"]
    # the same figures as the results directory the run wrote
    written = json.loads((out / "summary.json").read_text())
    assert summary["out"] == str(out)
    assert summary["bytes_inter_total"] == written["bytes_inter_total"] > 0
    assert summary["final_accuracy"] == round(written["final_accuracy"], 4)
