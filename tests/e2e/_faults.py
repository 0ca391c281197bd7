"""What the e2e tests (and some benches) share: drive a job over a testbed's scheduler
daemon, find its executors, wait for a cluster to be back."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from proto.job import JobSpec
from proto.rounds import RoundRecord
from scheduler.run.driver import Driver, JobResult, Progress
from scheduler.run.mesh import BridgeChannel
from scheduler.testbed import LocalTestbed


@contextlib.contextmanager
def job_driver(tb: LocalTestbed, clusters: Any, job: JobSpec, backend: str = "inprocess",
               timeout: float = 300, **options: Any) -> Iterator[Driver]:
    """A Driver of `job` through the testbed's scheduler daemon; closed, with its channel,
    after the block."""
    channel = BridgeChannel(tb.bridge_socket("scheduler"), job_id=job.job_id)
    driver = Driver(job, clusters, channel, backend=backend, timeout=timeout, **options)
    try:
        yield driver
    finally:
        driver.close()
        channel.close()


def drive(tb: LocalTestbed, clusters: Any, job: JobSpec, progress: Progress | None = None,
          run_dir: Path | None = None, **options: Any) -> JobResult:
    """Run `job` from the testbed's scheduler daemon, calling `progress` after each round."""
    with job_driver(tb, clusters, job, progress=progress, run_dir=run_dir, **options) as driver:
        return driver.run()


def wait_connected(tb: LocalTestbed, cluster: str, timeout: float = 90.0) -> None:
    """Until the scheduler's daemon sees `cluster` in the mesh (after a restart)."""
    from scheduler.run.mesh import daemon_status

    deadline = time.monotonic() + timeout
    while not any(c["cluster_id"] == cluster and c.get("connected")
                  for c in daemon_status(tb.bridge_socket("scheduler")).get("clusters", [])):
        assert time.monotonic() < deadline, f"{cluster} did not rejoin the mesh"
        time.sleep(0.25)


def wait_for_executor(tb: LocalTestbed, cluster: str, job_id: str, timeout: float = 90) -> None:
    """Until a second executor of `job_id` on `cluster` (the first was killed) has answered
    job.start (its log says so). A returning cluster's executor starts in the background
    and joins at the next round boundary; rounds here take milliseconds, real ones long
    enough for it to start."""
    log = tb.root / cluster / f"executor-{job_id}.log"
    deadline = time.monotonic() + timeout
    while log.read_text(errors="replace").count("event=job_started") < 2:
        assert time.monotonic() < deadline, f"no new executor for {job_id} on {cluster}"
        time.sleep(0.2)
    time.sleep(0.5)  # its reply reaches the scheduler


def kill_and_restart(tb: LocalTestbed, victim: str, job_id: str,
                     events: list[str]) -> Progress:
    """A progress callback: kill `victim`'s daemon after round 2; once a round ran without
    it, restart it (same cluster.toml) and wait until the mesh sees it; after the next
    round, wait until its new executor answered job.start. `events` records each step."""

    def chaos(record: RoundRecord, total: int) -> None:
        if record.round == 2:
            tb.kill(victim)
            events.append("killed")
        elif events == ["killed"] and victim not in record.by_cluster:
            tb.restart(victim)
            wait_connected(tb, victim)
            events.append("restarted")
        elif events == ["killed", "restarted"]:
            wait_for_executor(tb, victim, job_id)
            events.append("started")

    return chaos


def executors(tb: LocalTestbed, job_id: str = "") -> dict[int, str]:
    """Live executor processes the testbed's daemons started (of `job_id` only, if given):
    pid -> cluster, in /proc's order."""
    daemons = {p.pid: name for name, p in tb.procs.items()}
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            fields = (proc / "stat").read_text().split(")")[-1].split()
            ppid = int(fields[2])
        except (OSError, ValueError, IndexError):
            continue
        if (fields[0] != "Z" and ppid in daemons and "worker.executor" in cmd
                and (not job_id or f"--job {job_id} " in cmd)):
            found[int(proc.name)] = daemons[ppid]
    return found


def executor_pid(testbed: LocalTestbed, cluster: str) -> int:
    pids = [pid for pid, name in executors(testbed).items() if name == cluster]
    assert pids, f"no executor under {cluster}'s daemon"
    return pids[0]


def kill(tb: LocalTestbed, cluster: str, what: str) -> None:
    """Kill a cluster's daemon (`what` = "daemon") or only its executor ("executor")."""
    if what == "daemon":
        tb.kill(cluster)
    else:
        os.kill(executor_pid(tb, cluster), signal.SIGKILL)
