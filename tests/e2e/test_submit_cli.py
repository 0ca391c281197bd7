"""`fedpilot-scheduler submit --local N` as a user runs it: a subprocess end to end."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCHEDULER = str(Path(sys.executable).with_name("fedpilot-scheduler"))
JOB = """
[job]
id = "cli-job"
seed = 2
[data]
number_of_clients = 6
dirichlet_beta = 0.3
[training]
federated_learning_rounds = {rounds}
number_of_epochs = 1
[topology]
kind = "hybrid"
[placement]
strategy = "locality"
max_materialized = 2
"""


def write_job(tmp_path: Path, rounds: int) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(rounds=rounds))
    return path


def fabricd_processes(workdir: Path) -> list[str]:
    """Command lines of live processes that mention `workdir` (daemons and executors)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(workdir) in cmdline and ("fabricd" in cmdline or "worker.executor" in cmdline):
            found.append(cmdline)
    return found


def test_submit_local_writes_the_results_directory(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [SCHEDULER, "submit", str(write_job(tmp_path, 2)), "--local", "2", "--backend",
         "inprocess", "--out", str(out), "--workdir", str(tmp_path / "tb")],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert printed["job_id"] == "cli-job" and printed["rounds"] == 2
    assert "round 2/2" in proc.stderr  # the progress bar
    summary = json.loads((out / "summary.json").read_text())
    for key in ("job_id", "backend", "clusters", "placement_strategy", "communities", "rounds",
                "final_accuracy", "personalized_accuracy", "bytes_inter_total",
                "bytes_intra_total"):
        assert key in summary, key
    assert {c["cluster_id"] for c in summary["clusters"]} == {"cluster-1", "cluster-2"}
    assert set(summary["rounds"][0]) >= {"round", "accuracy", "loss", "bytes_intra",
                                         "bytes_inter", "seconds"}
    assert (out / "metrics.csv").read_text().count("\n") == 3
    placement = json.loads((out / "placement.json").read_text())
    assert len(placement["client_cluster"]) == 6
    from safetensors.torch import load_file

    model = load_file(str(out / "model.safetensors"))
    assert model and all(t.is_floating_point() for t in model.values())
    for png in ("accuracy.png", "traffic.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not fabricd_processes(tmp_path / "tb")


def test_ctrl_c_tears_the_testbed_down(tmp_path: Path) -> None:
    workdir = tmp_path / "tb"
    proc = subprocess.Popen(
        [SCHEDULER, "submit", str(write_job(tmp_path, 500)), "--local", "2", "--backend",
         "inprocess", "--out", str(tmp_path / "out"), "--workdir", str(workdir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    try:
        # wait until the job is really running (executors attached and rounds going)
        while time.monotonic() < deadline:
            if list(workdir.glob("cluster-*/executor-*.log")) and fabricd_processes(workdir):
                break
            time.sleep(0.5)
        time.sleep(3)
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "interrupted" in err
    assert not fabricd_processes(workdir)
    summary = tmp_path / "out" / "summary.json"  # no results: at most the progress, marked failed
    assert not summary.exists() or json.loads(summary.read_text())["status"] == "failed"
