"""The executor's control surface: what it does for each scheduler message.

`proto.control` types the messages and says what each asks for; the daemon only passes on
bodies signed by a `scheduler` certificate. Any control message renews the executor's
lease; one whose lease runs out (its scheduler is gone) releases its actors and exits
(`__main__`), so the daemon forgets the job and the same job id can be submitted again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any, Protocol

import numpy as np

from fedcore.data import DatasetError
from proto.control import (
    ControlMessage,
    JobCheckpoint,
    JobLease,
    JobModel,
    JobPlan,
    JobPlanPart,
    JobProfile,
    JobRestore,
    JobScore,
    JobStart,
    JobStop,
    NodeExport,
    PlanAssembly,
    RoundAbort,
    RoundRun,
    histogram_dtype,
    histogram_reply,
    page_rows,
    parse_control,
)
from proto.errors import ControlMessageError
from proto.job import JobSpec, fixed_mixing_steps
from proto.routing import RoutingMatrix
from worker import payload as wire
from worker.errors import WorkerError
from worker.executor.allowlist import check_job_from_environment
from worker.executor.contributions import CloseRule
from worker.executor.engine import ClientPool, ClusterEngine, average
from worker.executor.failures import explain_failure
from worker.executor.graph import FINAL, STATE, RoundGraph
from worker.executor.mailbox import Envelope, Mailbox
from worker.executor.transport import (
    AGGREGATOR,
    MODEL,
    DeliveryNotReady,
    HybridTransport,
    RemoteLink,
    Weights,
)
from worker.privacy import Privacy

log = logging.getLogger("fedpilot.executor")

RESTORE = "restore"        # target node of a state streamed back from a checkpoint
CHECKPOINT = "checkpoint"  # target node of a state streamed to the scheduler's checkpoint
SCORE = "score"            # source and target node of the final model the scheduler streams

#: lease before the scheduler named one: starting a job (data, Ray) may take this long
FIRST_LEASE = 180.0


class JobRuntime(ClientPool, Protocol):
    """A ClientPool that also owns the job's data, models and actors on this cluster."""

    initial_weights: Weights

    def histograms(self, clients: list[int]) -> dict[int, list[int]]: ...
    def capacity(self) -> int: ...
    def assign(self, clients: list[str]) -> None: ...
    def actors_materialized(self) -> int: ...
    def evaluate_global(self, weights: Weights) -> tuple[float, float]: ...
    def make_aggregator(self, node: str) -> Any: ...
    def make_inner_aggregator(self) -> Any: ...
    def make_codec(self) -> Any: ...
    def final_personal(self, nodes: list[str], weights: Weights, round_index: int
                       ) -> dict[str, Any]: ...
    def close(self) -> None: ...


RuntimeFactory = Callable[[JobSpec], JobRuntime]


class ControlError(WorkerError):
    """A control message is out of order or does not fit this job; the reason goes back to
    the scheduler (a malformed one raises `proto.errors.ControlMessageError`)."""


class ExecutorService:
    """One job on one cluster."""

    def __init__(self, *, cluster_id: str, make_runtime: RuntimeFactory,
                 link: RemoteLink | None = None, round_timeout: float = 600.0,
                 daemon_counters: Callable[[str], dict[str, int]] | None = None) -> None:
        self.cluster_id = cluster_id
        self._daemon_counters = daemon_counters
        self._make_runtime = make_runtime
        self.link = link
        self.round_timeout = round_timeout
        self.spec: JobSpec | None = None
        self.runtime: JobRuntime | None = None
        self.engine: ClusterEngine | None = None
        self.privacy: Privacy | None = None  # [privacy]: its keys, accountant and seams
        self.transport: HybridTransport | None = None
        #: the transport's compression codec (worker.executor.codec.EdgeCodec; a test's
        #: runtime may give one without checkpoint state)
        self.codec: Any = None
        self.mailbox = Mailbox()
        self.stopped = threading.Event()
        self._nodes: dict[str, str] = {}
        self._epoch = 0
        #: a fedcore.metrics.RunMetrics to report every round to (or None)
        self.metrics: Any = None
        self._lock = threading.Lock()
        #: held while the engine runs a round or is changed (a plan, a node export)
        self._engine_lock = threading.Lock()
        self._running: tuple[int, int] | None = None  # (round, attempt) running now
        #: the last round run here: (round, attempt, its report)
        self._ran: tuple[int, int, dict[str, Any]] | None = None
        self.lease_seconds = FIRST_LEASE
        self._restoring: tuple[str, set[str]] | None = None  # (from cluster, nodes)
        self._scoring: str | None = None  # the cluster the final model to score comes from
        self._plan_parts = PlanAssembly()  # a large plan's parts, until its job.plan
        #: the job.start's label histograms (a row per client it named), sent in pages
        self._histograms = np.zeros((0, 0), dtype=np.int64)
        self._histogram_dtype = "<u1"
        self._page_bytes = 0
        self._last_contact = time.monotonic()

    # -- the lease ---------------------------------------------------------------------------
    def renew(self) -> None:
        """The scheduler spoke (called on arrival, before a control worker is free)."""
        self._last_contact = time.monotonic()

    def lease_left(self) -> float:
        return self.lease_seconds - (time.monotonic() - self._last_contact)

    def abort(self, reason: str) -> None:
        """Give up the job: wake every wait with `reason` and release the actors."""
        log.error("event=job_aborted cluster=%s reason=%s", self.cluster_id, reason)
        self.mailbox.close(reason)
        runtime = self.runtime
        if runtime is not None:
            try:
                runtime.close()
            except Exception as exc:  # the process exits next; say why the release failed
                log.error("event=release_failed cluster=%s reason=%s", self.cluster_id, exc)
        self.stopped.set()

    def handle(self, body: dict[str, Any]) -> dict[str, Any]:
        """The reply to one control body; ControlMessageError if it is malformed (before
        anything changes), ControlError if it does not fit this job now."""
        self.renew()
        message = parse_control(body)
        if isinstance(message, JobLease):
            return self._lease(message)
        handlers: dict[type[ControlMessage], Callable[[Any], dict[str, Any]]] = {
            JobStart: self._start, JobPlan: self._plan, RoundRun: self._round,
            NodeExport: self._export, JobModel: self._model, JobStop: self._stop,
            JobCheckpoint: self._checkpoint, JobRestore: self._restore,
            RoundAbort: self._abort_round, JobPlanPart: self._plan_part,
            JobProfile: self._profile, JobScore: self._score,
        }
        if not isinstance(message, JobStart) and self.spec is None:
            raise ControlError(f"{message.TYPE} before job.start")
        if self.spec is not None and message.job_id != self.spec.job_id:
            raise ControlError(f"message for job {message.job_id!r}; this executor runs "
                               f"{self.spec.job_id!r}")
        return handlers[type(message)](message)

    def deliver(self, *, job_id: str, round: int, source_node: str, target_node: str,
                source_cluster: str, payload: bytes, message_id: str = "") -> bool:
        """An update from another cluster (via fabricd, which names the sending cluster);
        False if it repeats one already applied (it is not applied again)."""
        transport = self.transport
        if transport is None:
            raise DeliveryNotReady(f"update {source_node} -> {target_node} arrived before the "
                                   "job was planned")
        if target_node == RESTORE:  # a node state from the checkpoint (job.restore)
            weights = self._take_expected("restore", self._restoring, job_id, source_node,
                                          source_cluster, payload, STATE)
            self.mailbox.put((0, RESTORE, source_node, RESTORE),
                             Envelope(weights, 0, len(payload), True))
            return True
        if target_node == SCORE:  # the final model to score (job.score)
            weights = self._take_expected(
                "model to score", None if self._scoring is None else (self._scoring, (SCORE,)),
                job_id, source_node, source_cluster, payload, FINAL)
            # the job's model, as every model from another cluster (names, shapes, finite)
            weights = transport._conform(weights, "the final model to score")
            # round 0, as the final model's other streams
            self.mailbox.put((0, SCORE, SCORE, SCORE), Envelope(weights, 0, len(payload), True))
            return True
        return transport.deliver_remote(job_id=job_id, round=round, source_node=source_node,
                                        target_node=target_node, source_cluster=source_cluster,
                                        payload=payload, message_id=message_id)

    # -- handlers --------------------------------------------------------------------------
    def _lease(self, message: JobLease) -> dict[str, Any]:
        if self.spec is not None and message.job_id != self.spec.job_id:
            raise ControlError(f"lease for job {message.job_id!r}; this executor runs "
                               f"{self.spec.job_id!r}")
        self.lease_seconds = float(message.lease)
        transport = self.transport
        return {"round": transport.current_round if transport is not None else 0,
                "started": self.spec is not None}

    def _start(self, message: JobStart) -> dict[str, Any]:
        if self.spec is not None:
            raise ControlError(f"job {self.spec.job_id!r} already started on this executor")
        spec = JobSpec.from_dict(message.job, source="job.start message")
        check_job_from_environment(spec, cluster_id=self.cluster_id)  # before any import or open
        ids = message.client_ids()
        n = spec.data.number_of_clients
        if len(ids) and max(ids[0], ids[-1]) >= n:  # a range: O(1); a list: checked below
            field = "client_range" if message.client_range is not None else "clients"
            raise ControlMessageError(message.TYPE, field, f"field {field!r}: names client "
                                      f"{max(ids[0], ids[-1])}; the job has clients 0..{n - 1}")
        self.spec = spec
        self.runtime = self._make_runtime(spec)
        clients = list(ids)
        hist = self.runtime.histograms(clients)
        log.info("event=job_started job=%s cluster=%s clients=%d", spec.job_id,
                 self.cluster_id, len(clients))
        rows = np.array([hist[c] for c in clients], dtype=np.int64)
        if rows.ndim != 2:  # no clients here (fewer clients than clusters): no row length
            rows = rows.reshape(len(clients), 0)
        # every reply gives the counts in this dtype; the first page goes now, the rest on
        # job.profile (a reply stays under the control cap whatever the client count)
        self._histograms = rows
        self._histogram_dtype = histogram_dtype(rows)
        self._page_bytes = message.histogram_bytes
        first = page_rows(message.histogram_bytes, rows.shape[1], self._histogram_dtype)
        reply: dict[str, Any] = {**histogram_reply(rows[:first], self._histogram_dtype),
                                 "capacity": self.runtime.capacity()}
        self.privacy = Privacy.for_job(spec, self.cluster_id, locate=self._nodes_lookup,
                                       samples=self.runtime.samples)
        if self.privacy is not None:  # the key the others mask with; the rounds DP allows
            reply["privacy"] = {"key": self.privacy.public_key() or b"",
                                "rounds": self.privacy.max_rounds(),
                                "noise_multiplier": self.privacy.noise_multiplier}
        data_info = getattr(self.runtime, "data_info", None)
        if data_info is not None:  # classes and shape, which pinned clusters must agree on
            reply["data"] = data_info()
        data_moments = getattr(self.runtime, "data_moments", None)
        found = data_moments() if data_moments is not None else None
        if found is not None:  # pinned: what the shared standardization is made from
            reply["moments"] = found
        trial = getattr(self.runtime, "learning_rate_trial", None)
        tried = trial() if trial is not None else None
        if tried is not None:  # pinned: what the job's learning rate is chosen from
            reply["learning_rate_trial"] = tried
        return reply

    def _profile(self, message: JobProfile) -> dict[str, Any]:
        """A page of the job.start's histograms: only this cluster's own clients (rows of
        what job.start named), at most the job.start's histogram_bytes of counts."""
        rows = self._histograms
        if message.offset >= len(rows):
            raise ControlMessageError(message.TYPE, "offset", f"field 'offset': must be in "
                                      f"0..{len(rows) - 1} (this cluster has {len(rows)} "
                                      f"clients of the job), got {message.offset}")
        if message.offset + message.count > len(rows):
            raise ControlMessageError(message.TYPE, "count", f"field 'count': rows "
                                      f"{message.offset}..{message.offset + message.count - 1} "
                                      f"run past this cluster's {len(rows)} clients")
        most = page_rows(self._page_bytes, rows.shape[1], self._histogram_dtype)
        if message.count > most:
            raise ControlMessageError(message.TYPE, "count", f"field 'count': at most {most} "
                                      f"rows ({self._page_bytes} bytes of counts, the "
                                      f"job.start's histogram_bytes), got {message.count}")
        page = rows[message.offset:message.offset + message.count]
        return histogram_reply(page, self._histogram_dtype)

    def _plan_part(self, message: JobPlanPart) -> dict[str, Any]:
        return {"parts": self._plan_parts.add(message)}

    def _plan(self, message: JobPlan) -> dict[str, Any]:
        assert self.spec is not None and self.runtime is not None
        message = message.with_routing(self._plan_parts)  # refused unless the digest matches
        routing = message.routing
        assert routing is not None
        if routing.job_id != self.spec.job_id:
            raise ControlError(f"routing matrix is for job {routing.job_id!r}")
        if self.cluster_id not in routing.clusters:
            raise ControlError(f"routing matrix does not name this cluster ({self.cluster_id})")
        if routing.num_clients != self.spec.data.number_of_clients:
            raise ControlError(f"routing matrix has {routing.num_clients} clients; the job has "
                               f"{self.spec.data.number_of_clients}")
        fixed = fixed_mixing_steps(self.spec)
        if fixed not in (None, routing.mixing_steps):
            raise ControlError(f"routing matrix has mixing_steps {routing.mixing_steps}; the "
                               f"job fixes {fixed} (topology.mixing_steps = "
                               f"{self.spec.topology.mixing_steps}, aggregation.name = "
                               f"{self.spec.aggregation.name!r})")
        classes = getattr(getattr(self.runtime, "dataset", None), "num_classes", None)
        if (message.pooled_labels is not None and classes is not None
                and len(message.pooled_labels) != classes):
            raise ControlMessageError(message.TYPE, "pooled_labels", "field 'pooled_labels': "
                                      f"must be {classes} counts (one per class of the job's "
                                      f"data), got {len(message.pooled_labels)}")
        if message.scaling_mean is not None and message.scaling_sd is not None:
            standardize = getattr(self.runtime, "standardize", None)
            if standardize is not None:  # pinned: every site by the statistics they share
                try:
                    standardize(message.scaling_mean, message.scaling_sd)
                except (ValueError, DatasetError) as exc:
                    raise ControlMessageError(message.TYPE, "scaling_mean",
                                              f"field 'scaling_mean': {exc}") from None
        if message.learning_rate is not None:
            set_rate = getattr(self.runtime, "set_learning_rate", None)
            if set_rate is not None:  # pinned: the rate the sites' trials chose
                try:
                    set_rate(message.learning_rate)
                except ValueError as exc:
                    raise ControlMessageError(message.TYPE, "learning_rate",
                                              f"field 'learning_rate': {exc}") from None
        with self._exclusive(f"re-planned (epoch {routing.epoch}) while round "
                             "{round} ran here"):
            return self._install(message, routing)

    def _install(self, message: JobPlan, routing: RoutingMatrix) -> dict[str, Any]:
        assert self.spec is not None and self.runtime is not None
        graph = RoundGraph.from_routing(routing)
        nodes = {node: routing.cluster_of(node) for node in graph.nodes}
        with self._lock:
            self._nodes = nodes
        if self.transport is None:
            self.codec = self.runtime.make_codec()
            self.transport = HybridTransport(
                job_id=self.spec.job_id, local_cluster=self.cluster_id,
                locate=self._nodes_lookup, mailbox=self.mailbox, resolve=self.runtime.resolve,
                codec=self.codec, link=self.link,
                template=self.runtime.initial_weights)
        # clients that sit out every round of this plan (a pinned-data job's clients whose
        # cluster is gone: the plan lists them on a survivor, where they never train)
        absent = frozenset(f"c{c}" for c in message.absent)
        local_clients = [c for c in graph.clients if nodes[c] == self.cluster_id
                         and c not in absent]
        if message.client_samples is not None:  # pinned: other clusters' clients' samples
            set_samples = getattr(self.runtime, "set_client_samples", None)
            if set_samples is not None:
                set_samples(list(message.client_samples), list(message.pooled_labels or ()))
        self.runtime.assign(local_clients)
        previous = self.engine
        self.engine = ClusterEngine(
            cluster_id=self.cluster_id, graph=graph, transport=self.transport, pool=self.runtime,
            initial_weights=self.runtime.initial_weights,
            make_aggregator=self.runtime.make_aggregator,
            make_inner_aggregator=self.runtime.make_inner_aggregator,
            evaluate_global=self.runtime.evaluate_global, seed=self.spec.seed,
            client_fraction=self.spec.training.client_fraction, timeout=self.round_timeout,
            mixing_steps=routing.mixing_steps, close_rule=CloseRule.of(self.spec))
        self.engine.absent = absent
        if self.privacy is not None and self.privacy.key is not None:
            keys = message.privacy_keys or {}
            missing = sorted(set(nodes.values()) - set(keys))
            if missing:
                raise ControlError(f"secure aggregation: the plan carries no public key of "
                                   f"clusters {missing}")
            self.privacy.set_peer_keys(keys)
        self.engine.privacy = self.privacy
        if previous is not None:  # nodes that stay here keep their models (and the state)
            self.engine.adopt(previous, [n for n in graph.nodes if nodes[n] == self.cluster_id])
        # the plan names the round that runs next: its updates (and the next round's) are
        # accepted from now on, even before this cluster's round.run arrives
        self.transport.current_round = max(0, message.next_round - 1)
        imports = list(message.imports)
        for node in imports:
            if nodes.get(node) != self.cluster_id:
                raise ControlError(f"asked to import node {node!r}, which the plan does not "
                                   "place on this cluster")
            envelope = self.transport.receive(routing.epoch, STATE, node, node,
                                              self.round_timeout)
            model, aggregator = envelope.weights
            self.engine.restore_aggregator(node, aggregator)   # checked first: else nothing
            self.engine.import_node(node, model)
        log.info("event=job_planned job=%s cluster=%s epoch=%d local_clients=%d imports=%d",
                 self.spec.job_id, self.cluster_id, routing.epoch, len(local_clients),
                 len(imports))
        self._epoch = routing.epoch
        return {"clients": len(local_clients),
                "actors_materialized": self.runtime.actors_materialized()}

    def _nodes_lookup(self, node: str) -> str:
        with self._lock:
            try:
                return self._nodes[node]
            except KeyError:
                raise ControlError(f"node {node!r} is not in the job's placement") from None

    @contextlib.contextmanager
    def _exclusive(self, supersedes: str | None) -> Iterator[None]:
        """Hold the engine alone. With `supersedes` (a reason; "{round}" is filled in), a
        round still running here is ended first: the scheduler aborts an interrupted round
        before it re-plans, but a round whose training outlasts that wait would otherwise
        send along a plan that is gone and fail the repeated round under it."""
        with self._lock:
            running = self._running
        if supersedes is not None and running is not None and self.transport is not None:
            reason = supersedes.format(round=running[0])
            log.warning("event=round_superseded cluster=%s round=%d attempt=%d reason=%s",
                        self.cluster_id, running[0], running[1], reason)
            self.transport.abort_round(running[0], reason)
        if not self._engine_lock.acquire(timeout=self.round_timeout):
            raise ControlError(f"round {running[0] if running else '?'} is still running on "
                               f"cluster {self.cluster_id} after {self.round_timeout:.0f} s")
        try:
            yield
        finally:
            self._engine_lock.release()

    def _round(self, message: RoundRun) -> dict[str, Any]:
        if self.engine is None:
            raise ControlError("round.run before job.plan")
        r, attempt, deadline = message.round, message.attempt, message.deadline
        with self._lock:
            stale = self._running is not None and self._running[1] != attempt
        with self._exclusive(f"round {{round}} is run again (attempt {attempt})" if stale
                             else None):
            assert self.engine is not None
            if self._ran is not None and self._ran[:2] == (r, attempt):
                # asked again: its reply was lost with a link (fabricd resends round.run)
                return self._ran[2]
            if self.transport is not None and attempt != self.transport.attempt:
                # the round is repeated (a cluster was lost): its waits may be taken again
                self.transport.attempt = attempt
                self.mailbox.reopen_round(r)
            with self._lock:
                self._running = (r, attempt)
            if self.privacy is not None:
                self.privacy.attempt = attempt
            try:
                record = self.engine.run_round(r, None if deadline is None else float(deadline),
                                               message.clusters or ())
            except Exception as exc:  # user code and Ray raise anything: the job says why
                raise ControlError(explain_failure(exc, self.cluster_id, r, self.spec)) from exc
            finally:
                with self._lock:
                    self._running = None
            if self.privacy is not None:
                record.epsilon = self.privacy.epsilon(r)
            report = record.to_dict()
            self._ran = (r, attempt, report)
        if self.metrics is not None and self.spec is not None and self.runtime is not None:
            self.metrics.round_finished(
                self.spec.job_id, record.round, seconds=record.seconds,
                accuracy=record.accuracy, loss=record.loss, bytes_intra=record.bytes_intra,
                bytes_inter=record.bytes_inter,
                actors_materialized=self.runtime.actors_materialized(), epsilon=record.epsilon)
        return report

    def _abort_round(self, message: RoundAbort) -> dict[str, Any]:
        """End a round at once (another cluster is gone): its waits fail with `reason`."""
        if self.transport is None:
            raise ControlError("round.abort before job.plan")
        self.transport.abort_round(message.round, message.reason[:500])
        return {"aborted": message.round}

    def _export(self, message: NodeExport) -> dict[str, Any]:
        """Stream each moving node's state to the cluster it moves to (epoch = the new
        plan's, so the receiver takes it when that plan arrives)."""
        if self.engine is None or self.transport is None:
            raise ControlError("node.export before job.plan")
        epoch = self._epoch + 1 if message.epoch is None else message.epoch
        with self._exclusive(f"nodes move away (epoch {epoch}) while round {{round}} ran here"):
            return self._send_nodes(message, epoch)

    def _send_nodes(self, message: NodeExport, epoch: int) -> dict[str, Any]:
        assert self.engine is not None and self.transport is not None
        sent: list[str] = []
        for node, target in message.nodes.items():
            exported = self.engine.export_node(node)
            if exported is None:
                continue
            model, aggregator = exported  # the server state moves too (FedAdam's moments)
            tensors = {**{MODEL + k: v for k, v in model.items()},
                       **{AGGREGATOR + k: v for k, v in aggregator.items()}}
            self.transport.send_to(target, epoch, STATE, node, node,
                                   wire.encode(tensors, kind=STATE, samples=0))
            sent.append(node)
        return {"sent": sent}

    def _model(self, message: JobModel) -> dict[str, Any]:
        """The job's final model, streamed as an update. Three forms:
        {node, to_cluster}: that node's model (the root of a tree);
        {share_to}: this cluster's sample-weighted share, to the collecting cluster;
        {collect: [source nodes], to_cluster}: the mean of every share, evaluated here."""
        assert self.runtime is not None
        if self.engine is None or self.transport is None:
            raise ControlError("job.model before job.plan")
        engine, transport = self.engine, self.transport
        if message.share_to is not None:
            share = engine.local_share()
            if share is None:
                return {"source_node": ""}
            source = self._share_name()
            weights, samples = share
            size = transport.send_to(message.share_to, 0, FINAL, source, "final",
                                     wire.encode(weights, kind=FINAL, samples=samples))
            return {"source_node": source, "bytes": size}
        to_cluster = message.to_cluster
        if message.collect is not None:
            shares: list[tuple[Weights, int]] = []
            own = engine.local_share()
            if own is not None:
                shares.append(own)
            for source in message.collect:
                env = transport.receive(0, FINAL, source, "final", self.round_timeout)
                shares.append((env.weights, env.samples))
            if not shares:
                raise ControlError("no cluster holds a model to combine")
            weights = average(shares, self.runtime.make_inner_aggregator())
            node, samples = "consensus", sum(k for _, k in shares)
        else:
            node = message.node
            weights, samples = self.runtime.resolve(engine.current_model(node)), 0
        weights = engine.served(weights)
        accuracy, loss = self.runtime.evaluate_global(weights)
        size = transport.send_to(to_cluster, 0, FINAL, node, "scheduler",
                                 wire.encode(weights, kind=FINAL, samples=samples))
        return {"node": node, "bytes": size, "accuracy": accuracy, "loss": loss}

    def _checkpoint(self, message: JobCheckpoint) -> dict[str, Any]:
        assert self.runtime is not None
        if self.engine is None or self.transport is None:
            raise ControlError("job.checkpoint before job.plan")
        r, to_cluster = message.round, message.to_cluster
        sent: dict[str, int] = {}
        with_model = set(self.engine.checkpoint_nodes())
        # topk's per-edge references decide what every later message decodes to: a node
        # that sends or receives across clusters is checkpointed for them (a tree's client
        # with them alone)
        codec = self.codec if hasattr(self.codec, "export") else None
        with_codec: set[str] = codec.nodes() if codec is not None else set()
        for node in sorted(with_model | {n for n in with_codec if self._nodes.get(n)
                                         == self.cluster_id}):
            tensors: dict[str, np.ndarray] = {}
            if node in with_model:
                tensors.update({MODEL + k: v for k, v in
                                self.runtime.resolve(self.engine.current_model(node)).items()})
                tensors.update({AGGREGATOR + k: v
                                for k, v in self.engine.aggregator_state(node).items()})
            if codec is not None:
                tensors.update(codec.export(node))
            sent[node] = self.transport.send_to(to_cluster, r, STATE, node, CHECKPOINT,
                                                wire.encode(tensors, kind=STATE, samples=0))
        return {"nodes": sent}

    def _restore(self, message: JobRestore) -> dict[str, Any]:
        if self.engine is None:
            raise ControlError("job.restore before job.plan")
        if message.phase == "expect":
            nodes = set(message.nodes)
            foreign = sorted(n for n in nodes if self._nodes.get(n) != self.cluster_id)
            if foreign:
                raise ControlError(f"asked to restore nodes {foreign[:5]}, which the plan does "
                                   "not place on this cluster")
            self._restoring = (str(message.source_cluster), nodes)
            return {"expecting": len(nodes)}
        if self._restoring is None:
            raise ControlError("job.restore apply without expect")
        _, nodes = self._restoring
        # the compression references only when every node resumes from one checkpoint: a
        # single lost cluster's nodes must not take back references its peers moved past
        codec = self.codec if message.codec and hasattr(self.codec, "load") else None
        for node in sorted(nodes):
            env = self.mailbox.take((0, RESTORE, node, RESTORE), self.round_timeout,
                                    " (from the checkpoint)")
            weights = dict(env.weights)
            model = {k[len(MODEL):]: v for k, v in weights.items() if k.startswith(MODEL)}
            if codec is not None:
                codec.load(node, weights)
            if not model:  # a node checkpointed for its compression references only
                continue
            self.engine.restore_aggregator(node, {k[len(AGGREGATOR):]: v
                                                  for k, v in weights.items()
                                                  if k.startswith(AGGREGATOR)})
            self.engine.import_node(node, model)
        self._restoring = None
        log.info("event=restored job=%s cluster=%s nodes=%d", self.spec and self.spec.job_id,
                 self.cluster_id, len(nodes))
        return {"restored": sorted(nodes)}

    def _take_expected(self, what: str, expected: tuple[str, Collection[str]] | None,
                       job_id: str, node: str, source_cluster: str, payload: bytes, kind: str
                       ) -> dict[str, np.ndarray]:
        """The tensors of a `what` the scheduler streams (a checkpoint's node state, the
        final model to score): only from the cluster it named, for the nodes it named,
        while one is `expected` (that pair), for this job, a payload of `kind`."""
        if expected is None or source_cluster != expected[0] or node not in expected[1]:
            raise ControlError(f"unexpected {what} of node {node!r} from cluster "
                               f"{source_cluster!r}")
        if self.spec is None or job_id != self.spec.job_id:
            raise ControlError(f"{what} for job {job_id!r}")
        decoded = wire.decode(payload, source=f"{what} of node {node}")
        if decoded.kind != kind:
            raise ControlError(f"the {what} of node {node!r} is a {decoded.kind!r} payload")
        return {k: np.array(v) for k, v in decoded.tensors.items()}

    def _score(self, message: JobScore) -> dict[str, Any]:
        """The personalized accuracy of `round` (the job's last) against the final model the
        scheduler streams between `expect` and `apply` (NodeRuntime.final_personal)."""
        if self.engine is None or self.runtime is None:
            raise ControlError("job.score before job.plan")
        if message.phase == "expect":
            self._scoring = str(message.source_cluster)
            return {"expecting": 1}
        if self._scoring is None:
            raise ControlError("job.score apply without expect")
        try:  # (the stream may still be on its way: it is expected until it is taken)
            env = self.mailbox.take((0, SCORE, SCORE, SCORE), self.round_timeout,
                                    " (the final model to score)")
        finally:
            self._scoring = None
        engine = self.engine
        trained = engine.participants(message.round)
        nodes = [c for c in engine.local_clients() if c in trained]
        return self.runtime.final_personal(nodes, dict(env.weights), message.round)

    def _share_name(self) -> str:
        assert self.engine is not None
        nodes = self.engine.local_aggregators() or self.engine.local_clients()
        return nodes[0]

    def _stop(self, message: JobStop) -> dict[str, Any]:
        count = self.runtime.actors_materialized() if self.runtime is not None else 0
        self.mailbox.close("job stopped")
        if self.runtime is not None:
            self.runtime.close()
        self.stopped.set()
        reply: dict[str, Any] = {"actors_materialized": count}
        if self._daemon_counters is not None and self.spec is not None:
            # what fabricd itself counted for this job, to cross-check the executors' bytes
            reply["daemon"] = self._daemon_counters(self.spec.job_id)
        return reply
