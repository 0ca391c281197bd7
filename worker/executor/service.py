"""The executor's control surface: what it does for each scheduler message.

Messages (the `kind` of the body; the daemon only passes on bodies signed by a
`scheduler` certificate):
- `job.start` {job, clients}: build the job's partitions, reply with the label histograms
  of `clients` (no sample leaves the cluster) and this cluster's capacity;
- `job.plan` {graph, routing, imports}: adopt the round graph and the routing matrix
  (every neighbour is looked up there),
  materialize the local clients, import migrated node states;
- `round.run` {round}: run this cluster's share of the round, reply with its report;
- `node.export` {nodes}: hand over the state of nodes that move to another cluster;
- `job.model` {node}: the node's current model as safetensors bytes;
- `job.stop`: release actors and reply with how many were materialized.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from proto.job import JobSpec
from proto.routing import RoutingMatrix
from worker.executor import graph as rg
from worker.executor.engine import ClientPool, ClusterEngine
from worker.executor.mailbox import Mailbox
from worker.executor.transport import HybridTransport, RemoteLink, Weights

log = logging.getLogger("fedpilot.executor")


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
    def weights_to_bytes(self, weights: Weights) -> bytes: ...
    def bytes_to_weights(self, data: bytes) -> Weights: ...
    def close(self) -> None: ...


RuntimeFactory = Callable[[JobSpec], JobRuntime]


class ControlError(ValueError):
    """A control message is malformed or out of order; the reason goes back to the scheduler."""


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
        self.transport: HybridTransport | None = None
        self.mailbox = Mailbox()
        self.stopped = threading.Event()
        self._nodes: dict[str, str] = {}
        self._lock = threading.Lock()

    def handle(self, body: dict[str, Any]) -> dict[str, Any]:
        kind = body.get("kind")
        handler = {
            "job.start": self._start, "job.plan": self._plan, "round.run": self._round,
            "node.export": self._export, "job.model": self._model, "job.stop": self._stop,
        }.get(str(kind))
        if handler is None:
            raise ControlError(f"unknown control message kind {kind!r}")
        if kind != "job.start" and self.spec is None:
            raise ControlError(f"{kind} before job.start")
        if self.spec is not None and body.get("job_id") != self.spec.job_id:
            raise ControlError(f"message for job {body.get('job_id')!r}; this executor runs "
                               f"{self.spec.job_id!r}")
        return handler(body)

    def deliver(self, message_id: str, payload: bytes) -> None:
        """An update from another cluster (via fabricd)."""
        transport = self.transport
        if transport is None:
            raise ControlError(f"update {message_id} arrived before the job was planned")
        transport.deliver_remote(message_id, payload)

    # -- handlers --------------------------------------------------------------------------
    def _start(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.spec is not None:
            raise ControlError(f"job {self.spec.job_id!r} already started on this executor")
        spec = JobSpec.from_dict(body["job"], source="job.start message")
        self.spec = spec
        self.runtime = self._make_runtime(spec)
        clients = [int(c) for c in body.get("clients", [])]
        hist = self.runtime.histograms(clients)
        log.info("event=job_started job=%s cluster=%s clients=%d", spec.job_id,
                 self.cluster_id, len(clients))
        return {"histograms": {str(k): v for k, v in hist.items()},
                "capacity": self.runtime.capacity()}

    def _plan(self, body: dict[str, Any]) -> dict[str, Any]:
        assert self.spec is not None and self.runtime is not None
        graph = rg.from_dict(body["graph"])
        routing = RoutingMatrix.from_bytes(bytes(body["routing"]))
        if routing.job_id != self.spec.job_id:
            raise ControlError(f"routing matrix is for job {routing.job_id!r}")
        if self.cluster_id not in routing.clusters:
            raise ControlError(f"routing matrix does not name this cluster ({self.cluster_id})")
        stray = [(a, b) for a, b in graph.edges() if not routing.is_edge(a, b)]
        if stray:
            raise ControlError(f"round graph edges {stray[:5]} are not in the routing matrix")
        try:
            nodes = {node: routing.cluster_of(node) for node in graph.nodes}
        except (KeyError, ValueError) as exc:
            raise ControlError(f"routing matrix does not place every node: {exc}") from None
        with self._lock:
            self._nodes = nodes
        locate = self._nodes_lookup
        if self.transport is None:
            self.transport = HybridTransport(
                job_id=self.spec.job_id, local_cluster=self.cluster_id, locate=locate,
                mailbox=self.mailbox, resolve=self.runtime.resolve,
                codec=self.runtime.make_codec(), link=self.link)
        local_clients = [c for c in graph.clients if nodes[c] == self.cluster_id]
        self.runtime.assign(local_clients)
        previous = self.engine
        self.engine = ClusterEngine(
            cluster_id=self.cluster_id, graph=graph, transport=self.transport, pool=self.runtime,
            initial_weights=self.runtime.initial_weights,
            make_aggregator=self.runtime.make_aggregator,
            make_inner_aggregator=self.runtime.make_inner_aggregator,
            evaluate_global=self.runtime.evaluate_global, timeout=self.round_timeout)
        if previous is not None:  # nodes that stay here keep their models (and the state)
            self.engine.adopt(previous, [n for n in graph.nodes if nodes[n] == self.cluster_id])
        for node, state in body.get("imports", {}).items():
            self.engine.import_node(str(node), self.runtime.bytes_to_weights(bytes(state)))
        log.info("event=job_planned job=%s cluster=%s epoch=%d local_clients=%d imports=%d",
                 self.spec.job_id, self.cluster_id, routing.epoch, len(local_clients),
                 len(body.get("imports", {})))
        return {"clients": len(local_clients),
                "actors_materialized": self.runtime.actors_materialized()}

    def _nodes_lookup(self, node: str) -> str:
        with self._lock:
            try:
                return self._nodes[node]
            except KeyError:
                raise ControlError(f"node {node!r} is not in the job's placement") from None

    def _round(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.engine is None:
            raise ControlError("round.run before job.plan")
        report = self.engine.run_round(int(body["round"]))
        return report.to_dict()

    def _export(self, body: dict[str, Any]) -> dict[str, Any]:
        assert self.runtime is not None
        if self.engine is None:
            raise ControlError("node.export before job.plan")
        states: dict[str, bytes] = {}
        for node in body.get("nodes", []):
            weights = self.engine.export_node(str(node))
            if weights is not None:
                states[str(node)] = self.runtime.weights_to_bytes(weights)
        return {"states": states}

    def _model(self, body: dict[str, Any]) -> dict[str, Any]:
        assert self.runtime is not None
        if self.engine is None:
            raise ControlError("job.model before job.plan")
        node = str(body.get("node", ""))
        weights = self.runtime.resolve(self.engine.current_model(node))
        return {"node": node, "model": self.runtime.weights_to_bytes(weights)}

    def _stop(self, body: dict[str, Any]) -> dict[str, Any]:
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
