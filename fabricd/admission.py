"""Admission rules for incoming updates: who may send what, and how slowly.

- Dedup is keyed on (authenticated sender cluster, message id): a member that sends
  first under another node's predictable message id cannot make the genuine update be
  acked as a "duplicate".
- Placement: the daemon learns each job's routing matrix from the ``job.plan`` it relays
  to its executor (owner-checked, see fabricd.control) and refuses an update whose
  source node the matrix does not place on the authenticated sending cluster, or whose
  message id names another source than its header.
- Scheduler: the scheduler's daemon records every ``job.plan`` it sent and takes the
  job's final model and checkpointed states only from the plans' clusters, each node's
  only from the cluster a recent plan places it on, so a member (in the job or not)
  cannot slip its own model in under the root aggregator's name.
- Rate: a transfer must keep above ``min_rate`` bytes/s (after a short grace), so
  slow-loris senders cannot hold the in-flight budget; and one peer may hold at most
  half of that budget.
"""

from __future__ import annotations

import time
from typing import Any

from fabricd._bounded import BoundedDict
from fedcore.logs import get_logger
from proto.errors import ProtocolError
from proto.ids import PROBE_JOB_ID
from proto.messages import UpdateHeader
from proto.routing import RoutingMatrix

log = get_logger("fabricd.admission")

#: jobs whose routing matrices are kept (two epochs each, for updates crossing a re-plan)
MAX_PLACED_JOBS = 64
#: target nodes that are not placed by the routing matrix
SPECIAL_TARGETS = frozenset({"scheduler"})
#: plans a scheduler's daemon keeps per job to check where a node's model may come from
SENT_PLANS_KEPT = 4
#: the source of a combined final model (worker.executor.service: the collector's mean of
#: every cluster's share): no node of the matrix, any of the job's clusters may collect
CONSENSUS = "consensus"
#: seconds a transfer may run before the minimum rate applies (connection warm-up)
RATE_GRACE = 5.0


def dedup_key(source_cluster: str, message_id: str) -> str:
    """The key updates are de-duplicated by: the sender's verified cluster and its id.

    The message id comes first so that forgetting a job's ids by prefix still works."""
    return f"{message_id}\x00{source_cluster}"


class Placements:
    """job -> its last two routing matrices, learned from relayed ``job.plan`` bodies."""

    def __init__(self, limit: int = MAX_PLACED_JOBS) -> None:
        self._jobs: BoundedDict[str, tuple[RoutingMatrix, ...]] = BoundedDict(limit)
        self._owners: BoundedDict[str, str] = BoundedDict(limit)
        #: job -> the clusters of every plan this daemon sent for it (as the job's scheduler)
        self._sent: BoundedDict[str, frozenset[str]] = BoundedDict(limit)
        #: job -> the last plans this daemon sent for it, newest first
        self._sent_plans: BoundedDict[str, tuple[RoutingMatrix, ...]] = BoundedDict(limit)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def learn(self, job_id: str, routing: Any, owner: str = "") -> None:
        """Record the routing matrix of a ``job.plan`` the local executor accepted, and the
        cluster of the scheduler that owns the job (it streams checkpointed node states
        back on a resume or a recovery, as no node of the matrix)."""
        if owner:
            self._owners[job_id] = owner
        matrix = _read_matrix(job_id, routing)
        if matrix is None:  # without a readable matrix this job's updates are admitted unchecked
            return
        previous = self._jobs.get(job_id, ())
        self._jobs[job_id] = (matrix, *previous[:1])
        log.info("placement.learned", job=job_id, clusters=len(matrix.clusters), nodes=matrix.num_nodes)

    def sent(self, job_id: str, routing: Any) -> None:
        """Record the clusters of a ``job.plan`` this daemon sent and a cluster accepted:
        only they may stream the job's updates (final model, checkpoints) back here."""
        matrix = _read_matrix(job_id, routing)
        if matrix is None:
            return
        self._sent[job_id] = self._sent.get(job_id, frozenset()) | frozenset(matrix.clusters)
        previous = self._sent_plans.get(job_id, ())
        if not previous or previous[0].to_bytes() != matrix.to_bytes():  # sent to every cluster
            self._sent_plans[job_id] = (matrix, *previous[:SENT_PLANS_KEPT - 1])

    def forget(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)
        self._owners.pop(job_id, None)
        self._sent.pop(job_id, None)
        self._sent_plans.pop(job_id, None)

    def refusal(self, header: UpdateHeader, source_cluster: str) -> str | None:
        """Why ``source_cluster`` may not send ``header`` (None if it may)."""
        if header.job_id == PROBE_JOB_ID:
            return None
        planned = self._sent.get(header.job_id)
        if planned is not None and source_cluster not in planned:
            return (f"cluster {source_cluster!r} is not one of the clusters of job {header.job_id!r} "
                    f"({', '.join(sorted(planned))}, as this daemon planned it): only they may send "
                    f"its models to the job's scheduler")
        if planned is not None and header.source_node != CONSENSUS:
            homes: list[str] = []
            for matrix in self._sent_plans.get(header.job_id, ()):
                try:
                    homes.append(matrix.cluster_of(header.source_node))
                except (KeyError, ValueError, IndexError):
                    continue
            if source_cluster not in homes:
                where = f"place it on {', '.join(sorted(set(homes)))}" if homes else "do not name it"
                return (f"update from cluster {source_cluster!r} claims node {header.source_node!r} of job "
                        f"{header.job_id!r}; the plans this daemon sent {where}")
        if header.target_node in SPECIAL_TARGETS:
            return None
        if source_cluster and self._owners.get(header.job_id) == source_cluster:
            return None
        matrices = self._jobs.get(header.job_id)
        if not matrices:
            return None
        parts = header.message_id.split("/")
        if len(parts) == 5:  # a repeated round's ids end in ~<attempt> (fresh ids, no dedup)
            base, _, attempt = parts[4].rpartition("~")
            parts[4] = base if base and attempt.isdigit() else parts[4]
        if len(parts) != 5 or parts[0] != header.job_id or parts[3] != header.source_node \
                or parts[4] != header.target_node:
            return (f"message id {header.message_id!r} does not name job {header.job_id!r}, source "
                    f"{header.source_node!r} and target {header.target_node!r} as job/round/kind/src/dst")
        placed: list[str] = []
        for matrix in matrices:
            try:
                cluster = matrix.cluster_of(header.source_node)
            except (KeyError, ValueError, IndexError):
                continue
            if cluster == source_cluster:
                return None
            placed.append(cluster)
        where = f"places it on cluster {placed[0]!r}" if placed else "does not name it"
        return (f"update from cluster {source_cluster!r} claims source node {header.source_node!r}; "
                f"the routing matrix of job {header.job_id!r} {where}")


class RateFloor:
    """The minimum-rate rule for one transfer: ``min_rate`` bytes/s after ``grace`` s."""

    def __init__(self, min_rate: float, grace: float = RATE_GRACE) -> None:
        self.min_rate = min_rate
        self.grace = grace
        self.started = time.monotonic()
        #: set when a stream waited for a frame that never started (not too slow: idle)
        self.idle = False

    def restart(self) -> None:
        """Start the clock now (the first byte of a frame on an idle stream came)."""
        self.started = time.monotonic()

    def deadline(self, nbytes: int) -> float:
        """Seconds ``nbytes`` may take in all under this floor (grace included)."""
        return self.grace + nbytes / self.min_rate

    def wait_budget(self, received: int, cap: float) -> float:
        """Seconds the next read may take before ``received`` falls below the floor."""
        due = self.started + self.grace + (received + 1) / self.min_rate
        return max(0.05, min(cap, due - time.monotonic()))

    def too_slow(self, received: int) -> str | None:
        elapsed = time.monotonic() - self.started
        if elapsed <= self.grace or received >= self.min_rate * (elapsed - self.grace):
            return None
        return (f"too slow: {received} bytes in {elapsed:.1f} s, below the minimum rate of "
                f"{self.min_rate:.0f} bytes/s (limits.min_transfer_rate) after a {self.grace:g} s grace")


def _read_matrix(job_id: str, routing: Any) -> RoutingMatrix | None:
    """The routing matrix of a job.plan for `job_id`, or None (logged) if it is unreadable
    or names another job."""
    try:
        matrix = RoutingMatrix.from_bytes(bytes(routing))
    except (ProtocolError, ValueError, TypeError) as exc:
        log.warning("placement.unreadable", job=job_id, reason=f"{type(exc).__name__}: {exc}")
        return None
    if matrix.job_id != job_id:
        log.warning("placement.unreadable", job=job_id,
                    reason=f"routing matrix is for job {matrix.job_id!r}")
        return None
    return matrix
