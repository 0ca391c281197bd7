"""Starting a cluster's executor when a job reaches the daemon.

The executor is a separate process (`python -m worker.executor`): a Ray driver of the
cluster named by `ray.address` (`local` embeds a Ray, `auto`/an address joins one,
`inprocess` runs threads). The daemon only starts it — it never imports the worker — and
waits until it attaches to the bridge for the job. Its output goes to a log file next to
the config; a crash before attaching is reported to the scheduler with the log's tail.

An executor leaves when its job stops, its scheduler's lease runs out or the daemon goes;
the daemon reaps exited executors every `REAP_INTERVAL` seconds (`reap_loop`). A job whose
executor left (`detached`) may be started again under the same id at once: `ensure` waits
for the old process to finish leaving (killing it after `LEAVE_GRACE` s) first.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from fedcore.logs import get_logger

log = get_logger("fabricd.executors")

ATTACH_TIMEOUT = 180.0
#: how the allow-lists reach the executor (names shared with worker/executor/allowlist.py)
ENV_ALLOWED_MODULES = "FEDPILOT_ALLOWED_MODULES"
ENV_DATA_ROOTS = "FEDPILOT_DATA_ROOTS"
REAP_INTERVAL = 1.0
LEAVE_GRACE = 20.0


class ExecutorLauncher:
    def __init__(self, *, cluster_id: str, bridge_socket: Path, ray_address: str,
                 log_dir: Path, command: list[str] | None = None, num_cpus: float = 0.0,
                 object_store_memory: int = 0, metrics_endpoint: str = "",
                 allow_models: tuple[str, ...] = (), data_roots: tuple[Path, ...] = (),
                 datasets: tuple[tuple[str, str], ...] = (), spares: bool = True) -> None:
        self.cluster_id = cluster_id
        # The cluster operator's allow-lists, read by worker/executor/allowlist.py.
        self.env = {**os.environ, ENV_ALLOWED_MODULES: json.dumps(list(allow_models)),
                    ENV_DATA_ROOTS: json.dumps([str(r) for r in data_roots])}
        self.bridge_socket = bridge_socket
        self.ray_address = ray_address
        self.log_dir = log_dir
        self.num_cpus = num_cpus
        self.object_store_memory = object_store_memory
        self.metrics_endpoint = metrics_endpoint
        self.datasets = datasets
        self.spares = spares
        self.command = command or [sys.executable, "-m", "worker.executor"]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.detached: set[str] = set()

    def command_for(self, job_id: str) -> list[str]:
        bounds = []  # cluster.toml [ray] num_cpus / object_store_memory (embedded Ray)
        if self.num_cpus:
            bounds += ["--num-cpus", f"{self.num_cpus:g}"]
        if self.object_store_memory:
            bounds += ["--object-store-memory", str(self.object_store_memory)]
        if self.metrics_endpoint:  # cluster.toml [metrics] executor_endpoint
            bounds += ["--metrics", self.metrics_endpoint]
        if not self.spares:  # cluster.toml limits.dataplane_spare_bytes = 0: none anywhere
            bounds += ["--spare-bytes", "0"]
        for name, dataset in self.datasets:  # cluster.toml [datasets] (pinned jobs)
            bounds += ["--dataset", f"{name}={dataset}"]
        return [*self.command, "--bridge", str(self.bridge_socket), "--cluster-id",
                self.cluster_id, "--job", job_id, "--ray", self.ray_address, *bounds]

    def log_path(self, job_id: str) -> Path:
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in job_id)
        return self.log_dir / f"executor-{safe}.log"

    async def ensure(self, job_id: str, attached: Callable[[], bool],
                     timeout: float = ATTACH_TIMEOUT) -> str | None:
        """Start the job's executor unless one is attached; None once it is, else a reason."""
        if attached():
            return None
        proc = self.procs.get(job_id)
        if proc is not None and proc.poll() is None and job_id in self.detached:
            await self._finish_leaving(job_id, proc)
        self.detached.discard(job_id)
        if proc is None or proc.poll() is not None:
            path = self.log_path(job_id)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("ab") as out:
                proc = subprocess.Popen(self.command_for(job_id), stdout=out, env=self.env,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            self.procs[job_id] = proc
            log.info("executor.started", job=job_id, pid=proc.pid, ray=self.ray_address,
                     log=str(path))
        deadline = time.monotonic() + timeout
        while not attached():
            code = proc.poll()
            if code is not None:
                tail = self._tail(job_id)
                log.error("executor.exited", job=job_id, code=code, tail=tail)
                return (f"the executor for job {job_id!r} on cluster {self.cluster_id!r} exited "
                        f"with code {code} before attaching: {tail}")
            if time.monotonic() > deadline:
                return (f"the executor for job {job_id!r} on cluster {self.cluster_id!r} did "
                        f"not attach within {timeout:.0f} s (see {self.log_path(job_id)})")
            await trio.sleep(0.1)
        return None

    def _tail(self, job_id: str, lines: int = 5) -> str:
        try:
            text = self.log_path(job_id).read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:])[-800:]

    async def _finish_leaving(self, job_id: str, proc: subprocess.Popen[bytes]) -> None:
        """An executor that left the bridge is on its way out: wait, then make sure."""
        with trio.move_on_after(LEAVE_GRACE):
            while proc.poll() is None:
                await trio.sleep(0.1)
        if proc.poll() is None:
            log.warning("executor.killed", job=job_id, pid=proc.pid,
                        reason=f"still running {LEAVE_GRACE:.0f} s after leaving the bridge")
            proc.kill()
            await trio.to_thread.run_sync(proc.wait)

    def left(self, job_id: str) -> None:
        """The job's executor left the bridge (job stopped, lease expired, crashed)."""
        if job_id in self.procs:
            self.detached.add(job_id)

    def reap(self) -> list[str]:
        """Forget executors that exited; the jobs they ran."""
        gone = []
        for job_id, proc in list(self.procs.items()):
            if proc.poll() is not None:
                log.info("executor.finished", job=job_id, code=proc.returncode)
                del self.procs[job_id]
                self.detached.discard(job_id)
                gone.append(job_id)
        return gone

    async def reap_loop(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Reap exited executors until cancelled (no zombie outlives its job for long)."""
        task_status.started()
        while True:
            self.reap()
            await trio.sleep(REAP_INTERVAL)

    def stop_all(self, grace: float = 5.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
