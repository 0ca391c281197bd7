"""What the driver does to carry on: checkpoints, restores, and going on without a cluster.

A `Recovery` mixin of `Driver` (kept apart so the round loop stays readable):
- `_checkpoint`: every cluster streams its nodes' states to the scheduler (update streams,
  one payload per node: model + aggregator server state); written atomically;
- `_restore`: checkpointed node states stream back to the clusters a plan places them on,
  the way migrating nodes move (`job.restore` expect -> streams -> apply);
- `_recover`: a cluster was lost mid-round with `[faults] on_cluster_loss = "continue"`:
  the survivors' round is aborted, the lost cluster's nodes are re-planned onto the
  survivors (placement epoch + 1, within their capacity; survivors' nodes that move
  migrate with their state), the lost nodes are restored from the last checkpoint (from
  the initial model if there is none yet), and the round is run again with fresh message
  ids. Survivors keep their own nodes' state. `summary.faults` records it;
- `_readmit`: at a round boundary, a lost cluster whose daemon is back in the mesh (restarted
  with the same config) gets a fresh executor (`job.start`), joins the placement again
  (epoch + 1: nodes the plan gives back to it migrate there from the survivors with their
  state) and trains from the next round on. Below `[faults] min_clusters` survivors,
  `_recover` waits up to `return_wait` seconds for lost clusters to come back the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from proto.control import JobCheckpoint, JobRestore, JobStart, JobStop, RoundAbort
from proto.routing import RoutingMatrix
from scheduler.errors import CapacityError, JobFailed
from scheduler.planning.clusters import ClusterSlot
from scheduler.run.checkpoint import Checkpoint, write_checkpoint
from scheduler.run.leases import ClusterLost, LeaseKeeper

RETURN_START_TIMEOUT = 120.0  # seconds a returning cluster gets to start its executor
MAX_RETURNS = 3  # a cluster lost again after this many returns is not re-admitted

if TYPE_CHECKING:
    from proto.job import JobSpec
    from scheduler.planning.plan import Plan
    from scheduler.run.channel import ClusterChannel, ClusterInfo
    from scheduler.rundir.results import JobSummary

log = logging.getLogger("fedpilot.scheduler")


def node_clusters(routing: RoutingMatrix) -> dict[str, str]:
    """Every node's cluster in a plan."""
    return {routing.node_name(i): routing.clusters[int(k)]
            for i, k in enumerate(routing.node_cluster.tolist())}


@dataclass
class Departed:
    """A cluster lost during the job, until it returns."""

    info: ClusterInfo
    slot: ClusterSlot
    lost_at: float          # monotonic time it was found lost
    #: its new executor starting (job.start in the background: an embedded Ray takes
    #: seconds to start, and the survivors' rounds go on meanwhile); when it began
    starting: Future[bool] | None = None
    start_began: float = 0.0


def privacy_key(reply: Mapping[str, Any]) -> bytes:
    """The X25519 public key in a job.start reply ([privacy] secure_aggregation), or b''."""
    info = reply.get("privacy")
    key = info.get("key") if isinstance(info, Mapping) else None
    return bytes(key) if isinstance(key, bytes | bytearray) else b""


class Recovery:
    # provided by Driver
    spec: JobSpec
    channel: ClusterChannel
    clusters: list[ClusterInfo]
    leases: LeaseKeeper | None
    run_dir: Path | None
    timeout: float
    _restores: int
    _attempt: int
    _epoch: int
    _slots: list[ClusterSlot]
    _last_models: dict[str, bytes]
    _pinned: list[str] | None
    _departed: dict[str, Departed]
    _pool: ThreadPoolExecutor
    _privacy_keys: dict[str, bytes]

    def _all(self, bodies: Mapping[str, dict[str, Any]], timeout: float | None = None
             ) -> dict[str, dict[str, Any]]:
        raise NotImplementedError

    def _migrate(self, before: Mapping[str, str], plan: Plan) -> int:
        raise NotImplementedError

    def _replan(self, histograms: np.ndarray, slots: list[ClusterSlot], epoch: int) -> Plan:
        raise NotImplementedError

    # -- checkpoints ---------------------------------------------------------------------
    def _checkpoint(self, r: int, plan: Plan, summary: JobSummary) -> None:
        """Every cluster streams its nodes' states here; written atomically."""
        assert self.run_dir is not None
        here = self.channel.local_cluster
        replies = self._all({c.cluster_id: JobCheckpoint(self.spec.job_id, round=r,
                                                          to_cluster=here).to_body()
                             for c in self.clusters})
        models = {str(node): self.channel.take_update(self.spec.job_id, str(node), self.timeout)
                  for reply in replies.values() for node in reply.get("nodes", {})}
        path = write_checkpoint(self.run_dir, Checkpoint(
            round=r, epoch=plan.routing.epoch, spec=self.spec.to_dict(),
            rounds=[rec.to_dict() for rec in summary.rounds], models=models,
            replans=summary.replans, migrations=summary.migrations,
            faults=list(summary.faults)))
        self._last_models = models
        log.info("event=checkpoint job=%s round=%d nodes=%d path=%s", self.spec.job_id, r,
                 len(models), path)

    def _restore(self, plan: Plan, models: Mapping[str, bytes], *, whole: bool = False) -> None:
        """Stream checkpointed node states to the clusters the plan places them on (as
        update streams, like migrating nodes) and have them adopted. `whole`: every node of
        the job resumes from this checkpoint, so the compression references its nodes
        hold (both ends of every edge) are taken back too."""
        send = getattr(self.channel, "send_update", None)
        if send is None:
            raise JobFailed("this channel cannot stream checkpoints to clusters")
        where = node_clusters(plan.routing)
        unknown = sorted(set(models) - set(where))
        if unknown:
            raise JobFailed(f"the checkpoint holds nodes {unknown[:5]} that the plan does not have")
        by_cluster: dict[str, list[str]] = {}
        for node in models:
            by_cluster.setdefault(where[node], []).append(node)
        here = self.channel.local_cluster
        self._all({cid: JobRestore(self.spec.job_id, phase="expect", source_cluster=here,
                                   nodes=tuple(nodes)).to_body() for cid, nodes in by_cluster.items()})
        self._restores += 1
        for node, payload in models.items():
            send(target_cluster=where[node], job_id=self.spec.job_id, round=0,
                 source_node=node, target_node="restore",
                 message_id=f"{self.spec.job_id}/0/restore-{self._restores}/{node}/restore",
                 payload=payload, timeout=self.timeout)
        self._all({cid: JobRestore(self.spec.job_id, phase="apply", codec=whole).to_body()
                   for cid in by_cluster})

    # -- a lost cluster ------------------------------------------------------------------
    def _recover(self, lost: ClusterLost, r: int, plan: Plan, histograms: np.ndarray,
                 summary: JobSummary) -> Plan:
        started = time.monotonic()
        gone = set(lost.lost)
        survivors = [c for c in self.clusters if c.cluster_id not in gone]
        for c in self.clusters:
            if c.cluster_id in gone:
                slot = next(s for s in self._slots if s.cluster_id == c.cluster_id)
                self._departed[c.cluster_id] = Departed(c, slot, started)
        log.warning("event=recovering job=%s round=%d lost=%s", self.spec.job_id, r,
                    ",".join(sorted(gone)))
        # end the interrupted round on the survivors and wait until their engines stopped
        reason = f"round {r} is repeated without cluster(s) {', '.join(sorted(gone))}"
        self._all({c.cluster_id: RoundAbort(self.spec.job_id, round=r, reason=reason).to_body()
                   for c in survivors}, timeout=60)
        running = [f for cid, f in lost.pending.items() if cid not in gone]
        wait(running, timeout=self.timeout)
        if self.leases is not None:
            for cid in gone:
                self.leases.forget(cid)
        before = node_clusters(plan.routing)
        minimum = self.spec.faults.min_clusters
        returned: list[str] = []
        if len(survivors) < minimum:
            returned = self._await_returns(minimum - len(survivors), r, summary)
            if len(survivors) + len(returned) < minimum:
                left = [c.cluster_id for c in survivors]
                raise JobFailed(
                    f"{lost}; {len(left)} cluster(s) left ({', '.join(left) or 'none'}), "
                    f"[faults] min_clusters = {minimum}: missing "
                    f"{', '.join(sorted(self._departed))} (none came back within [faults] "
                    f"return_wait = {self.spec.faults.return_wait:g} s)")
        self.clusters = survivors
        self._slots = [s for s in self._slots if s.cluster_id not in gone]
        back = self._rejoin(returned)
        self._epoch += 1
        try:
            new_plan = self._replan(histograms, self._slots, self._epoch)
        except CapacityError as exc:
            raise JobFailed(f"{lost}; the surviving clusters cannot hold the job's clients: "
                            f"{exc}") from None
        # nodes of a lost cluster start again from the checkpoint, wherever they go now
        # (also onto the same cluster come back: its new executor holds nothing). A node
        # the new plan does not have stays behind: hybrid's group of the lost cluster
        # (g:<cluster>), whose clients now belong to the surviving groups
        kept = {n: c for n, c in before.items() if c not in gone}
        moved = self._migrate(kept, new_plan)
        planned = node_clusters(new_plan.routing)
        orphans = sorted(n for n, c in before.items() if c in gone and n in planned)
        restored = {n: self._last_models[n] for n in orphans if n in self._last_models}
        if restored:
            self._restore(new_plan, restored)
        self._attempt += 1
        after = node_clusters(new_plan.routing)
        for cid, loss in sorted(lost.lost.items()):
            nodes = [n for n, c in before.items() if c == cid]
            summary.faults.append({
                "round": r, "cluster": cid, "event": "lost", "reason": loss.reason,
                "nodes_moved": len(nodes),
                "moved_to": sorted({after[n] for n in nodes if n in after}),
                "restored_from_checkpoint": sum(1 for n in nodes if n in restored),
                "survivor_nodes_moved": moved,
                # the clients the survivors could not hold (they train again on a return)
                "clients_sitting_out": len(new_plan.placement.absent),
                "detect_seconds": round(loss.detect_seconds, 3),
                "recover_seconds": round(time.monotonic() - started, 3)})
        self._record_returns(back, r, after, summary, started, len(new_plan.placement.absent))
        log.warning("event=recovered job=%s round=%d epoch=%d restored=%d seconds=%.2f",
                    self.spec.job_id, r, self._epoch, len(restored),
                    time.monotonic() - started)
        return new_plan

    # -- a cluster that comes back -------------------------------------------------------
    def _readmit(self, r: int, plan: Plan, histograms: np.ndarray, summary: JobSummary) -> Plan:
        """Before round `r`: lost clusters whose daemons are back in the mesh join again
        (a fresh executor, a new placement epoch; the nodes it gets migrate to it). Their
        executors start in the background; a cluster joins at the first round boundary
        after its executor answered job.start."""
        # a cluster that keeps failing (e.g. an executor killed for memory every round) is
        # not taken back for ever: after MAX_RETURNS returns it stays out
        idle = [cid for cid, d in self._departed.items() if d.starting is None
                and sum(1 for f in summary.faults
                        if f["cluster"] == cid and f["event"] == "returned") < MAX_RETURNS]
        self._start_returning(idle, r)
        returned = [cid for cid in sorted(self._departed) if self._started(cid)]
        if not returned:
            return plan
        started = min(self._departed[cid].start_began for cid in returned)
        before = node_clusters(plan.routing)
        back = self._rejoin(returned)
        self._epoch += 1
        try:
            new_plan = self._replan(histograms, self._slots, self._epoch)
        except CapacityError as exc:  # cannot happen with more room than before; be clear
            raise JobFailed(f"re-admitting {', '.join(returned)}: {exc}") from None
        self._migrate(before, new_plan)
        summary.replans += 1
        self._record_returns(back, r, node_clusters(new_plan.routing), summary, started,
                             len(new_plan.placement.absent))
        log.warning("event=readmitted job=%s round=%d clusters=%s epoch=%d", self.spec.job_id,
                    r, ",".join(returned), self._epoch)
        return new_plan

    def _start_returning(self, idle: list[str], r: int) -> None:
        """Start a fresh executor (in the background) on each of these lost clusters that
        the mesh sees again."""
        for cid in self._reachable(idle):
            departed = self._departed[cid]
            departed.start_began = time.monotonic()
            departed.starting = self._pool.submit(self._start_again, cid, r)

    def _stop_returning(self) -> dict[str, Future[dict[str, Any]]]:
        """The job ends: stop the executors that lost clusters started to come back (best
        effort, not waited for; one still starting exits when its lease runs out)."""
        stop = JobStop(self.spec.job_id).to_body()
        return {cid: self._pool.submit(self.channel.request, cid, stop, 10.0)
                for cid, d in self._departed.items() if d.starting is not None}

    def _started(self, cid: str, timeout: float = 0.0) -> bool:
        """Whether the returning cluster's executor has started (waiting up to `timeout`);
        a start that failed is forgotten, to be tried again."""
        departed = self._departed[cid]
        if departed.starting is None:
            return False
        try:
            ok = departed.starting.result(timeout=timeout)
        except FutureTimeout:
            return False
        except Exception as exc:  # noqa: BLE001 - a failed start is retried, not fatal
            log.warning("event=return_failed job=%s cluster=%s reason=%s", self.spec.job_id,
                        cid, exc)
            ok = False
        if not ok:
            departed.starting = None
        return ok

    def _reachable(self, candidates: list[str]) -> list[str]:
        """Which of these clusters the scheduler's daemon sees connected to the mesh again."""
        connected = getattr(self.channel, "connected", None)
        if connected is None or not candidates:
            return []
        try:
            now = connected()
        except JobFailed as exc:
            log.info("event=mesh_status_unavailable reason=%s", exc)
            return []
        return sorted(cid for cid in candidates if now.get(cid))

    def _start_again(self, cid: str, r: int) -> bool:
        """A fresh executor for the job on a returned cluster; False (try again later) if it
        cannot start one yet. A leftover executor of this job there is stopped first."""
        try:
            self.channel.request(cid, JobStop(self.spec.job_id).to_body(), 10.0)
        except JobFailed:
            pass  # the usual case: the restarted daemon runs no executor for the job
        try:
            # pinned data: the returning cluster builds its own clients (its block) again
            mine = [i for i, c in enumerate(self._pinned or ()) if c == cid]
            reply = self.channel.request(cid, JobStart(self.spec.job_id,
                                                       job=self.spec.to_dict(),
                                                       clients=tuple(mine)).to_body(),
                                         min(self.timeout, RETURN_START_TIMEOUT))
        except JobFailed as exc:
            log.warning("event=return_refused job=%s round=%d cluster=%s reason=%s",
                        self.spec.job_id, r, cid, exc)
            return False
        key = privacy_key(reply)
        if key:  # its fresh executor masks with a fresh key: the next plan carries it
            self._privacy_keys[cid] = key
        if self.leases is not None:
            self.leases.watch(cid)
        return True

    def _await_returns(self, need: int, r: int, summary: JobSummary) -> list[str]:
        """Below min_clusters: wait up to `return_wait` for `need` lost clusters to return
        and start again; the ones that did."""
        deadline = time.monotonic() + self.spec.faults.return_wait
        log.warning("event=waiting_for_clusters job=%s round=%d need=%d seconds=%g",
                    self.spec.job_id, r, need, self.spec.faults.return_wait)
        back: list[str] = []
        while True:
            idle = [cid for cid, d in self._departed.items() if cid not in back and d.starting is None]
            self._start_returning(idle, r)
            back += [cid for cid in sorted(self._departed)
                     if cid not in back and self._started(cid, timeout=0.5)]
            if len(back) >= need or time.monotonic() >= deadline:
                return back
            time.sleep(0.5)

    def _rejoin(self, returned: list[str]) -> dict[str, Departed]:
        """Returned clusters take part again (in the next plan)."""
        back = {cid: self._departed.pop(cid) for cid in returned}
        self.clusters = self.clusters + [d.info for d in back.values()]
        self._slots = self._slots + [d.slot for d in back.values()]
        return back

    def _record_returns(self, back: Mapping[str, Departed], r: int, after: Mapping[str, str],
                        summary: JobSummary, started: float, sitting_out: int = 0) -> None:
        for cid, departed in back.items():
            summary.faults.append({
                "round": r, "cluster": cid, "event": "returned",
                "nodes_moved": sum(1 for c in after.values() if c == cid),
                "clients_sitting_out": sitting_out,
                "moved_to": [cid],
                "away_seconds": round(started - departed.lost_at, 3),
                "recover_seconds": round(time.monotonic() - started, 3)})
