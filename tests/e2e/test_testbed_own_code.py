"""`--local` with the newcomer's own model class, aggregator class and data files.

Whoever starts a local testbed is every cluster's operator: the testbed allows the job's
own modules and dataset directory (and what `--allow-module` / `--data-root` add), writes
that into every cluster.toml, and the clusters' executors import and read them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest

import fedpilot
from fabricd.config import load_config
from proto.job import JobSpec
from scheduler.testbed import LocalTestbed, job_allowances
from worker.executor.allowlist import JobNotAllowed, check_job

MODELS = '''
import torch.nn as nn


class Net(nn.Module):
    """A user's model: built as Net(input shape, classes)."""

    def __init__(self, shape, classes):
        super().__init__()
        n = 1
        for d in shape:
            n *= d
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(n, 16), nn.ReLU(),
                                  nn.Linear(16, classes))

    def forward(self, x):
        return self.body(x)
'''

AGGREGATORS = '''
import numpy as np
from worker.aggregators import Aggregator
from worker.aggregators.base import cast_like, check_updates


class UnweightedMean(Aggregator):
    name = "unweighted_mean"

    def aggregate(self, global_weights, updates):
        check_updates(global_weights, updates, self.name)
        mean = {k: np.mean([np.asarray(w[k], np.float64) for w, _ in updates], axis=0)
                for k in global_weights}
        return cast_like(mean, global_weights)
'''


def user_code(where: Path) -> tuple[str, str]:
    """A model module and an aggregator module (fresh names) written in `where`."""
    suffix = uuid.uuid4().hex[:8]
    models, aggs = f"mymodels_{suffix}", f"myaggs_{suffix}"
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{models}.py").write_text(textwrap.dedent(MODELS))
    (where / f"{aggs}.py").write_text(textwrap.dedent(AGGREGATORS))
    return f"{models}:Net", f"{aggs}:UnweightedMean"


def features() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    keep = y < 4
    return x[keep][:240].astype(np.float32) / 16.0, y[keep][:240].astype(np.int64)


def write_dataset(kind: str, where: Path) -> str:
    """The job's data.dataset for a file of `kind` written under `where`."""
    where.mkdir(parents=True, exist_ok=True)
    x, y = features()
    if kind == "npz":
        path = where / "digits.npz"
        np.savez(path, x_train=x[:180], y_train=y[:180], x_test=x[180:], y_test=y[180:])
    elif kind in ("csv", "parquet"):
        import pyarrow as pa

        columns = {f"f{i}": x[:, i] for i in range(x.shape[1])}
        table = pa.table({**columns, "label": y})
        path = where / f"digits.{kind}"
        if kind == "csv":
            import pyarrow.csv as pacsv

            pacsv.write_csv(table, path)
        else:
            import pyarrow.parquet as pq

            pq.write_table(table, path)
    else:
        from PIL import Image

        path = where / "images"
        for i, (row, label) in enumerate(zip(x[:120], y[:120], strict=True)):
            folder = path / f"class{label}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray((row.reshape(8, 8) * 255).astype(np.uint8)).save(folder / f"{i}.png")
    return f"{kind}:{path}"


def job(dataset: str, model: str, aggregator: str, job_id: str) -> dict[str, object]:
    return {
        "job": {"id": job_id, "seed": 3},
        "data": {"dataset": dataset, "number_of_clients": 6, "data_distribution_kind": "iid"},
        "model": {"name": model},
        "training": {"federated_learning_rounds": 2, "number_of_epochs": 1},
        "topology": {"kind": "star"},
        "aggregation": {"name": aggregator},
        "placement": {"strategy": "round_robin", "max_materialized": 2},
    }


@pytest.mark.parametrize("kind", ["npz", "csv", "parquet", "imagefolder"])
def test_the_jobs_own_classes_and_data_are_allowed(tmp_path: Path, kind: str) -> None:
    model, aggregator = user_code(tmp_path / "code")
    dataset = write_dataset(kind, tmp_path / "mydata")
    spec = JobSpec.from_dict(job(dataset, model, aggregator, f"own-{kind}"))
    allow = job_allowances(spec)
    assert allow.modules == (model.partition(":")[0], aggregator.partition(":")[0])
    expected_root = tmp_path / "mydata" / ("images" if kind == "imagefolder" else "")
    assert allow.data_roots == (str(expected_root.resolve()),)
    check_job(spec, allow.modules, allow.data_roots)
    with pytest.raises(JobNotAllowed, match="data.dataset"):  # the root is what admits it
        check_job(spec, allow.modules, [tmp_path / "code"])


def test_every_cluster_toml_of_the_testbed_admits_the_job(tmp_path: Path) -> None:
    """As fabricd reads the cluster.toml the testbed writes; without the allowances the
    same job is refused, so the allow-list is really in force."""
    model, aggregator = user_code(tmp_path / "code")
    spec = JobSpec.from_dict(job(write_dataset("npz", tmp_path / "mydata"), model, aggregator,
                                 "own-toml"))
    allow = job_allowances(spec)
    assert "(--allow-module / --data-root add more)" in allow.describe()
    workdir = tmp_path / "tb"
    configs = LocalTestbed(2, backend="inprocess", workdir=str(workdir), allow=allow).prepare()
    assert set(configs) == {"cluster-1", "cluster-2", "scheduler"}
    config = load_config(configs["cluster-2"])
    check_job(spec, config.allow_models, config.data_roots, cluster_id="cluster-2")
    assert workdir / "cluster-2" / "data" in config.data_roots  # pinned datasets live there
    with pytest.raises(JobNotAllowed, match="model.name .* not allowed on cluster 'cluster-2'"):
        check_job(spec, (), config.data_roots, cluster_id="cluster-2")


def test_flags_add_modules_and_roots(tmp_path: Path) -> None:
    spec = JobSpec.from_dict({"job": {"id": "flags"}})
    allow = job_allowances(spec, modules=["lab.models", "lab.models"], data_roots=[tmp_path])
    assert allow.modules == ("lab.models",)
    assert allow.data_roots == (str(tmp_path.resolve()),)
    assert "lab.models" in allow.describe() and str(tmp_path.resolve()) in allow.describe()


# -- whole runs: real daemons (subprocesses), the executors import the user's modules ----------

@pytest.mark.slow
@pytest.mark.parametrize("kind", ["npz", "csv"])
def test_submit_local_runs_own_model_aggregator_and_data(tmp_path: Path, kind: str) -> None:
    """As a newcomer runs it: `python -m scheduler.cli submit job.toml --local 3` from the
    directory holding mymodels.py, no extra flags."""
    code = tmp_path / "project"
    model, aggregator = user_code(code)
    dataset = write_dataset(kind, tmp_path / "mydata")
    spec = JobSpec.from_dict(job(dataset, model, aggregator, f"cli-{kind}"))
    job_file = code / "job.toml"
    job_file.write_text(_toml(spec))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "scheduler.cli", "submit", str(job_file), "--local", "3",
         "--backend", "inprocess", "--out", str(out), "--workdir", str(tmp_path / "tb"),
         "--quiet"], cwd=code, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "testbed clusters allow: classes from " + model.partition(":")[0] in proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["rounds"] == 2 and len(summary["clusters"]) == 3
    assert summary["bytes_inter_total"] > 0  # 3 clusters really exchanged the user model


@pytest.mark.slow
@pytest.mark.parametrize("kind, backend", [("parquet", "inprocess"), ("imagefolder", "inprocess"),
                                           ("npz", "ray")])
def test_fedpilot_run_local_runs_own_model_aggregator_and_data(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, backend: str) -> None:
    """A notebook next to the user's modules (its directory on sys.path, not on
    PYTHONPATH); the clusters' executors import them all the same. On Ray two clusters
    (each starts a Ray of its own: 6-8 s of this machine's two cores apiece)."""
    code = tmp_path / "nb"
    model, aggregator = user_code(code)
    monkeypatch.chdir(code)
    monkeypatch.syspath_prepend(str(code))
    dataset = write_dataset(kind, tmp_path / "mydata")
    clusters = 2 if backend == "ray" else 3
    summary = fedpilot.run(job(dataset, model, aggregator, f"api-{kind}"), local=clusters,
                           backend=backend, out=str(tmp_path / "out"),
                           workdir=str(tmp_path / "tb"))
    assert summary["rounds"] == 2 and len(summary["clusters"]) == clusters
    assert summary["bytes_inter_total"] > 0


def _toml(spec: JobSpec) -> str:
    lines = []
    for section, values in spec.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items() if v is not None]
    return "\n".join(lines) + "\n"
