"""Run one cluster's share of a round: the node programs of the nodes placed here.

Every cluster runs the same program for its own nodes; the transport decides whether a
message stays inside the cluster or crosses fabricd. A round has two phases so a bounded
thread pool cannot deadlock: first every local client trains and sends (waiting on
nobody), then every node waits for what it needs. Aggregators run on their own threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from worker.aggregators.base import cast_like, sample_weights
from worker.aggregators.base import weighted_average as base_weighted_average
from worker.executor.graph import DOWN, PEER, UP, RoundGraph
from worker.executor.transport import HybridTransport, Weights
from worker.topology.messages import weights_nbytes


class ClientPool(Protocol):
    """The cluster's clients (FederatedNode actors behind VirtualNodes)."""

    def samples(self, node: str) -> int: ...
    def put(self, weights: Weights) -> Any: ...
    def resolve(self, handle: Any) -> Weights: ...
    def train(self, node: str, model: Any, round_index: int) -> Any: ...
    def personal_score(self, trained: Any) -> tuple[int, int]:
        """(correct, total) of a client's freshly trained model on its own test split."""
        ...


class Aggregate(Protocol):
    def aggregate(self, global_weights: Weights,
                  updates: list[tuple[Weights, int]]) -> Weights: ...


@dataclass
class Evaluation:
    node: str
    accuracy: float
    loss: float
    weight: int


@dataclass
class RoundReport:
    """What this cluster reports for one round (combined by the scheduler)."""

    round: int
    cluster_id: str
    evaluations: list[Evaluation] = field(default_factory=list)
    personal_correct: int = 0
    personal_total: int = 0
    bytes_intra: int = 0
    bytes_inter: int = 0
    messages_intra: int = 0
    messages_inter: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "round": self.round, "cluster_id": self.cluster_id,
            "evaluations": [[e.node, e.accuracy, e.loss, e.weight] for e in self.evaluations],
            "personal_correct": self.personal_correct, "personal_total": self.personal_total,
            "bytes_intra": self.bytes_intra, "bytes_inter": self.bytes_inter,
            "messages_intra": self.messages_intra, "messages_inter": self.messages_inter,
            "seconds": self.seconds,
        }


def weighted_average(items: Iterable[tuple[Weights, int]]) -> Weights:
    """Sample-weighted mean of models, in the dtypes of the first model."""
    updates = list(items)
    shares = sample_weights(updates, "model averaging")
    return cast_like(base_weighted_average(updates, shares), updates[0][0])


class ClusterEngine:
    """Holds the state of this cluster's nodes across rounds and runs rounds."""

    def __init__(
        self,
        *,
        cluster_id: str,
        graph: RoundGraph,
        transport: HybridTransport,
        pool: ClientPool,
        initial_weights: Weights,
        make_aggregator: Callable[[str], Aggregate],
        make_inner_aggregator: Callable[[], Aggregate],
        evaluate_global: Callable[[Weights], tuple[float, float]],
        timeout: float = 600.0,
        workers: int = 16,
    ) -> None:
        self.cluster_id = cluster_id
        self.graph = graph
        self.transport = transport
        self.pool = pool
        self.timeout = timeout
        self._make_aggregator = make_aggregator
        self._make_inner = make_inner_aggregator
        self._evaluate_global = evaluate_global
        self._workers = workers
        self._initial = initial_weights
        # Every message carries a full model of one fixed shape: its size is known without
        # fetching the referenced object.
        self._model_nbytes = weights_nbytes(initial_weights)
        self._models: dict[str, Any] = {}       # node -> handle of its current model
        self._aggregators: dict[str, Aggregate] = {}
        self._lock = threading.Lock()

    # -- placement ---------------------------------------------------------------------
    def local_clients(self) -> list[str]:
        return [c for c in self.graph.clients if self.transport.is_local(c)]

    def local_aggregators(self) -> list[str]:
        return [a for a in self.graph.aggregators if self.transport.is_local(a)]

    def current_model(self, node: str) -> Any:
        with self._lock:
            if node not in self._models:
                self._models[node] = self.pool.put(self._initial)
            return self._models[node]

    def export_node(self, node: str) -> Weights | None:
        """The node's current model (to migrate it); None if it never left the initial one."""
        with self._lock:
            handle = self._models.pop(node, None)
            self._aggregators.pop(node, None)
        return None if handle is None else self.pool.resolve(handle)

    def adopt(self, previous: ClusterEngine, nodes: Iterable[str]) -> None:
        """Carry over the models (and aggregator state) of `nodes` from a previous plan."""
        with previous._lock:
            models = {n: previous._models[n] for n in nodes if n in previous._models}
            aggregators = {n: previous._aggregators[n] for n in models
                           if n in previous._aggregators}
        with self._lock:
            self._models.update(models)
            self._aggregators.update(aggregators)

    def import_node(self, node: str, weights: Weights) -> None:
        with self._lock:
            self._models[node] = self.pool.put(weights)

    # -- one round ----------------------------------------------------------------------
    def run_round(self, round_index: int) -> RoundReport:
        started = time.perf_counter()
        report = RoundReport(round_index, self.cluster_id)
        clients = self.local_clients()
        aggregators = self.local_aggregators()
        errors: list[BaseException] = []
        agg_threads = [threading.Thread(target=self._guard, args=(errors, self._aggregator_program,
                                                                  a, round_index, report),
                                        name=f"agg-{a}", daemon=True) for a in aggregators]
        for t in agg_threads:
            t.start()
        with ThreadPoolExecutor(max_workers=max(1, min(self._workers, len(clients) or 1)),
                                thread_name_prefix="client") as pool:
            sent: list[Future[Any]] = [pool.submit(self._client_send, c, round_index)
                                       for c in clients]
            trained = {c: f.result() for c, f in zip(clients, sent, strict=True)}
            done = [pool.submit(self._guard, errors, self._client_receive, c, round_index,
                                trained[c], report) for c in clients]
            for f in done:
                f.result()
        for t in agg_threads:
            t.join()
        if errors:
            raise errors[0]  # the first failure in time is the cause; later ones follow from it
        counters = self.transport.counters.snapshot_and_reset()
        report.bytes_intra = counters.bytes_intra
        report.bytes_inter = counters.bytes_inter
        report.messages_intra = counters.messages_intra
        report.messages_inter = counters.messages_inter
        report.seconds = time.perf_counter() - started
        return report

    def _guard(self, errors: list[BaseException], fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # surfaced by run_round, earliest first
            with self._lock:
                errors.append(exc)

    def _client_send(self, node: str, r: int) -> Any:
        trained = self.pool.train(node, self.current_model(node), r)
        samples = self.pool.samples(node)
        nbytes = self._model_nbytes
        if self.graph.kind in ("star", "hierarchical", "hybrid"):
            self.transport.send(r, UP, node, self.graph.parent[node], trained, samples, nbytes)
        else:
            for peer in self.graph.peers.get(node, ()):
                self.transport.send(r, PEER, node, peer, trained, samples, nbytes)
        return trained

    def _client_receive(self, node: str, r: int, trained: Any, report: RoundReport) -> None:
        if self.graph.kind in ("star", "hierarchical", "hybrid"):
            # twice the timeout: if the parent is stuck, its own wait fails first and names
            # the node that is really missing
            envelope = self.transport.receive(r, DOWN, self.graph.parent[node], node,
                                              2 * self.timeout)
            model = envelope.weights if not envelope.remote else self.pool.put(envelope.weights)
        else:
            received = [(self.pool.resolve(trained), self.pool.samples(node))]
            for peer in self.graph.peers.get(node, ()):
                env = self.transport.receive(r, PEER, peer, node, self.timeout)
                received.append((self.pool.resolve(env.weights), env.samples))
            averaged = weighted_average(received)
            model = self.pool.put(averaged)
            accuracy, loss = self._evaluate_global(averaged)
            with self._lock:
                report.evaluations.append(Evaluation(node, accuracy, loss, self.pool.samples(node)))
        # personalized accuracy: the model the client just fine-tuned on its own data,
        # scored on its own test split (measured by the actor right after training)
        correct, total = self.pool.personal_score(trained)
        with self._lock:
            self._models[node] = model
            report.personal_correct += correct
            report.personal_total += total

    def _aggregator_program(self, node: str, r: int, report: RoundReport) -> None:
        graph = self.graph
        children = graph.children(node)
        updates: list[tuple[Weights, int]] = []
        for child in children:
            env = self.transport.receive(r, UP, child, node, self.timeout)
            updates.append((self.pool.resolve(env.weights), env.samples))
        samples = sum(n for _, n in updates)
        current = self.pool.resolve(self.current_model(node))
        with self._lock:
            if node not in self._aggregators:
                root = graph.root(node) or graph.kind == "hybrid"
                self._aggregators[node] = self._make_aggregator(node) if root else self._make_inner()
            aggregator = self._aggregators[node]
        model = aggregator.aggregate(current, updates)
        nbytes = self._model_nbytes
        if graph.kind == "hybrid" and graph.exchanges(r):
            handle = self.pool.put(model)
            for peer in graph.peers.get(node, ()):
                self.transport.send(r, PEER, node, peer, handle, samples, nbytes)
            group_models = [(model, samples)]
            for peer in graph.peers.get(node, ()):
                env = self.transport.receive(r, PEER, peer, node, self.timeout)
                group_models.append((self.pool.resolve(env.weights), env.samples))
            model = weighted_average(group_models)
        if node in graph.parent:  # an inner level of a hierarchy: pass up, wait for the root
            handle = self.pool.put(model)
            self.transport.send(r, UP, node, graph.parent[node], handle, samples, nbytes)
            env = self.transport.receive(r, DOWN, graph.parent[node], node, self.timeout)
            model = self.pool.resolve(env.weights)
        handle = self.pool.put(model)
        with self._lock:
            self._models[node] = handle
        for child in children:
            self.transport.send(r, DOWN, node, child, handle, samples, nbytes)
        if node not in graph.parent:
            accuracy, loss = self._evaluate_global(model)
            with self._lock:
                report.evaluations.append(Evaluation(node, accuracy, loss, samples))
