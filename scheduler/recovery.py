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
  ids. Survivors keep their own nodes' state. `summary.faults` records it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from proto.routing import RoutingMatrix
from scheduler.checkpoint import Checkpoint, write_checkpoint
from scheduler.clusters import ClusterSlot
from scheduler.errors import CapacityError, JobFailed
from scheduler.leases import ClusterLost, LeaseKeeper

if TYPE_CHECKING:
    from proto.job import JobSpec
    from scheduler.driver import ClusterChannel, ClusterInfo
    from scheduler.plan import Plan
    from scheduler.results import JobSummary

log = logging.getLogger("fedpilot.scheduler")


def node_clusters(routing: RoutingMatrix) -> dict[str, str]:
    """Every node's cluster in a plan."""
    return {routing.node_name(i): routing.clusters[int(k)]
            for i, k in enumerate(routing.node_cluster.tolist())}


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

    def _all(self, bodies: Mapping[str, dict[str, Any]], timeout: float | None = None
             ) -> dict[str, dict[str, Any]]:
        raise NotImplementedError

    def _job_body(self, kind: str, **extra: Any) -> dict[str, Any]:
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
        replies = self._all({c.cluster_id: self._job_body("job.checkpoint", round=r,
                                                          to_cluster=here)
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

    def _restore(self, plan: Plan, models: Mapping[str, bytes]) -> None:
        """Stream checkpointed node states to the clusters the plan places them on (as
        update streams, like migrating nodes) and have them adopted."""
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
        self._all({cid: self._job_body("job.restore", phase="expect", source_cluster=here,
                                       nodes=nodes) for cid, nodes in by_cluster.items()})
        self._restores += 1
        for node, payload in models.items():
            send(target_cluster=where[node], job_id=self.spec.job_id, round=0,
                 source_node=node, target_node="restore",
                 message_id=f"{self.spec.job_id}/0/restore-{self._restores}/{node}/restore",
                 payload=payload, timeout=self.timeout)
        self._all({cid: self._job_body("job.restore", phase="apply") for cid in by_cluster})

    # -- a lost cluster ------------------------------------------------------------------
    def _recover(self, lost: ClusterLost, r: int, plan: Plan, histograms: np.ndarray,
                 summary: JobSummary) -> Plan:
        started = time.monotonic()
        gone = set(lost.lost)
        survivors = [c for c in self.clusters if c.cluster_id not in gone]
        minimum = self.spec.faults.min_clusters
        if len(survivors) < minimum:
            raise JobFailed(f"{lost}; {len(survivors)} cluster(s) left "
                            f"({', '.join(c.cluster_id for c in survivors) or 'none'}), "
                            f"[faults] min_clusters = {minimum}: missing "
                            f"{', '.join(sorted(gone))}")
        log.warning("event=recovering job=%s round=%d lost=%s", self.spec.job_id, r,
                    ",".join(sorted(gone)))
        # end the interrupted round on the survivors and wait until their engines stopped
        reason = f"round {r} is repeated without cluster(s) {', '.join(sorted(gone))}"
        self._all({c.cluster_id: self._job_body("round.abort", round=r, reason=reason)
                   for c in survivors}, timeout=60)
        running = [f for cid, f in lost.pending.items() if cid not in gone]
        wait(running, timeout=self.timeout)
        if self.leases is not None:
            for cid in gone:
                self.leases.forget(cid)
        before = node_clusters(plan.routing)
        self.clusters = survivors
        self._slots = [s for s in self._slots if s.cluster_id not in gone]
        self._epoch += 1
        try:
            new_plan = self._replan(histograms, self._slots, self._epoch)
        except CapacityError as exc:
            raise JobFailed(f"{lost}; the surviving clusters cannot hold the job's clients: "
                            f"{exc}") from None
        kept = {n: c for n, c in before.items() if c not in gone}
        moved = self._migrate(kept, new_plan)
        orphans = sorted(n for n, c in before.items() if c in gone)
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
                "detect_seconds": round(loss.detect_seconds, 3),
                "recover_seconds": round(time.monotonic() - started, 3)})
        log.warning("event=recovered job=%s round=%d epoch=%d restored=%d seconds=%.2f",
                    self.spec.job_id, r, self._epoch, len(restored),
                    time.monotonic() - started)
        return new_plan
