"""The scheduler's side of the lease with every cluster's executor, and loss detection.

A thread sends `job.lease` {lease} to every cluster every `interval` seconds (at most
2 s, at most a third of the lease). The executor renews its lease on arrival (an
executor whose lease runs out releases its actors and exits: worker/executor/__main__.py),
and its answer tells the scheduler the cluster is still there. Once a cluster has
answered a first time (a lease, or any request of the job: its job.start), it is **lost** when
- the scheduler's daemon no longer sees it connected (mesh connection or heartbeats
  gone: `clusters[].connected` of the daemon status) and it has not answered a lease for
  half the lease (a heartbeat late under load, or an executor busy for seconds in a
  job.start that holds the GIL, is not a loss) while another cluster answered since (all
  silent at once: the scheduler's own host stalled, e.g. starved of CPU, as readily as
  they all died), or
- two renewals in a row failed (its daemon refused: the executor is gone; or it could
  not be reached), or
- it has not answered for `lease` seconds.
So a lost cluster is noticed within seconds, not by a round timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proto.control import JobLease
from scheduler.errors import JobFailed

if TYPE_CHECKING:
    from scheduler.run.channel import ClusterChannel

log = logging.getLogger("fedpilot.scheduler")

MISSES = 2  # failed renewals in a row that make a cluster lost


class ClusterLost(JobFailed):
    """One or more clusters are gone (the message says which and how it was noticed)."""

    def __init__(self, lost: dict[str, Loss], during: str,
                 pending: Mapping[str, Future[Any]] | None = None, note: str = "") -> None:
        self.lost = lost
        self.during = during
        #: the requests of the interrupted fan-out (a survivor's may still be running)
        self.pending = dict(pending or {})
        what = "; ".join(f"cluster {cid}: {loss.reason} (noticed {loss.detect_seconds:.1f} s "
                         "after it last answered)" for cid, loss in sorted(lost.items()))
        super().__init__(f"lost during {during}: {what}" + (f" ({note})" if note else ""))


@dataclass(frozen=True)
class Loss:
    reason: str
    last_seen: float        # monotonic time of its last lease answer
    detected: float         # monotonic time the loss was noticed

    @property
    def detect_seconds(self) -> float:
        return self.detected - self.last_seen


class LeaseKeeper:
    def __init__(self, channel: ClusterChannel, job_id: str, clusters: Sequence[str], *,
                 lease: float, connected: Callable[[], dict[str, bool]] | None = None) -> None:
        self.channel = channel
        self.job_id = job_id
        self.lease = lease
        self._body = JobLease(job_id, lease=lease).to_body()  # refused here if out of range
        self.interval = min(2.0, max(0.5, lease / 3))
        self._connected = connected
        self._lock = threading.Lock()
        now = time.monotonic()
        self._answered: dict[str, float] = dict.fromkeys(clusters, now)
        self._armed: set[str] = set()
        self._misses: dict[str, list[str]] = {}
        self._lost: dict[str, Loss] = {}
        self._checked = 0.0  # monotonic time of the last verdict (_check)
        self._stop = threading.Event()
        self._pass_now = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(clusters) + 1),
                                        thread_name_prefix="lease")
        self._inflight: dict[str, Future[None]] = {}
        self._thread = threading.Thread(target=self._loop, name="lease-keeper", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    # -- what the driver asks ---------------------------------------------------------------
    def lost(self) -> dict[str, Loss]:
        """Clusters found gone (until `watch`ed again)."""
        with self._lock:
            return dict(self._lost)

    def answered_at(self, cluster_id: str) -> float:
        """Monotonic time of the cluster's last lease answer (0 if it is not watched)."""
        with self._lock:
            return self._answered.get(cluster_id, 0.0)

    def checked_at(self) -> float:
        """Monotonic time of the keeper's last verdict: a cluster armed and silent since
        before `t` is in `lost()` once `checked_at() > t + lease` (read this first)."""
        with self._lock:
            return self._checked

    def renew_now(self) -> None:
        """Renew every lease now, not at the next pass (a job.start that fails right after
        the keeper started waited its first interval, 2 s, for the answers)."""
        self._pass_now.set()

    def watch(self, cluster_id: str) -> None:
        """Hold a lease with `cluster_id` (again: a returning cluster), counting from now."""
        with self._lock:
            self._answered[cluster_id] = time.monotonic()
            self._armed.discard(cluster_id)
            self._misses.pop(cluster_id, None)
            self._lost.pop(cluster_id, None)

    def heard_from(self, cluster_id: str) -> None:
        """The cluster's executor answered another request (its job.start, a round): as
        good as a lease answer. A cluster killed before its first renewal came back (rounds
        of milliseconds, or a first renewal refused while its executor started) was never
        armed, so never found lost: the job failed on the request to it instead of going on."""
        with self._lock:
            if cluster_id in self._answered:
                self._answered[cluster_id] = max(self._answered[cluster_id], time.monotonic())
                self._armed.add(cluster_id)
                self._misses.pop(cluster_id, None)

    def forget(self, cluster_id: str) -> None:
        with self._lock:
            self._answered.pop(cluster_id, None)
            self._armed.discard(cluster_id)
            self._misses.pop(cluster_id, None)

    # -- the thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._pass_now.wait(self.interval)
            self._pass_now.clear()
            if self._stop.is_set():
                return
            with self._lock:
                clusters = list(self._answered)
            for cid in clusters:
                running = self._inflight.get(cid)
                if running is not None and not running.done():
                    continue  # the previous renewal is still on its way: do not pile up
                try:
                    self._inflight[cid] = self._pool.submit(self._renew, cid)
                except RuntimeError:  # stop() shut the pool down during this pass
                    return
            self._check(clusters)

    def _check(self, clusters: list[str]) -> None:
        connected: dict[str, bool] = {}
        if self._connected is not None:
            try:
                connected = self._connected()
            except JobFailed as exc:  # our own daemon is unreachable: nothing to conclude
                log.warning("event=mesh_status_unavailable reason=%s", exc)
        now = time.monotonic()
        quiet = max(2 * self.interval, self.lease / 2)
        with self._lock:
            for cid in clusters:
                if cid not in self._armed or cid in self._lost or cid not in self._answered:
                    continue
                reason = ""
                silent = now - self._answered[cid]
                # a heartbeat late on a loaded machine flips `connected` for a moment: the
                # mesh's word counts once the lease has gone unanswered too
                # ... and while another cluster answered after it fell silent (all silent
                # at once: the scheduler's own host more likely stalled; the lease tells)
                others = max((t for o, t in self._answered.items()
                              if o != cid and o in self._armed), default=0.0)
                if (connected and not connected.get(cid, False) and silent > quiet
                        and others > self._answered[cid] + self.interval):
                    reason = "its daemon left the mesh (connection or heartbeats lost)"
                    if self._misses.get(cid):  # why, as far as a renewal could tell
                        reason += f"; the last lease renewal failed: {self._misses[cid][-1]}"
                elif len(self._misses.get(cid, [])) >= MISSES:
                    reason = f"{MISSES} lease renewals failed: {self._misses[cid][-1]}"
                elif now - self._answered[cid] > self.lease:
                    reason = f"no lease answer for {now - self._answered[cid]:.1f} s"
                if reason:
                    self._lost[cid] = Loss(reason, self._answered[cid], now)
                    log.warning("event=cluster_lost job=%s cluster=%s reason=%s", self.job_id,
                                cid, reason)
            self._checked = now

    def _renew(self, cluster_id: str) -> None:
        try:
            self.channel.request(cluster_id, self._body, self.lease)
        except JobFailed as exc:
            with self._lock:
                if cluster_id in self._armed:
                    self._misses.setdefault(cluster_id, []).append(str(exc))
            log.info("event=lease_missed cluster=%s reason=%s", cluster_id, exc)
            return
        with self._lock:
            if cluster_id in self._answered:
                self._answered[cluster_id] = time.monotonic()
                self._armed.add(cluster_id)
                self._misses.pop(cluster_id, None)

    def stop(self) -> None:
        """End the leases: the keeper's thread is joined (it is between two passes within
        a moment) before its pool is shut down, so no renewal starts after this."""
        self._stop.set()
        self._pass_now.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, 2 * self.interval))
        self._pool.shutdown(wait=False, cancel_futures=True)
