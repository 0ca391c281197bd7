"""Leases both ways over real daemons: a scheduler killed mid-job leaves nothing behind.

`kill -9` of `fedpilot-scheduler submit` mid-job: every cluster's executor notices its
lease ran out, releases its actors and exits; the daemons forget the job (delivered
message ids included), so the same job id submitted again runs to the end. An executor
whose daemon was killed exits on its own.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from scheduler.run.mesh import daemon_status
from scheduler.testbed import LocalTestbed
from tests.e2e._faults import executors

pytestmark = pytest.mark.slow

SCHEDULER = str(Path(sys.executable).with_name("fedpilot-scheduler"))
LEASE = 4
ROUNDS = 12
JOB = f"""
[job]
id = "lease-job"
seed = 3
[data]
number_of_clients = 4
[training]
federated_learning_rounds = {{rounds}}
number_of_epochs = 1
[topology]
kind = "star"
[placement]
strategy = "round_robin"
max_materialized = 2
[faults]
lease_seconds = {LEASE}
checkpoint_every = 1
"""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(check: Any, limit: float, what: str) -> float:
    """Poll `check` until true; the seconds it took (fails after `limit`)."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > limit:
            pytest.fail(f"{what}: not within {limit:.0f} s")
        time.sleep(0.2)
    return time.monotonic() - start


def rounds_done(out: Path) -> int:
    try:
        return len(json.loads((out / "summary.json").read_text()).get("rounds", []))
    except (OSError, ValueError):
        return 0


def submit(job: Path, testbed: LocalTestbed, out: Path, *extra: str
           ) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.Popen(
        [SCHEDULER, "submit", str(job), "--mesh", str(testbed.configs["scheduler"]),
         "--out", str(out), "--quiet", "--round-timeout", "120", *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.fixture()
def testbed(tmp_path: Path) -> Any:
    with LocalTestbed(2, backend="inprocess", workdir=str(tmp_path / "tb"), capacity=3) as tb:
        tb.start(timeout=60)
        yield tb


def test_killed_scheduler_releases_every_executor_and_the_job_runs_again(
        testbed: LocalTestbed, tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(rounds=ROUNDS))
    out = tmp_path / "first"
    proc = submit(job, testbed, out)
    try:
        wait_until(lambda: rounds_done(out) >= 2 or proc.poll() is not None, 180,
                   "the first submit reaching round 2")
        assert proc.poll() is None, proc.communicate()[0].decode()[-2000:]
        running = executors(testbed, "lease-job")
        assert len(running) == 2, running  # one per cluster: the scan sees them
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    gone_after = wait_until(lambda: not executors(testbed, "lease-job"), 30,
                            "every executor exiting after its scheduler was killed")
    assert gone_after >= LEASE - 1  # they left because the lease ran out, not before
    for name in testbed.cluster_ids:
        clients = daemon_status(testbed.bridge_socket(name))["bridge_clients"]
        assert not [c for c in clients if c["job_id"] == "lease-job"], clients
    # the same job id again, resumed from its last checkpoint to the end (the daemons
    # forgot the first run's message ids)
    again = submit(job, testbed, out, "--resume", str(out))
    output, _ = again.communicate(timeout=300)
    assert again.returncode == 0, output.decode()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert [r["round"] for r in summary["rounds"]] == list(range(1, ROUNDS + 1))
    with (out / "metrics.csv").open() as f:
        assert [int(row["round"]) for row in csv.DictReader(f)] == list(range(1, ROUNDS + 1))
    assert (out / "model.safetensors").stat().st_size > 0
    # and a fresh run of the same id, from round 1
    fresh = submit(job, testbed, tmp_path / "fresh")
    output, _ = fresh.communicate(timeout=300)
    assert fresh.returncode == 0, output.decode()[-3000:]


def test_executor_whose_daemon_died_exits(testbed: LocalTestbed, tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(rounds=400).replace("lease_seconds = 4", "lease_seconds = 600")
                   .replace("checkpoint_every = 1", "checkpoint_every = 0"))
    out = tmp_path / "run"
    proc = submit(job, testbed, out)
    try:
        wait_until(lambda: rounds_done(out) >= 2 or proc.poll() is not None, 180,
                   "the job reaching round 2")
        victim = testbed.cluster_ids[0]
        mine = [pid for pid, name in executors(testbed, "lease-job").items() if name == victim]
        assert len(mine) == 1
        os.kill(testbed.procs[victim].pid, signal.SIGKILL)  # the daemon only
        # the lease is 600 s: only the lost bridge can make it leave this soon (it is
        # nobody's child now, so it is checked by pid)
        wait_until(lambda: not alive(mine[0]), 30, "the executor of the killed daemon exiting")
    finally:
        proc.kill()
        proc.wait()
