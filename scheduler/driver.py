"""The round driver: runs one federated job over the clusters of a mesh.

It talks to each cluster's executor through a `ClusterChannel` (the scheduler's fabricd
bridge in production, direct calls in the in-process backend): start the job and collect
label histograms, plan, publish the placement and round graph, run rounds, re-plan every
`clustering_period` rounds and migrate nodes whose cluster changed, and fetch the model.
Model traffic never passes through here: it flows between the clusters' executors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from proto.job import JobSpec
from scheduler.clusters import ClusterSlot
from scheduler.errors import SchedulerError
from scheduler.jobgraph import node_clusters, plan_epoch
from scheduler.plan import Plan
from scheduler.results import ClusterRecordSummary, JobSummary, RoundRecord
from worker.executor.graph import RoundGraph, to_dict

log = logging.getLogger("fedpilot.scheduler")


class JobFailed(SchedulerError):
    """The job cannot go on; the message names the cluster and what happened."""


class ClusterChannel(Protocol):
    def request(self, cluster_id: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send a control message to a cluster's executor and return its reply body.

        Raises `JobFailed` naming the cluster if it is unreachable or refuses."""
        ...


@dataclass(frozen=True)
class ClusterInfo:
    cluster_id: str
    peer_id: str = ""
    capacity: int = 0


@dataclass
class JobResult:
    summary: JobSummary
    placement: dict[str, Any]
    model: bytes | None
    daemon_bytes: dict[str, int] = field(default_factory=dict)


Progress = Callable[[RoundRecord, int], None]


class Driver:
    def __init__(
        self,
        spec: JobSpec,
        clusters: Sequence[ClusterInfo],
        channel: ClusterChannel,
        *,
        backend: str,
        progress: Progress | None = None,
        timeout: float = 900.0,
    ) -> None:
        if not clusters:
            raise JobFailed("no clusters to run on: the mesh lists none")
        self.spec = spec
        self.clusters = list(clusters)
        self.channel = channel
        self.backend = backend
        self.progress = progress
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(clusters)),
                                        thread_name_prefix="driver")

    # -- fan-out -------------------------------------------------------------------------
    def _all(self, bodies: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        futures = {cid: self._pool.submit(self.channel.request, cid, body, self.timeout)
                   for cid, body in bodies.items()}
        replies: dict[str, dict[str, Any]] = {}
        failures: list[str] = []
        for cid, fut in futures.items():
            try:
                replies[cid] = fut.result()
            except JobFailed as exc:
                failures.append(str(exc))
        if failures:
            raise JobFailed("; ".join(failures))
        return replies

    def _job_body(self, kind: str, **extra: Any) -> dict[str, Any]:
        return {"kind": kind, "job_id": self.spec.job_id, **extra}

    # -- the job -------------------------------------------------------------------------
    def run(self) -> JobResult:
        try:
            return self._run()
        except BaseException:
            self._stop_quietly()
            raise

    def _stop_quietly(self) -> None:
        """Best effort after a failure: let every executor that started release its actors."""
        for c in self.clusters:
            try:
                self.channel.request(c.cluster_id, self._job_body("job.stop"), 30.0)
            except Exception as exc:  # the job already failed; this is only clean-up
                log.info("event=stop_after_failure cluster=%s result=%s", c.cluster_id, exc)

    def _run(self) -> JobResult:
        spec = self.spec
        ids = [c.cluster_id for c in self.clusters]
        n = spec.data.number_of_clients
        holders = {cid: [i for i in range(n) if i % len(ids) == k] for k, cid in enumerate(ids)}
        log.info("event=job_start job=%s clusters=%s clients=%d", spec.job_id, ",".join(ids), n)
        started = self._all({cid: self._job_body("job.start", job=spec.to_dict(),
                                                 clients=holders[cid]) for cid in ids})
        histograms = np.zeros((n, 0), dtype=np.int64)
        for reply in started.values():
            rows = {int(k): v for k, v in reply["histograms"].items()}
            if histograms.shape[1] == 0 and rows:
                histograms = np.zeros((n, len(next(iter(rows.values())))), dtype=np.int64)
            for i, row in rows.items():
                histograms[i] = row
        slots = [ClusterSlot(c.cluster_id, c.capacity or int(started[c.cluster_id].get("capacity") or n),
                             c.peer_id) for c in self.clusters]
        plan, graph = plan_epoch(spec, histograms, slots, epoch=0)
        self._publish(plan, graph, imports={})
        summary = JobSummary(
            job_id=spec.job_id, backend=self.backend, placement_strategy=spec.placement.strategy,
            topology=spec.topology.kind, aggregation=spec.aggregation.name,
            compression=spec.transfer.compression, communities=plan.placement.communities)
        rounds = spec.training.federated_learning_rounds
        period = spec.placement.clustering_period
        for r in range(1, rounds + 1):
            record = self._round(r)
            summary.rounds.append(record)
            if self.progress is not None:
                self.progress(record, rounds)
            if period > 0 and r % period == 0 and r < rounds:
                new_plan, new_graph = plan_epoch(spec, histograms, slots, epoch=r // period)
                moved = self._migrate(node_clusters(graph, plan.routing), new_plan, new_graph)
                summary.replans += 1
                summary.migrations += moved
                plan, graph = new_plan, new_graph
        model = self._fetch_model(node_clusters(graph, plan.routing), graph)
        stopped = self._all({cid: self._job_body("job.stop") for cid in ids})
        per_cluster = plan.placement.clients_per_cluster()
        for c in self.clusters:
            reply = stopped[c.cluster_id]
            daemon = reply.get("daemon") or {}
            summary.clusters.append(ClusterRecordSummary(
                cluster_id=c.cluster_id, clients=per_cluster.get(c.cluster_id, 0),
                actors_materialized=int(reply.get("actors_materialized", 0)),
                daemon_bytes_sent=int(daemon.get("sent_bytes", 0)),
                daemon_bytes_received=int(daemon.get("received_bytes", 0))))
        summary.finish()
        placement = plan.placement.to_dict()
        placement["routing"] = plan.routing.to_dict(readable=True)
        return JobResult(summary, placement, model)

    def _publish(self, plan: Plan, graph: RoundGraph,
                 imports: Mapping[str, dict[str, bytes]]) -> None:
        routing = plan.routing.to_bytes()
        self._all({c.cluster_id: self._job_body("job.plan", graph=to_dict(graph), routing=routing,
                                                imports=imports.get(c.cluster_id, {}))
                   for c in self.clusters})

    def _round(self, r: int) -> RoundRecord:
        t0 = time.perf_counter()
        replies = self._all({c.cluster_id: self._job_body("round.run", round=r)
                             for c in self.clusters})
        evaluations = [e for rep in replies.values() for e in rep["evaluations"]]
        weight = sum(e[3] for e in evaluations) or 1
        accuracy = sum(e[1] * e[3] for e in evaluations) / weight
        loss = sum(e[2] * e[3] for e in evaluations) / weight
        correct = sum(rep["personal_correct"] for rep in replies.values())
        total = sum(rep["personal_total"] for rep in replies.values()) or 1
        return RoundRecord(
            round=r, accuracy=float(accuracy), loss=float(loss),
            personalized_accuracy=correct / total,
            bytes_intra=sum(int(rep["bytes_intra"]) for rep in replies.values()),
            bytes_inter=sum(int(rep["bytes_inter"]) for rep in replies.values()),
            seconds=time.perf_counter() - t0,
            by_cluster={cid: {"bytes_inter": int(rep["bytes_inter"]),
                              "bytes_intra": int(rep["bytes_intra"])}
                        for cid, rep in replies.items()})

    def _migrate(self, before: Mapping[str, str], plan: Plan, graph: RoundGraph) -> int:
        """Move nodes whose cluster changed, state and all; returns how many moved."""
        after = node_clusters(graph, plan.routing)
        moving: dict[str, list[str]] = {}
        for node, cluster in after.items():
            if node in before and before[node] != cluster:
                moving.setdefault(before[node], []).append(node)
        exported: dict[str, dict[str, bytes]] = {}
        if moving:
            replies = self._all({cid: self._job_body("node.export", nodes=nodes)
                                 for cid, nodes in moving.items()})
            for reply in replies.values():
                for node, state in reply["states"].items():
                    exported.setdefault(after[node], {})[node] = state
        self._publish(plan, graph, exported)
        count = sum(len(v) for v in moving.values())
        log.info("event=replan job=%s epoch=%d moved=%d", self.spec.job_id, plan.routing.epoch,
                 count)
        return count

    def _fetch_model(self, nodes: Mapping[str, str], graph: RoundGraph) -> bytes | None:
        roots = [a for a in graph.aggregators if a not in graph.parent]
        target = roots[0] if roots else graph.clients[0]
        reply = self.channel.request(nodes[target], self._job_body("job.model", node=target),
                                     self.timeout)
        model = reply.get("model")
        return bytes(model) if model else None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
