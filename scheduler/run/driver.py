"""The round driver: runs one federated job over the clusters of a mesh.

It talks to each cluster's executor through a `ClusterChannel` (the scheduler's fabricd
bridge in production, direct calls in the in-process backend): start the job and collect
label histograms, plan, publish the routing matrix (the whole plan of a round), run
rounds, re-plan every `clustering_period` rounds and migrate nodes whose cluster changed
(their states stream between the clusters), and receive the final model as an update
stream. Model traffic between rounds never passes through here.

A round that may close early (`rounds.min_participation` < 1, `aggregation.mode =
"buffered"`) goes only to the clusters not still training an earlier one, and ends when
the root's cluster answered (its aggregation closed) and the clusters whose contributions
it applied did; a cluster still training answers in a later round (its counters count
there), and every plan change waits for those answers first.

The final model is the one whose accuracy is reported: the root aggregator's model for
star and hierarchical; for hybrid and decentralized topologies the sample-weighted mean
of the group (or node) models, combined on one cluster, evaluated there and streamed here.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from proto.control import (
    INLINE_PLAN_BYTES,
    PROFILE_PAGE_BYTES,
    PROFILE_REPLY,
    JobModel,
    JobPlan,
    JobProfile,
    JobScore,
    JobStart,
    JobStop,
    NodeExport,
    RoundAbort,
    RoundRun,
    client_range,
    histogram_layout,
    page_rows,
    plan_parts,
    read_histograms,
)
from proto.errors import ControlMessageError
from proto.job import JobSpec, JobSpecError, early_close
from proto.rounds import RoundRecord, personal_choice, personal_reply
from proto.routing import RoutingMatrix
from scheduler.errors import JobFailed
from scheduler.planning.clusters import ClusterSlot
from scheduler.planning.pinned import (
    check_pinned_data,
    client_clusters,
    pinned_holders,
    pinned_plan_extra,
)
from scheduler.planning.plan import Plan, plan_job
from scheduler.planning.topology import topology_warnings
from scheduler.run.channel import ClusterChannel, ClusterInfo
from scheduler.run.checkpoint import Checkpoint
from scheduler.run.health import LearningWatch
from scheduler.run.leases import ClusterLost, LeaseKeeper
from scheduler.run.recovery import Departed, Recovery, node_clusters, privacy_key
from scheduler.rundir.placement import results_routing
from scheduler.rundir.results import ClusterRecordSummary, JobSummary

log = logging.getLogger("fedpilot.scheduler")

__all__ = ["ClusterChannel", "ClusterInfo", "Driver", "JobFailed", "JobResult", "plan_epoch"]


def plan_epoch(spec: JobSpec, histograms: np.ndarray, slots: Sequence[ClusterSlot], *,
               epoch: int, pinned: Sequence[str] | None = None,
               overflow: bool = False) -> Plan:
    """Plan placement epoch `epoch`. Deterministic strategies give the same answer every
    epoch (nothing moves unless the clusters changed); `random` draws anew each epoch.
    `pinned`: the cluster of every client of a pinned-data job (they never move);
    `overflow`: clients the clusters cannot hold sit out (a re-plan after a loss)."""
    planned_spec = spec
    if spec.placement.strategy == "random" and epoch:
        planned_spec = replace(spec, seed=spec.seed + epoch)
    return plan_job(planned_spec, list(slots), histograms=histograms, epoch=epoch,
                    pinned=pinned, overflow=overflow)


def merge_failures(failures: Mapping[str, str]) -> str:
    """One line per distinct failure: clusters that failed the same way (a bad model
    path, a missing module) are named together instead of repeating the text."""
    groups: dict[str, list[str]] = {}
    for cid, text in sorted(failures.items()):
        name = rf"(?<![\w.-]){re.escape(cid)}(?![\w-])"
        # the cluster's name becomes a placeholder: NUL for "cluster ID", SOH elsewhere
        shape = re.sub(name, "\x01", re.sub(rf"\bcluster {name}", "\x00", text))
        groups.setdefault(shape, []).append(cid)
    lines = []
    for shape, cids in groups.items():
        if len(cids) == 1:
            lines.append(failures[cids[0]])
            continue
        named = ", ".join(cids)
        lines.append(shape.replace("\x00", f"clusters {named}").replace("\x01", named))
    return "; ".join(lines)


@dataclass
class JobResult:
    summary: JobSummary
    placement: dict[str, Any]
    model: bytes | None
    daemon_bytes: dict[str, int] = field(default_factory=dict)
    model_info: dict[str, Any] = field(default_factory=dict)


Progress = Callable[[RoundRecord, int], None]
#: what the job is doing before its first round and after its last (a line for a person)
Stage = Callable[[str], None]
STOP_TIMEOUT = 120.0  # seconds an executor gets to release its actors and answer job.stop


class Driver(Recovery):
    def __init__(
        self,
        spec: JobSpec,
        clusters: Sequence[ClusterInfo],
        channel: ClusterChannel,
        *,
        backend: str,
        progress: Progress | None = None,
        stage: Stage | None = None,
        timeout: float = 900.0,
        run_dir: str | Path | None = None,
        resume: Checkpoint | None = None,
    ) -> None:
        if not clusters:
            raise JobFailed("no clusters to run on: the mesh lists none")
        self.spec = spec
        self.clusters = list(clusters)
        self.channel = channel
        self.backend = backend
        self.progress = progress
        self.stage = stage
        self.stage_line = ""  # the last stage said (the live page shows it)
        self.health = LearningWatch(spec, 2)   # the job's classes are known at job.start
        self.timeout = timeout
        # checkpoints go to run_dir/checkpoints every [faults] checkpoint_every rounds;
        # `resume` continues from one (its rounds are not run again)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.resume = resume
        self._next_round = 1
        self._restores = 0
        self._attempt = 0          # bumped when a round is repeated (fresh message ids)
        self._epoch = 0            # the newest placement epoch
        self._slots: list[ClusterSlot] = []
        self._last_models: dict[str, bytes] = dict(resume.models) if resume else {}
        self._departed: dict[str, Departed] = {}  # lost clusters, until they return
        # requests to a lost cluster may linger until its daemon gives up on them: room
        # for a few rounds of them beside the live ones
        self._pool = ThreadPoolExecutor(max_workers=4 * len(clusters) + 4,
                                        thread_name_prefix="driver")
        self.leases: LeaseKeeper | None = None
        self._slowest = 0.0  # seconds of the slowest round so far
        # rounds that close early: clusters still training a round (its number, the
        # request), and the reports of those that finished since the last round
        self._busy: dict[str, tuple[int, Future[dict[str, Any]]]] = {}
        self._late: dict[str, RoundRecord] = {}
        self._lost_later: ClusterLost | None = None
        #: the job's summary as it grows (rounds, faults), for whoever follows the run
        self.summary: JobSummary | None = None
        self.plan: Plan | None = None  # the newest published plan (read by the live page)
        self._pinned: list[str] | None = None  # data.placement = "pinned": each client's cluster
        self._client_samples: list[int] = []    # ... and its training samples (histogram sums)
        self._pooled_labels: list[int] = []     # ... and every label's (column sums)
        # pinned data: the mean and sd every site standardizes by (data.standardize), fixed
        # at the start: a site that comes back later gets the same
        self._scaling: tuple[list[float], list[float]] | None = None
        # pinned data: the learning rate the sites' trials chose (None: the job's), and
        # the summary's record of it
        self._learning_rate: float | None = None
        self._rate_report: dict[str, Any] = {}
        self._privacy_keys: dict[str, bytes] = {}  # [privacy]: each executor's public key
        #: a routing matrix over this many bytes goes as job.plan.parts, then a job.plan
        #: naming them by sha256 (every control body is capped at 4 MiB)
        self.inline_plan_bytes = INLINE_PLAN_BYTES
        #: bytes of histogram counts a job.start or job.profile reply carries (the rest of
        #: a cluster's come in further job.profile pages)
        self.profile_page_bytes = PROFILE_PAGE_BYTES

    # -- fan-out -------------------------------------------------------------------------
    def _all(self, bodies: Mapping[str, dict[str, Any]], timeout: float | None = None
             ) -> dict[str, dict[str, Any]]:
        """Every cluster's reply; JobFailed naming every refusal, or `ClusterLost` as soon
        as the lease keeper finds one of these clusters gone (not after `timeout`)."""
        timeout = self.timeout if timeout is None else timeout
        futures = {cid: self._pool.submit(self.channel.request, cid, body, timeout)
                   for cid, body in bodies.items()}
        what = ", ".join(sorted({str(b.get("kind")) for b in bodies.values()}))
        return self._await(futures, what)

    def _await(self, futures: Mapping[str, Future[dict[str, Any]]], what: str,
               watch: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
        """The replies of requests under way (see `_all`); `watch`: further clusters whose
        loss ends the wait too."""
        pending = set(futures.values())
        while pending:
            done, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
            lost = self.leases.lost() if self.leases is not None else {}
            lost = {cid: loss for cid, loss in lost.items() if cid in futures or cid in watch}
            if lost:
                raise ClusterLost(lost, what, pending=futures)
            if any(f.exception() is not None for f in done):
                break  # fail fast: the others are stopped by whoever handles the failure
        replies: dict[str, dict[str, Any]] = {}
        failures: dict[str, str] = {}
        for cid, fut in futures.items():
            if not fut.done():
                continue
            try:
                replies[cid] = fut.result()
            except JobFailed as exc:
                failures[cid] = str(exc)
            else:
                if self.leases is not None:
                    self.leases.heard_from(cid)
        if failures:
            # a failure is often the first sign of a lost cluster (the failing one, or one
            # its round needed): let the lease decide
            lost = self._lost_among(list(futures))
            if lost:
                raise ClusterLost(lost, what, pending=futures)
            raise JobFailed(merge_failures(failures))
        return replies

    def _lost_among(self, failed: list[str]) -> dict[str, Any]:
        """Which of these clusters (one just failed a request) the lease keeper finds lost:
        waits for its verdict until each answered a lease since (all alive: the failure is
        the job's own) or the keeper judged them after a whole lease of silence. That wait
        counts the keeper's own verdicts, not the clock: on a loaded machine its pass comes
        late (its mesh status query alone can take seconds), and a wall-clock bound gave up
        just before a killed cluster was found lost, failing the job instead of going on."""
        leases = self.leases
        if leases is None or not failed:
            return {}
        since = time.monotonic()
        settled = since + leases.lease  # a later verdict finds every silent one lost
        until = since + 4 * (leases.lease + leases.interval)  # its thread stopped for good
        leases.renew_now()
        while True:
            checked = leases.checked_at()  # before lost(): that verdict is in what follows
            lost = {cid: v for cid, v in leases.lost().items() if cid in failed}
            if lost:
                return lost
            if all(leases.answered_at(cid) > since for cid in failed):
                return {}
            if checked > settled or time.monotonic() > until:
                return {}
            time.sleep(0.1)

    def deadline(self) -> float:
        """How long a round may take: the user's timeout until one round was measured, then
        `round_deadline_factor` x the slowest round so far, at least `round_deadline_floor`."""
        faults = self.spec.faults
        if self._slowest <= 0:
            return self.timeout
        return max(faults.round_deadline_floor, faults.round_deadline_factor * self._slowest)

    # -- the job -------------------------------------------------------------------------
    def run(self) -> JobResult:
        # the lease keeps every executor alive while this process is; if it dies, they go
        self.leases = LeaseKeeper(self.channel, self.spec.job_id,
                                  [c.cluster_id for c in self.clusters],
                                  lease=self.spec.faults.lease_seconds,
                                  connected=getattr(self.channel, "connected", None)).start()
        try:
            return self._run()
        except ClusterLost as exc:
            self._stop_quietly()
            raise ClusterLost(exc.lost, exc.during, note="[faults] on_cluster_loss = "
                              f"{self.spec.faults.on_cluster_loss!r}") from None
        except BaseException:
            self._stop_quietly()
            raise
        finally:
            self.leases.stop()

    def _say(self, line: str) -> None:
        log.info("event=stage job=%s stage=%r", self.spec.job_id, line)
        self.stage_line = line
        if self.stage is not None:
            self.stage(line)

    def _stop_quietly(self) -> None:
        """Best effort after a failure: let every executor that started release its actors
        (in parallel, skipping clusters known to be gone)."""
        lost = self.leases.lost() if self.leases is not None else {}
        stop = JobStop(self.spec.job_id).to_body()
        futures = {c.cluster_id: self._pool.submit(self.channel.request, c.cluster_id, stop, 30.0)
                   for c in self.clusters if c.cluster_id not in lost}
        futures.update(self._stop_returning())
        for cid, fut in futures.items():
            try:
                fut.result()
            except Exception as exc:  # the job already failed; this is only clean-up
                log.info("event=stop_after_failure cluster=%s result=%s", cid, exc)

    def _run(self) -> JobResult:
        spec = self.spec
        ids = [c.cluster_id for c in self.clusters]
        n = spec.data.number_of_clients
        if spec.data.placement == "pinned":  # each cluster's clients come from its own file
            holders = pinned_holders(n, ids)
            self._pinned = client_clusters(holders)
        else:
            holders = {cid: list(range(k, n, len(ids))) for k, cid in enumerate(ids)}
        log.info("event=job_start job=%s clusters=%s clients=%d", spec.job_id, ",".join(ids), n)
        for warning in topology_warnings(spec):
            log.warning("event=%s job=%s hint=%s", "partial_participation" if
                        spec.training.client_fraction < 1 else "weak_robust_aggregation",
                        spec.job_id, warning)
        self._say(f"starting job {spec.job_id} on {len(ids)} cluster(s): each starts its "
                  "executor and loads its clients' data")
        began = time.monotonic()
        started = self._all({cid: self._start_body(holders[cid]) for cid in ids})
        self._say(f"{len(ids)} cluster(s) started in {time.monotonic() - began:.1f} s; "
                  f"placing {n} clients ({spec.placement.strategy}); the clusters start "
                  "their actors")
        self._privacy_keys = {cid: k for cid, reply in started.items()
                              if (k := privacy_key(reply))}
        if self._pinned is not None:
            check_pinned_data(started, spec.data.dataset)
            self._scaling = self._shared_scaling(started)
            self._learning_rate = self._shared_learning_rate(started)
        histograms = self._histograms(started, holders)
        self._client_samples = [int(x) for x in histograms.sum(axis=1)]
        self._pooled_labels = [int(x) for x in histograms.sum(axis=0)]
        # says when accuracy sits at chance or the loss explodes, naming the key to change
        self.health = LearningWatch(spec, histograms.shape[1], self._pooled_labels)
        slots = [ClusterSlot(c.cluster_id, c.capacity or int(started[c.cluster_id].get("capacity") or n),
                             c.peer_id) for c in self.clusters]
        resume = self.resume
        plan = plan_epoch(spec, histograms, slots, epoch=resume.epoch if resume else 0,
                          pinned=self._pinned)
        # each plan names the round that runs next: the executors accept updates for that
        # round (and the one after) only, and a fast cluster's first update of it may come
        # before the slow cluster's round.run
        self._next_round = resume.round + 1 if resume is not None else 1
        self._publish(plan, imports={})
        summary = JobSummary(
            job_id=spec.job_id, backend=self.backend, placement_strategy=plan.placement.strategy,
            topology=spec.topology.kind, aggregation=spec.aggregation.name,
            compression=spec.transfer.compression, communities=plan.placement.communities)
        summary.learning_rate = dict(self._rate_report)
        self.summary = summary
        first = 1
        if resume is not None:
            self._restore(plan, resume.models, whole=True)
            summary.rounds = [RoundRecord.from_dict(d, source="checkpoint")
                              for d in resume.rounds]
            summary.replans, summary.migrations = resume.replans, resume.migrations
            first = resume.round + 1
            log.info("event=resumed job=%s round=%d epoch=%d nodes=%d", spec.job_id,
                     resume.round, resume.epoch, len(resume.models))
        rounds = self._privacy_rounds(started, summary)
        groups = plan.placement.communities
        self._say(f"placed: {groups} communit{'y' if groups == 1 else 'ies'} of similar clients; "
                  f"round {first} of {rounds}")
        period = spec.placement.clustering_period
        every = spec.faults.checkpoint_every
        self._epoch = plan.routing.epoch
        self._slots = slots
        r, stage = first, "round"
        while r <= rounds:
            self._next_round = r if stage == "round" else r + 1
            try:
                if stage == "round":
                    if self._departed:  # lost clusters back in the mesh join again
                        plan = self._readmit(r, plan, histograms, summary)
                    record = self._round(r)
                    summary.rounds.append(record)
                    self.health.observe(record)
                    if self.progress is not None:
                        self.progress(record, rounds)
                    stage = "replan"
                    self._next_round = r + 1
                if stage == "replan":
                    self._raise_lost_later(r)
                    if period > 0 and r % period == 0 and r < rounds:
                        self._epoch = max(self._epoch + 1, r // period)
                        new_plan = plan_epoch(spec, histograms, self._slots, epoch=self._epoch,
                                              pinned=self._pinned)
                        moved = self._migrate(node_clusters(plan.routing), new_plan)
                        summary.replans += 1
                        summary.migrations += moved
                        plan = new_plan
                    stage = "checkpoint"
                if every and self.run_dir is not None and r % every == 0:
                    self._checkpoint(r, plan, summary)
            except ClusterLost as lost:
                if spec.faults.on_cluster_loss != "continue":
                    raise
                # a lost round runs again; after a finished round, the re-plan makes up the
                # re-plan and checkpoint of that round
                plan = self._recover(lost, r, plan, histograms, summary)
                if stage != "round":
                    stage = "checkpoint"
                continue
            r, stage = r + 1, "round"
        if summary.privacy and summary.rounds:
            summary.privacy["epsilon"] = summary.rounds[-1].epsilon
        self._say("rounds done: fetching the final model and scoring it on the clients")
        self._drain(ending=True)  # a slow cluster's last round: its report counts, not its update
        if summary.rounds:
            self._fold_late(summary.rounds[-1])
        model, info = self._fetch_model(plan.routing) if rounds else (None, {})
        if model and summary.rounds:
            info["score_bytes"] = self._final_personal(plan.routing, summary.rounds[-1], model)
        # the job ends its leases itself: an executor that stopped must not count as lost
        if self.leases is not None:
            self.leases.stop()
        self._stop_returning()  # a returning cluster's executor that never joined
        stopped = self._all({c.cluster_id: JobStop(spec.job_id).to_body() for c in self.clusters},
                            timeout=min(self.timeout, STOP_TIMEOUT))
        per_cluster = plan.placement.clients_per_cluster()
        for c in self.clusters:
            reply = stopped[c.cluster_id]
            daemon = reply.get("daemon") or {}
            summary.clusters.append(ClusterRecordSummary(
                cluster_id=c.cluster_id, clients=per_cluster.get(c.cluster_id, 0),
                actors_materialized=int(reply.get("actors_materialized", 0)),
                daemon_bytes_sent=int(daemon.get("sent_bytes", 0)),
                daemon_bytes_received=int(daemon.get("received_bytes", 0))))
        summary.final_model = info
        summary.finish()
        if summary.still_learning:
            log.warning("event=still_learning job=%s rounds=%d gain=%.4f over=%d "
                        "hint=raise training.federated_learning_rounds", spec.job_id,
                        len(summary.rounds), summary.still_learning["gain"],
                        summary.still_learning["rounds"])
        placement = plan.placement.to_dict()
        placement["routing"] = results_routing(plan.routing)
        return JobResult(summary, placement, model, model_info=info)

    def _privacy_rounds(self, started: Mapping[str, Mapping[str, Any]],
                        summary: JobSummary) -> int:
        """The job's rounds, fewer if the DP budget runs out first (every executor's
        accountant says how many fit); the summary's privacy entry."""
        rounds, p = self.spec.training.federated_learning_rounds, self.spec.privacy
        infos = [r["privacy"] for r in started.values() if isinstance(r.get("privacy"), dict)]
        if not infos:
            return rounds
        allowed = min(int(i.get("rounds", rounds)) for i in infos)
        summary.privacy = {"secure_aggregation": p.secure_aggregation, "dp": p.dp,
                           "clip_norm": p.clip_norm, "clip_quantile": p.clip_quantile,
                           "delta": p.delta, "budget": p.epsilon,
                           "noise_multiplier": float(infos[0].get("noise_multiplier", 0.0)),
                           "epsilon": 0.0, "stopped": ""}
        if allowed < rounds:
            reason = (f"the privacy budget: round {allowed + 1} would spend more than "
                      f"privacy.epsilon = {p.epsilon:g} (delta {p.delta:g}, noise_multiplier "
                      f"{summary.privacy['noise_multiplier']:g}); the job stops after "
                      f"round {allowed} of {rounds}")
            log.warning("event=privacy_budget job=%s rounds=%d of=%d reason=%s",
                        self.spec.job_id, allowed, rounds, reason)
            if allowed == 0:
                raise JobFailed(reason)
            summary.privacy["stopped"] = reason
        return allowed

    def _start_body(self, clients: list[int]) -> dict[str, Any]:
        """A cluster's job.start: its clients as a range when they are one (a few bytes
        for any number of clients), the histograms it may put in its reply."""
        span = client_range(clients)
        return JobStart(self.spec.job_id, job=self.spec.to_dict(), client_range=span,
                        clients=() if span is not None else tuple(clients),
                        histogram_bytes=self.profile_page_bytes).to_body()

    def _shared_scaling(self, started: Mapping[str, Mapping[str, Any]]
                        ) -> tuple[list[float], list[float]] | None:
        """Pinned data: the statistics every site standardizes by, from the `moments` in
        their job.start replies (`fedcore.data.shared_scaling`: per feature the median
        over sites, so one lying site of three or more moves nothing far); None where
        the job does not standardize. A site whose moments are malformed fails the job,
        named."""
        from fedcore.data import shared_scaling

        how = self.spec.data.standardize
        if how == "none":
            return None
        sites = {cid: reply.get("moments") for cid, reply in started.items()}
        missing = sorted(cid for cid, m in sites.items() if m is None)
        if missing:
            raise JobFailed(f"cluster(s) {', '.join(missing)} sent no data moments with "
                            "job.start; data.standardize needs every site's (an older "
                            "executor? set data.standardize = 'none')")
        try:
            found = shared_scaling(sites, how)
        except ValueError as exc:
            raise JobFailed(f"job.start replies: {exc}") from None
        if found is not None:
            log.info("event=shared_scaling job=%s groups=%d sites=%d", self.spec.job_id,
                     len(found[0]), len(sites))
        return found

    def _shared_learning_rate(self, started: Mapping[str, Mapping[str, Any]]) -> float | None:
        """Pinned data: the rate every client trains at where the sites' trials lowered the
        job's (`fedcore.data.preflight.shared_learning_rate`: their median), said on the
        progress line; None where the job keeps its rate. A malformed report fails the
        job, naming the cluster; so does a model no site's trial trained."""
        from fedcore.data.preflight import shared_learning_rate

        sites = {cid: reply.get("learning_rate_trial") for cid, reply in started.items()}
        try:
            rate, line = shared_learning_rate(self.spec, sites)
        except JobSpecError as exc:  # (a ValueError too)
            raise JobFailed(f"training.learning_rate: {exc.detail}") from None
        except ValueError as exc:
            raise JobFailed(f"job.start replies: {exc}") from None
        if rate is not None:
            log.warning("event=learning_rate_lowered job=%s rate=%g job_rate=%g sites=%d",
                        self.spec.job_id, rate, self.spec.training.learning_rate, len(sites))
            self._say(line)
            self._rate_report = {"job": self.spec.training.learning_rate, "trained_at": rate,
                                 "sites": {cid: (found or {}).get("learning_rate")
                                           for cid, found in sorted(sites.items())}}
        return rate

    def _histograms(self, started: Mapping[str, Mapping[str, Any]],
                    holders: Mapping[str, list[int]]) -> np.ndarray:
        """Every client's label histogram (a row per client id): the first page of each
        cluster's from its job.start reply, the rest fetched with job.profile, a page per
        cluster at a time; JobFailed naming the cluster and field if a page is not exactly
        the rows, labels and dtype asked for."""
        n = self.spec.data.number_of_clients
        pages: dict[str, list[np.ndarray]] = {}
        layout: dict[str, tuple[str, int, int]] = {}  # cid: (dtype, labels, rows a page)
        for cid, reply in started.items():
            total = len(holders[cid])
            try:
                dtype, labels = histogram_layout(reply)
                per_page = page_rows(self.profile_page_bytes, labels, dtype)
                rows = read_histograms(reply, min(total, per_page), dtype=dtype, labels=labels)
            except ControlMessageError as exc:
                raise JobFailed(f"cluster {cid} answered job.start with bad histograms: {exc}"
                                ) from None
            pages[cid], layout[cid] = [rows], (dtype, labels, per_page)
        while True:
            asks = {cid: (got, min(layout[cid][2], len(holders[cid]) - got))
                    for cid in pages if (got := sum(len(p) for p in pages[cid])) < len(holders[cid])}
            if not asks:
                break
            replies = self._all({cid: JobProfile(self.spec.job_id, offset=offset, count=count
                                                 ).to_body()
                                 for cid, (offset, count) in asks.items()})
            for cid, (offset, count) in asks.items():
                dtype, labels, _ = layout[cid]
                try:
                    pages[cid].append(read_histograms(replies[cid], count, dtype=dtype,
                                                      labels=labels, what=PROFILE_REPLY))
                except ControlMessageError as exc:
                    raise JobFailed(f"cluster {cid} answered job.profile (rows {offset}.."
                                    f"{offset + count - 1}) with bad histograms: {exc}") from None
        if any(len(p) > 1 for p in pages.values()):
            log.info("event=profile_in_pages job=%s pages=%d", self.spec.job_id,
                     sum(len(p) for p in pages.values()))
        histograms = np.zeros((n, 0), dtype=np.int64)
        for cid, parts in pages.items():
            rows = np.concatenate(parts) if len(parts) > 1 else parts[0]
            if not len(rows):
                continue
            if histograms.shape[1] == 0:
                histograms = np.zeros((n, rows.shape[1]), dtype=np.int64)
            if rows.shape[1] != histograms.shape[1]:
                raise JobFailed(f"cluster {cid} counts {rows.shape[1]} labels, another cluster "
                                f"{histograms.shape[1]}: do they load the same dataset?")
            histograms[np.asarray(holders[cid], dtype=np.int64)] = rows
        return histograms

    def _replan(self, histograms: np.ndarray, slots: list[ClusterSlot], epoch: int) -> Plan:
        # degrade, don't die: after a loss, clients the survivors cannot hold sit out
        # until a cluster returns (a re-plan with every cluster has room for all)
        return plan_epoch(self.spec, histograms, slots, epoch=epoch, pinned=self._pinned,
                          overflow=self.spec.faults.on_cluster_loss == "continue")

    def _publish(self, plan: Plan, imports: Mapping[str, list[str]]) -> None:
        self._drain()  # a new plan ends the rounds running on it
        self.plan = plan
        # pinned data: a cluster cannot count another's clients' samples itself; the
        # weights of their updates are what their own clusters reported at start
        extra: dict[str, Any] = ({} if self._pinned is None
                                 else pinned_plan_extra(plan, self._client_samples,
                                                        self._pooled_labels))
        if self._pinned is not None and self._scaling is not None:
            extra["scaling_mean"], extra["scaling_sd"] = self._scaling
        if self._learning_rate is not None:
            extra["learning_rate"] = self._learning_rate
        if self._pinned is None and plan.placement.absent:
            extra["absent"] = list(plan.placement.absent)
            log.warning("event=clients_sit_out job=%s epoch=%d clients=%d reason=%s",
                        self.spec.job_id, plan.routing.epoch, len(plan.placement.absent),
                        "the clusters left cannot hold them; they train again when a "
                        "cluster returns")
        data = plan.routing.to_bytes()
        if len(data) <= self.inline_plan_bytes:
            extra["routing"] = plan.routing
        else:
            parts, digest = plan_parts(self.spec.job_id, data)
            for part in parts:  # in order; every cluster takes each before the next
                body = part.to_body()
                self._all({c.cluster_id: body for c in self.clusters})
            extra.update(routing_sha256=digest, routing_size=len(data))
            log.info("event=plan_in_parts job=%s epoch=%d bytes=%d parts=%d sha256=%s",
                     self.spec.job_id, plan.routing.epoch, len(data), len(parts), digest)
        if self._privacy_keys:
            extra["privacy_keys"] = dict(self._privacy_keys)
        self._all({c.cluster_id: JobPlan(self.spec.job_id,
                                         imports=tuple(imports.get(c.cluster_id, [])),
                                         next_round=self._next_round, **extra).to_body()
                   for c in self.clusters})

    def _round(self, r: int) -> RoundRecord:
        if early_close(self.spec):
            return self._early_round(r)
        t0 = time.perf_counter()
        deadline = self.deadline()
        try:
            body = RoundRun(self.spec.job_id, round=r, deadline=deadline,
                            attempt=self._attempt).to_body()
            # executors' waits end at the deadline; the reply may take a little longer
            replies = self._all({c.cluster_id: body for c in self.clusters},
                                timeout=deadline + 30)
        except ClusterLost:
            raise
        except (JobFailed, ControlMessageError) as exc:
            raise JobFailed(f"round {r} failed (deadline {deadline:.0f} s: "
                            f"{self.spec.faults.round_deadline_factor:g} x the slowest round so "
                            f"far, {self._slowest:.1f} s, at least [faults] "
                            f"round_deadline_floor): {exc}") from None
        record = RoundRecord.combine(r, self._reports(r, replies), time.perf_counter() - t0)
        self._slowest = max(self._slowest, record.seconds)
        return record

    def _reports(self, r: int, replies: Mapping[str, dict[str, Any]]) -> dict[str, RoundRecord]:
        records = {}
        for cid, reply in replies.items():
            try:
                records[cid] = RoundRecord.from_dict(reply, source=f"cluster {cid}'s round report")
            except ValueError as exc:
                raise JobFailed(f"cluster {cid} sent a bad report for round {r}: {exc}") from None
        return records

    def _early_round(self, r: int) -> RoundRecord:
        """A round that may close without a slow cluster (see the module's docstring)."""
        t0 = time.perf_counter()
        deadline = self.deadline()
        assert self.plan is not None
        routing = self.plan.routing
        root = node_clusters(routing)[next(
            routing.node_name(i) for i in range(routing.num_clients, routing.num_nodes)
            if routing.parent[i] < 0)]
        self._harvest()
        idle = sorted(c.cluster_id for c in self.clusters if c.cluster_id not in self._busy)
        body = RoundRun(self.spec.job_id, round=r, deadline=deadline, attempt=self._attempt,
                        clusters=tuple(idle) if len(idle) < len(self.clusters) else None
                        ).to_body()
        for cid in idle:  # a slow one may answer rounds later: the job's whole timeout
            self._busy[cid] = (r, self._pool.submit(self.channel.request, cid, body,
                                                    deadline + 30 if cid == root else self.timeout))
        try:
            try:
                replies = self._await({root: self._busy[root][1]}, "round.run",
                                      watch=list(self._busy))
            except ClusterLost as exc:
                replies = self._closed_anyway(r, root, exc)
            self._busy.pop(root)
            applied = RoundRecord.from_dict(replies[root]).contributions
            # the clusters whose contributions to the round they run were applied have
            # sent all: they answer now
            if self._lost_later is None:
                self._harvest(wait_for=[c for c, info in applied.items() if c in self._busy
                                        and self._busy[c][0] == info["round"]])
        except ClusterLost as exc:
            raise ClusterLost(exc.lost, exc.during, pending=self._abandon(r)) from None
        except (JobFailed, ControlMessageError) as exc:
            raise JobFailed(f"round {r} failed (deadline {deadline:.0f} s): {exc}") from None
        record = RoundRecord.combine(r, self._reports(r, replies), time.perf_counter() - t0)
        self._slowest = max(self._slowest, record.seconds)
        return self._fold_late(record)

    def _closed_anyway(self, r: int, root: str, lost: ClusterLost) -> dict[str, dict[str, Any]]:
        """A cluster was lost while the root's aggregation ran: if the aggregation closed
        all the same (it may not wait for that cluster), the round happened and the loss
        is handled before the next; else ClusterLost (the round runs again)."""
        future = self._busy[root][1]
        if root not in lost.lost:
            self._pool.submit(self.channel.request, root, RoundAbort(
                self.spec.job_id, round=r, reason=str(lost)[:400]).to_body(), 30.0)
            try:
                reply = future.result(timeout=STOP_TIMEOUT)
            except Exception:  # noqa: BLE001 - aborted (or failed): the round runs again
                raise lost from None
            self._lost_later = lost
            return {root: reply}
        raise lost

    def _raise_lost_later(self, r: int) -> None:
        """A loss found while round `r` closed without the lost cluster is handled now."""
        if self._lost_later is not None:
            lost = self._lost_later
            raise ClusterLost(lost.lost, lost.during, pending=self._abandon(r))

    def _fold_late(self, record: RoundRecord) -> RoundRecord:
        """`record` with the counters of the rounds that finished late since the last."""
        for cid, late in sorted(self._late.items()):
            record.add_personal(late.personal_correct, late.personal_total)
            mine = record.by_cluster.setdefault(cid, {})
            for name in ("participants", "bytes_intra", "bytes_inter"):
                setattr(record, name, getattr(record, name) + getattr(late, name))
                mine[name] = mine.get(name, 0) + getattr(late, name)
            record.messages_intra += late.messages_intra
            record.messages_inter += late.messages_inter
        self._late = {}
        return record

    def _harvest(self, wait_for: Sequence[str] = ()) -> None:
        """Take the reports of busy clusters that finished (waiting for `wait_for`)."""
        if wait_for:
            self._await({cid: self._busy[cid][1] for cid in wait_for}, "round.run",
                        watch=list(self._busy))
        for cid, (r, future) in list(self._busy.items()):
            if not future.done():
                continue
            del self._busy[cid]
            try:
                reply = future.result()
            except JobFailed as exc:  # its contribution is dropped; the cluster goes on
                log.warning("event=late_round_failed job=%s cluster=%s round=%d reason=%s",
                            self.spec.job_id, cid, r, exc)
                continue
            self._late.update(self._reports(r, {cid: reply}))

    def _drain(self, *, ending: bool = False) -> None:
        """Wait until no cluster trains an earlier round (before the plan changes, or
        `ending` the job: then a lost one is left behind)."""
        if self._busy:
            try:
                self._harvest(wait_for=list(self._busy))
            except ClusterLost as exc:
                pending = self._abandon(0)
                if not ending:
                    raise ClusterLost(exc.lost, exc.during, pending=pending) from None

    def _abandon(self, r: int) -> dict[str, Future[dict[str, Any]]]:
        """A cluster was lost: end every round still running (the survivors' own rounds
        are aborted by the recovery) and hand over their requests."""
        pending = {cid: f for cid, (_, f) in self._busy.items()}
        for cid, (busy_round, _) in self._busy.items():
            if busy_round != r:
                self._pool.submit(self.channel.request, cid, RoundAbort(
                    self.spec.job_id, round=busy_round,
                    reason="a cluster was lost; the round is over").to_body(), 30.0)
        self._busy, self._late, self._lost_later = {}, {}, None
        return pending

    def _migrate(self, before: Mapping[str, str], plan: Plan) -> int:
        """Move nodes whose cluster changed, state and all; returns how many moved. The
        states stream from the old cluster to the new one; the new plan names them."""
        after = node_clusters(plan.routing)
        moving: dict[str, dict[str, str]] = {}
        for node, cluster in after.items():
            if node in before and before[node] != cluster:
                moving.setdefault(before[node], {})[node] = cluster
        imports: dict[str, list[str]] = {}
        if moving:
            replies = self._all({cid: NodeExport(self.spec.job_id, nodes=nodes,
                                                 epoch=plan.routing.epoch).to_body()
                                 for cid, nodes in moving.items()})
            for reply in replies.values():
                for node in reply.get("sent", []):
                    imports.setdefault(after[str(node)], []).append(str(node))
        self._publish(plan, imports)
        count = sum(len(v) for v in moving.values())
        log.info("event=replan job=%s epoch=%d moved=%d", self.spec.job_id, plan.routing.epoch,
                 count)
        return count

    def _fetch_model(self, routing: RoutingMatrix) -> tuple[bytes, dict[str, Any]]:
        """The final model as an update stream, and what it is."""
        nodes = node_clusters(routing)
        here = self.channel.local_cluster
        if routing.kind in ("star", "hierarchical"):
            root = next(routing.node_name(i) for i in range(routing.num_clients, routing.num_nodes)
                        if routing.parent[i] < 0)
            reply = self.channel.request(nodes[root], JobModel(
                self.spec.job_id, node=root, to_cluster=here).to_body(), self.timeout)
            info: dict[str, Any] = {"model": f"root aggregator {root!r}", "node": root}
            shares: dict[str, dict[str, Any]] = {}
        else:
            # every cluster's sample-weighted share goes to one collector, which combines,
            # evaluates and streams the result here
            ids = [c.cluster_id for c in self.clusters]
            collector = nodes["c0"]
            others = {cid: JobModel(self.spec.job_id, share_to=collector).to_body()
                      for cid in ids if cid != collector}
            shares = self._all(others) if others else {}
            sources = [str(r["source_node"]) for r in shares.values() if r.get("source_node")]
            reply = self.channel.request(collector, JobModel(
                self.spec.job_id, collect=tuple(sources), to_cluster=here).to_body(), self.timeout)
            what = "group" if routing.kind == "hybrid" else "node"
            info = {"model": f"sample-weighted mean of the {what} models", "node": "consensus"}
        model = self.channel.take_update(self.spec.job_id, str(reply["node"]), self.timeout)
        share_bytes = sum(int(r.get("bytes", 0)) for r in shares.values())
        # streams between daemons for the final model: shares to the collector, then here
        info.update({"accuracy": float(reply["accuracy"]), "loss": float(reply["loss"]),
                     "bytes": len(model), "share_bytes": share_bytes,
                     "transfer_bytes": share_bytes + len(model)})
        return model, info

    def _final_personal(self, routing: RoutingMatrix, record: RoundRecord, model: bytes
                        ) -> int:
        """The last round's personalized accuracy against the final `model` (job.score:
        the round's own compares each client's trained model with the model the round
        started from, one aggregation behind the accuracy set against it); returns the
        bytes streamed. Best effort: a cluster that fails leaves the round's own number,
        logged, and the job ends as it would have."""
        send = getattr(self.channel, "send_update", None)
        if send is None:
            return 0
        job, r, here = self.spec.job_id, record.round, self.channel.local_cluster
        ids = sorted(set(node_clusters(routing).values()))
        timeout = min(self.timeout, STOP_TIMEOUT)
        sent = 0
        try:
            self._all({cid: JobScore(job, phase="expect", round=r, source_cluster=here).to_body()
                       for cid in ids}, timeout)
            for cid in ids:
                send(target_cluster=cid, job_id=job, round=0, source_node="score",
                     target_node="score", message_id=f"{job}/0/score-{cid}/score/score", payload=model,
                     timeout=timeout)
                sent += len(model)
            replies = self._all({cid: JobScore(job, phase="apply", round=r).to_body()
                                 for cid in ids}, timeout)
        except Exception as exc:  # any failure of this optional pass: the job's result stands
            log.warning("event=final_personal_skipped job=%s round=%d reason=%s", job, r, exc)
            return sent
        counts = {cid: personal_reply(reply) for cid, reply in replies.items()}
        valid = {cid: c for cid, c in counts.items() if c is not None}
        if len(valid) < len(counts):  # a cluster's own number is not a count of its samples
            log.warning("event=final_personal_skipped job=%s round=%d reason=replies of %s "
                        "are not counts", job, r, sorted(set(counts) - set(valid)))
            return sent
        correct, total, chosen = personal_choice(valid)
        if total > 0:
            log.info("event=final_personal job=%s round=%d personalized=%.4f before=%.4f "
                     "policies=%s", job, r, correct / total, record.personalized_accuracy,
                     ",".join(f"{cid}:{p}" for cid, p in chosen.items()))
            record.personal_correct, record.personal_total = 0, 0
            record.add_personal(correct, total)
        return sent

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
