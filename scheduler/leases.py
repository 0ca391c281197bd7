"""The scheduler's side of the lease with every cluster's executor.

A thread sends `job.lease` {lease} to every cluster every `lease / 3` seconds. The
executor renews its lease on arrival (an executor whose lease runs out releases its
actors and exits: see worker/executor/__main__.py), and its answer tells the scheduler
the cluster is still there: a cluster that has not answered for `lease` seconds is
reported by `silent()`, so a lost cluster is noticed in seconds, not by a round timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from scheduler.errors import JobFailed

if TYPE_CHECKING:
    from scheduler.driver import ClusterChannel

log = logging.getLogger("fedpilot.scheduler")


class LeaseKeeper:
    def __init__(self, channel: ClusterChannel, job_id: str, clusters: Sequence[str], *,
                 lease: float) -> None:
        self.channel = channel
        self.job_id = job_id
        self.lease = lease
        self.interval = max(0.5, lease / 3)
        now = time.monotonic()
        self._lock = threading.Lock()
        self._answered: dict[str, float] = dict.fromkeys(clusters, now)
        self._reason: dict[str, str] = {}
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(clusters)),
                                        thread_name_prefix="lease")
        self._inflight: dict[str, Future[None]] = {}
        self._thread = threading.Thread(target=self._loop, name="lease-keeper", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def watch(self, cluster_id: str) -> None:
        """Hold a lease with `cluster_id` too (a returning cluster), counting from now."""
        with self._lock:
            self._answered[cluster_id] = time.monotonic()
            self._reason.pop(cluster_id, None)

    def forget(self, cluster_id: str) -> None:
        with self._lock:
            self._answered.pop(cluster_id, None)
            self._reason.pop(cluster_id, None)

    def silent(self) -> dict[str, str]:
        """Clusters that have not answered a lease for `lease` seconds, with why."""
        now = time.monotonic()
        with self._lock:
            return {cid: (f"no lease answer for {now - t:.1f} s"
                          + (f" (last error: {self._reason[cid]})" if cid in self._reason else ""))
                    for cid, t in self._answered.items() if now - t > self.lease}

    def silent_for(self, cluster_id: str) -> float:
        with self._lock:
            t = self._answered.get(cluster_id)
        return 0.0 if t is None else time.monotonic() - t

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                clusters = list(self._answered)
            for cid in clusters:
                running = self._inflight.get(cid)
                if running is not None and not running.done():
                    continue  # the previous renewal is still on its way: do not pile up
                self._inflight[cid] = self._pool.submit(self._renew, cid)

    def _renew(self, cluster_id: str) -> None:
        body = {"kind": "job.lease", "job_id": self.job_id, "lease": self.lease}
        try:
            self.channel.request(cluster_id, body, self.lease)
        except JobFailed as exc:
            with self._lock:
                if cluster_id in self._answered:
                    self._reason[cluster_id] = str(exc)
            log.info("event=lease_missed cluster=%s reason=%s", cluster_id, exc)
            return
        with self._lock:
            if cluster_id in self._answered:
                self._answered[cluster_id] = time.monotonic()
                self._reason.pop(cluster_id, None)

    def stop(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
