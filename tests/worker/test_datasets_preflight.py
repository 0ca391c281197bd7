"""Check before start: a stray label, a missing model module and a model whose output size is
not the class count are one line naming the key, from `plan` as from the library call."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest

from proto.job import JobSpecError
from scheduler.jobfile import load_job
from worker.preflight import check_job_inputs

WRONG_HEAD = '''
import torch
from torch import nn


class SevenWay(nn.Module):
    """Ignores num_classes: always 7 outputs."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.fc = nn.Linear(int(torch.tensor(input_shape).prod()), 7)

    def forward(self, x):
        return self.fc(x.flatten(1))


class Probabilities(nn.Module):
    """Ends in a Softmax: cross-entropy takes logits."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, num_classes), nn.Softmax(dim=1))

    def forward(self, x):
        return self.net(x)


class LogProbabilities(Probabilities):
    def forward(self, x):
        return torch.log(super().forward(x))


class Crashes(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.fc = nn.Linear(3, num_classes)

    def forward(self, x):
        return self.fc(x)
'''


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, str]:
    module = f"user_models_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(WRONG_HEAD))
    x = np.random.default_rng(0).random((30, 4)).astype(np.float32)
    y = np.arange(30) % 3
    np.savez(tmp_path / "ok.npz", x_train=x, y_train=y, x_test=x[:6], y_test=y[:6])
    stray = y.copy()
    stray[4] = 255
    np.savez(tmp_path / "stray.npz", x_train=x, y_train=stray, x_test=x[:6], y_test=y[:6])
    return tmp_path, module


def job(tmp_path: Path, dataset: str, model: str) -> Path:
    path = tmp_path / f"job-{uuid.uuid4().hex[:6]}.toml"
    path.write_text(f'[data]\ndataset = "{dataset}"\nnumber_of_clients = 3\n'
                    f'data_distribution_kind = "iid"\n[model]\nname = "{model}"\n')
    return path


def test_library_check(setup: tuple[Path, str], monkeypatch: pytest.MonkeyPatch) -> None:
    tmp_path, module = setup
    monkeypatch.syspath_prepend(str(tmp_path))
    ok = job(tmp_path, "npz:ok.npz", "mlp")
    assert check_job_inputs(load_job(ok), str(ok)).num_classes == 3
    cases = [
        ("npz:stray.npz", "mlp", r"data\.dataset: dataset file .*stray\.npz: .*label 255 .*makes 256 classes"),
        ("npz:ok.npz", f"{module}:SevenWay",
         rf"model.name '{module}:SevenWay' gives 7 outputs per sample but data.dataset .*ok\.npz has 3 classes"),
        ("npz:ok.npz", f"{module}:Crashes", r"model.name '.*:Crashes' fails on input of shape \(2, 4\)"),
        ("npz:ok.npz", "nowhere_mod:Net", r"model.name: model 'nowhere_mod:Net': cannot import module"),
    ]
    for dataset, model, message in cases:
        path = job(tmp_path, dataset, model)
        with pytest.raises(JobSpecError, match=message) as info:
            check_job_inputs(load_job(path), str(path))
        assert str(info.value).startswith(str(path)) and "\n" not in str(info.value)


def test_a_model_that_returns_probabilities_is_run_with_a_warning_naming_it(
        setup: tuple[Path, str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A final Softmax trains, badly (cross-entropy takes logits): the check says so on
    a preflight line, names the model and what to drop, and refuses nothing; the same
    model's log-probabilities, and the built-in MLP's logits, get no such line."""
    tmp_path, module = setup
    monkeypatch.syspath_prepend(str(tmp_path))
    warned = {}
    for model in (f"{module}:Probabilities", f"{module}:LogProbabilities", "mlp"):
        path = job(tmp_path, "npz:ok.npz", model)
        assert check_job_inputs(load_job(path), str(path)).num_classes == 3
        warned[model] = [line for line in capsys.readouterr().err.splitlines()
                         if line.startswith("preflight: warning:")]
    line, = warned[f"{module}:Probabilities"]
    assert f"model.name '{module}:Probabilities' returns probabilities" in line
    assert "drop the final Softmax" in line
    assert warned[f"{module}:LogProbabilities"] == [] and warned["mlp"] == []


def test_plan_refuses_a_wrong_model_in_one_line(setup: tuple[Path, str]) -> None:
    tmp_path, module = setup
    path = job(tmp_path, "npz:ok.npz", f"{module}:SevenWay")
    env_path = f"{tmp_path}:{Path.cwd()}"
    proc = subprocess.run([sys.executable, "-m", "scheduler.cli", "plan", str(path)],
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "gives 7 outputs per sample" in lines[0] and "has 3 classes" in lines[0]
    assert proc.stdout == ""


def test_submit_refuses_a_stray_label_before_any_daemon_starts(setup: tuple[Path, str]) -> None:
    tmp_path, _ = setup
    path = job(tmp_path, "npz:stray.npz", "mlp")
    proc = subprocess.run([sys.executable, "-m", "scheduler.cli", "submit", str(path), "--local", "2",
                           "--backend", "inprocess", "--workdir", str(tmp_path / "tb"), "--out",
                           str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(Path.cwd()), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "label 255" in lines[0] and "stray.npz" in lines[0], proc.stderr
    assert not (tmp_path / "tb").exists() and not (tmp_path / "out").exists()  # nothing started


def test_submit_shows_a_dp_jobs_noise_before_it_starts(setup: tuple[Path, str]) -> None:
    tmp_path, _ = setup
    path = job(tmp_path, "npz:ok.npz", "mlp")
    path.write_text(path.read_text() + "[privacy]\ndp = 'central'\nepsilon = 4.0\n")
    # --resume of a directory with no checkpoint: refused after the checks, nothing started
    proc = subprocess.run([sys.executable, "-m", "scheduler.cli", "submit", str(path), "--local", "2",
                           "--backend", "inprocess", "--workdir", str(tmp_path / "tb"),
                           "--resume", str(tmp_path / "nothing")],
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(Path.cwd()), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr
    line = next(x for x in proc.stderr.splitlines() if x.startswith("privacy:"))
    assert "central DP, noise multiplier" in line and "epsilon 4" in line, line
    assert "clip_norm over ~" in line, line    # the model was measured: its parameters
    assert not (tmp_path / "tb").exists()
