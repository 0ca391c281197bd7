"""The round engine: the only place a round is run, for one cluster or many.

Every cluster runs the same program for its own nodes; the transport decides whether a
message stays inside the cluster or crosses fabricd. A single-cluster job is a mesh of
one. The round's participants (`client_fraction`) are drawn from (seed, round), so every
cluster trains the same set without a message. A round has two phases so a bounded
thread pool cannot deadlock: first every participating local client trains and sends
(waiting on nobody), then every node waits for what it needs. Aggregators run on their
own threads. Any failure aborts the round's waits at once, every thread is joined, and
the first failure is raised with its cause.

Where each number comes from:
- personalized accuracy: each trained client's model right after local training, or the
  model it received (its outputs shifted to the client's label mix: `label_offsets`)
  where that got more of the others right, scored on the client's own
  held-out split (by the actor that trained it; FederatedNode.train); the job's last
  round is scored again against the final model (job.score), by a personalization
  policy only where, for every cluster, the other clusters' samples show it better than
  the final model, else by the final model (proto.rounds.personal_choice);
- accuracy/loss: the root's new model (star, hierarchical), each group's model after the
  exchange (hybrid), each participating node's model after mixing (decentralized).
Decentralized mixing uses the job's aggregator at every node, with the node's model
before training as the reference (so a server optimizer sees the round's pseudo-gradient).
Its weights are the plan's sample counts of the node and its neighbours. Measured against
two textbook alternatives (bench_learning, MNIST, k_connected + fedavg, seeds 0 / 1; this
rule 0.909 / 0.918): Metropolis-Hastings weights, which keep the job's sample-weighted
mean exactly, 0.898 / 0.880; uniform 1 / (degree + 1), 0.895 / 0.901. Both mix slower.
With `client_fraction` < 1 a round mixes its participants and their neighbours, each with
its drawn neighbours' trained models only (`Draw`).
With the plan's mixing steps s > 1 (`topology.mixing_steps`, or for 0 what the plan chose
from the graph's mixing factor) the nodes then average with their neighbours s - 1 more
times (the mixed models, kinds peer2, peer3, ...): their disagreement shrinks by the
graph's mixing factor s times a round instead of once, for s times the peer traffic; the
round's accuracy is taken after the last step.
Hybrid groups aggregate their clients with the job's aggregator and exchange by FedAvg,
except under a server optimizer (fedavgm, fedadam, ...): then groups average their clients
and the optimizer steps once on the mean of all groups, from the last exchange's model, so
every group follows the same trajectory a star would. Inner hierarchy levels use FedAvg.

A star root whose rounds may close early (`rounds.min_participation` < 1,
`aggregation.mode = "buffered"`) sends the round's model only to the clusters that train
in it and takes the clients' updates from a `ContributionBuffer`
(worker.executor.contributions), which closes the aggregation by the job's rule, one
`Contribution` per cluster; `combine_contributions` moves a stale one onto the current
model by its staleness weight w (current + w (update - the model it started from)).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Set
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from proto.rounds import RoundRecord
from worker.aggregators.base import AggregationError, Aggregator, Memo, SharedMeans, digest
from worker.executor.contributions import CloseRule, Contribution, ContributionBuffer, applied
from worker.executor.graph import (
    DOWN,
    MIXING_KINDS,
    PEER,
    UP,
    RoundGraph,
    mixing_kind,
    participants,
)
from worker.executor.transport import HybridTransport, Weights, conform_error
from worker.privacy import flatten

log = logging.getLogger("fedpilot.executor")
#: key prefix of a hybrid group's anchor in its aggregator state (checkpoints, migration);
#: an aggregator's own keys are "slot/tensor"
ANCHOR = "anchor:"


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


#: rounds whose `Draw` an engine keeps (the one it runs, the next, a late neighbour's)
DRAWS_KEPT = 4


def model_nbytes(weights: Weights) -> int:
    """Bytes of tensor data in a model (what an intra-cluster reference stands for)."""
    return int(sum(np.asarray(v).nbytes for v in weights.values()))


class ClusterEngine:
    """Holds the state of this cluster's nodes across rounds and runs rounds."""

    #: a round's pooled means and evaluations are computed once however many nodes need
    #: them (False: every node does its own; bench/bench_mixing.py's baseline)
    share_work = True

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
        seed: int = 0,
        client_fraction: float = 1.0,
        timeout: float = 600.0,
        workers: int = 16,
        mixing_steps: int = 1,
        close_rule: CloseRule | None = None,
    ) -> None:
        self.cluster_id = cluster_id
        self.graph = graph
        self.transport = transport
        self.pool = pool
        self.timeout = timeout
        self.seed = seed
        self.client_fraction = client_fraction
        #: decentralized: neighbour averagings per round (topology.mixing_steps)
        self.mixing_steps = mixing_steps if graph.decentralized else 1
        self._make_aggregator = make_aggregator
        self._make_inner = make_inner_aggregator
        self._evaluate_served = evaluate_global
        self._workers = workers
        self._initial = initial_weights
        # Every message carries a full model of one fixed shape: its size is known without
        # fetching the referenced object.
        self._model_nbytes = model_nbytes(initial_weights)
        self._models: dict[str, Any] = {}       # node -> handle of its current model
        self._initial_handle: Any = None
        self._aggregators: dict[str, Aggregate] = {}
        # hybrid groups under a server optimizer: the common model of the last exchange,
        # from which the optimizer's step is taken (the round's start when every round
        # exchanges)
        self._anchors: dict[str, Weights] = {}
        self._behind: dict[str, int] = {}      # aggregator -> samples of its clients
        self._local_clients: list[str] | None = None
        self._lock = threading.Lock()
        # a round's work done once however many nodes need it (`_evaluate_global`,
        # `_mix`, one SharedMeans per mixing step); both are new every round
        self._evaluations = Memo()
        self._means: dict[int, SharedMeans] = {}
        # decentralized: each trained node's model as the round began, where its
        # aggregator's on_stall goes back to (`_store_mixed`); new every round
        self._starts: dict[str, Any] = {}
        #: clients that sit out every round of this plan (pinned data on a lost cluster)
        self.absent: frozenset[str] = frozenset()
        #: [privacy]: protects each client's update before it goes up, and combines what
        #: a star's root received (worker.privacy.Privacy)
        self.privacy: Any = None
        #: the clusters that train in the round being run (None: all)
        self.round_clusters: frozenset[str] | None = None
        # a star root whose rounds may close early takes its updates from a buffer
        self.buffer: ContributionBuffer | None = None
        transport.rounds_skip = close_rule is not None
        transport.collectors = {}
        if close_rule is not None and graph.kind == "star":
            self.buffer = ContributionBuffer(close_rule, transport._locate, transport.aborted)
            transport.collectors = {r: self.buffer for r in self.local_aggregators()}
        # the last few rounds' Draw and active nodes (`_round_nodes`)
        self._draws: dict[tuple[int, frozenset[str]], tuple[Draw, frozenset[str]]] = {}
        transport.expects = self.unexpected

    # -- placement (fixed for the life of an engine: a new plan makes a new engine) -----
    def local_clients(self) -> list[str]:
        if self._local_clients is None:
            self._local_clients = [c for c in self.graph.clients if self.transport.is_local(c)]
        return self._local_clients

    def local_aggregators(self) -> list[str]:
        return [a for a in self.graph.aggregators if self.transport.is_local(a)]

    def participants(self, round_index: int) -> set[str]:
        """Every client of the job that trains in `round_index` (wherever it lives), less
        the ones that sit out."""
        n = len(self.graph.clients)
        drawn = {f"c{i}" for i in participants(n, self.client_fraction, self.seed, round_index)}
        return drawn - self.absent

    def draw(self, round_index: int) -> Draw:
        """Who trains in `round_index` and, decentralized, who mixes (see `Draw`)."""
        return self._round_nodes(round_index)[0]

    def _round_nodes(self, round_index: int) -> tuple[Draw, frozenset[str]]:
        """The round's `Draw` and its active nodes (`RoundGraph.active`), kept for the
        last DRAWS_KEPT rounds: every delivery asks (`unexpected`)."""
        key = (round_index, self.absent)
        with self._lock:
            known = self._draws.get(key)
        if known is not None:
            return known
        trained = self.participants(round_index)
        if not self.graph.decentralized or self.client_fraction >= 1.0:
            draw = Draw(trained, trained)
        else:
            covered = set(trained)
            for node in trained:
                covered.update(self.graph.peers.get(node, ()))
            draw = Draw(trained, covered - self.absent)
        nodes = (draw, frozenset(self.graph.active(trained)))
        with self._lock:
            self._draws[key] = nodes
            for old in sorted(self._draws, key=lambda k: k[0])[:-DRAWS_KEPT]:
                del self._draws[old]
        return nodes

    def unexpected(self, round_index: int, kind: str, src: str, dst: str) -> str | None:
        """Why this round's plan has no `kind` model from `src` for `dst` (None: it has
        one). A tree's: up only from an active node to its parent, down only from a
        parent to an active child, between hybrid groups only in a round they exchange
        in. A decentralized job's neighbours' models: from a neighbour, to a node that
        mixes in the round, in the first step only from one drawn to train, in a later
        step (up to the job's mixing steps) only from one that mixes. Set as the
        transport's `expects`: a member cannot add models the round does not have (a
        voter more for a robust aggregator) or park them in this executor's memory."""
        graph = self.graph
        if kind not in (UP, DOWN, PEER, *MIXING_KINDS):
            return None
        draw, active = self._round_nodes(round_index)
        if kind in (UP, DOWN):
            child, parent = (src, dst) if kind == UP else (dst, src)
            if graph.parent.get(child) != parent:
                return f"{parent} is not the parent of {child} in the plan"
            if child not in active:
                return f"{child} takes no part in round {round_index}"
            return None
        if dst not in graph.peers.get(src, ()):
            return f"{src} is not a neighbour of {dst} in the plan"
        if not graph.decentralized:
            if kind != PEER or not graph.exchanges(round_index):
                return f"the groups do not exchange {kind} models in round {round_index}"
            return None
        step = 1 if kind == PEER else MIXING_KINDS.index(kind) + 2
        if step > self.mixing_steps:
            return f"the job mixes {self.mixing_steps} time(s) a round, not {step}"
        if dst not in draw.mixing:
            return f"{dst} takes no neighbour's model in round {round_index}"
        if src not in (draw.trained if step == 1 else draw.mixing):
            return (f"{src} was not drawn to train in round {round_index}" if step == 1
                    else f"{src} does not mix in round {round_index}")
        return None

    def current_model(self, node: str) -> Any:
        with self._lock:
            if node not in self._models:   # one handle of the initial model for every node
                self._models[node] = self._initial_model(locked=True)
            return self._models[node]

    def _initial_model(self, locked: bool = False) -> Any:
        """The one handle of the job's initial model every node starts from."""
        with nullcontext() if locked else self._lock:
            if self._initial_handle is None:
                self._initial_handle = self.pool.put(self._initial)
            return self._initial_handle

    def export_node(self, node: str) -> tuple[Weights, Weights] | None:
        """The node's current model and its aggregator's server state (to migrate it; the
        node leaves this engine); None if it never left the initial model."""
        state = self.aggregator_state(node)
        with self._lock:
            handle = self._models.pop(node, None)
            self._aggregators.pop(node, None)
            self._anchors.pop(node, None)
        return None if handle is None else (self.pool.resolve(handle), state)

    def adopt(self, previous: ClusterEngine, nodes: Iterable[str]) -> None:
        """Carry over the models (and aggregator state) of `nodes` from a previous plan."""
        with previous._lock:
            models = {n: previous._models[n] for n in nodes if n in previous._models}
            aggregators = {n: previous._aggregators[n] for n in models
                           if n in previous._aggregators}
            anchors = {n: previous._anchors[n] for n in models if n in previous._anchors}
        with self._lock:
            self._models.update(models)
            self._aggregators.update(aggregators)
            self._anchors.update(anchors)
        if self.buffer is not None and previous.buffer is not None and models:
            # contributions on their way stay on their way (the root stayed here)
            self.buffer = previous.buffer
            self.buffer.keep_only({self.transport._locate(c) for c in self.graph.clients})
            self.transport.collectors = {r: self.buffer for r in self.transport.collectors}

    def import_node(self, node: str, weights: Weights) -> None:
        with self._lock:
            self._models[node] = self.pool.put(weights)

    def checkpoint_nodes(self) -> list[str]:
        """Local nodes whose state a checkpoint must hold to continue exactly: the roots
        (and hybrid groups) of a tree, whose clients start every round from the model sent
        down; in a decentralized topology every node that has a model of its own."""
        if self.graph.decentralized:
            with self._lock:
                return [c for c in self.local_clients() if c in self._models]
        return [a for a in self.local_aggregators() if self.graph.root(a)]

    def aggregator_state(self, node: str) -> Weights:
        """The server state of the node's aggregator (empty if it has none yet), with a
        hybrid group's anchor (the model of its last exchange) under ANCHOR keys."""
        with self._lock:
            aggregator = self._aggregators.get(node)
            anchor = self._anchors.get(node)
        state = getattr(aggregator, "state_dict", None)
        out = dict(state()) if callable(state) else {}
        if anchor is not None:
            out.update({ANCHOR + k: v for k, v in anchor.items()})
        return out

    def restore_aggregator(self, node: str, state: Weights) -> None:
        """The node's aggregator state and hybrid anchor from another cluster (a migrating
        node, a checkpoint): checked against the job's model first (`load_state_dict`;
        an anchor is a model), AggregationError naming the key, nothing taken."""
        anchor = {k[len(ANCHOR):]: v for k, v in state.items() if k.startswith(ANCHOR)}
        rest = {k: v for k, v in state.items() if not k.startswith(ANCHOR)}
        if anchor:
            wrong = conform_error(anchor, {k: np.shape(v) for k, v in self._initial.items()})
            if wrong is not None:
                raise AggregationError(f"node {node!r}: its anchor {wrong}")
        load = getattr(self._aggregator(node), "load_state_dict", None)
        if rest and callable(load):
            load(rest, self._initial)
        if anchor:
            with self._lock:
                self._anchors[node] = anchor

    def local_share(self) -> tuple[Weights, int] | None:
        """The sample-weighted mean of the models this cluster evaluates (group models for
        hybrid, client models for decentralized topologies) and the samples behind it; the
        job's final model is the same mean over every cluster's share."""
        nodes = (self.local_aggregators() if self.graph.kind == "hybrid"
                 else self.local_clients())
        items = [(self.pool.resolve(self.current_model(n)), self._samples_behind(n))
                 for n in nodes]
        items = [(w, k) for w, k in items if k > 0]
        if not items:
            return None
        return average(items, self._make_inner()), sum(k for _, k in items)

    def _trusted_samples(self, node: str, claimed: int, active: Set[str] | None) -> int:
        """The weight a message from `node` gets: what the plan says stands behind it (its
        own samples; an aggregator's participating descendants'; a hybrid group's whole
        membership), never the sender's claim, so a member cannot inflate its say in an
        average. A claim that differs is logged."""
        if self.graph.is_client(node):
            trusted = self.pool.samples(node)
        elif active is None:
            trusted = self._samples_behind(node)
        else:
            trusted = sum(self._trusted_samples(c, 0, active) if not self.graph.is_client(c)
                          else self.pool.samples(c)
                          for c in self.graph.children(node) if c in active)
        if claimed != trusted and claimed:
            log.warning("event=sample_claim_ignored cluster=%s node=%s claimed=%d plan=%d",
                        self.cluster_id, node, claimed, trusted)
        return trusted

    def _samples_behind(self, node: str) -> int:
        if self.graph.is_client(node):
            return 0 if node in self.absent else self.pool.samples(node)
        # fixed for the engine's life (a new plan makes a new engine): a hybrid group of
        # 300,000 clients is summed once, not in every round
        cached = self._behind.get(node)
        if cached is None:
            cached = self._behind[node] = sum(self._samples_behind(c)
                                              for c in self.graph.children(node))
        return cached

    # -- one round ----------------------------------------------------------------------
    def run_round(self, round_index: int, timeout: float | None = None,
                  clusters: Iterable[str] = ()) -> RoundRecord:
        """Run this cluster's share of round `round_index`; raises the first failure.
        `timeout`: how long a node waits for a message this round (the scheduler's
        deadline, adapted to measured round times); default the engine's. `clusters`: the
        clusters that train in it (empty: all)."""
        if timeout is not None:
            self.timeout = timeout
        self.round_clusters = frozenset(clusters) or None
        self.transport.retry_seconds = self.timeout  # a send is retried until the deadline
        started = time.perf_counter()
        self.transport.begin_round(round_index)
        record = RoundRecord(round_index)
        with self._lock:
            self._evaluations, self._means, self._starts = Memo(), {}, {}
        draw, active = self._round_nodes(round_index)
        trained = draw.trained
        clients = [c for c in self.local_clients() if c in draw.mixing]
        aggregators = [a for a in self.local_aggregators() if a in active]
        errors: list[BaseException] = []
        fail = self._failer(errors, round_index)
        # owned by this round: joined in the finally below, on every path
        agg_threads = [threading.Thread(target=self._guard, args=(fail, self._aggregator_program,
                                                                  a, round_index, active, record),
                                        name=f"agg-{a}", daemon=True) for a in aggregators]
        for t in agg_threads:
            t.start()
        try:
            with ThreadPoolExecutor(max_workers=max(1, min(self._workers, len(clients) or 1)),
                                    thread_name_prefix="client") as pool:
                sent: list[Future[Any]] = [
                    pool.submit(self._guard, fail, self._client_send, c, round_index, draw)
                    for c in clients]
                wait(sent)
                if not errors:
                    done = [pool.submit(self._guard, fail, self._client_receive, c, round_index,
                                        f.result(), draw, record)
                            for c, f in zip(clients, sent, strict=True)]
                    wait(done)
                # further mixing steps, each in two phases as well (send, then receive): a
                # node's receive waits only on sends of a phase that has ended
                for step in range(2, self.mixing_steps + 1):
                    if errors:
                        break
                    wait([pool.submit(self._guard, fail, self._mix_send, c, round_index, step,
                                      draw.mixing) for c in clients])
                    if errors:
                        break
                    wait([pool.submit(self._guard, fail, self._mix_receive, c, round_index,
                                      step, draw, record) for c in clients])
        finally:
            for t in agg_threads:
                t.join()
        if errors:
            raise errors[0]  # the first failure in time is the cause; later ones follow from it
        counters = self.transport.counters.snapshot_and_reset()
        record.participants = sum(1 for c in clients if c in trained)
        record.bytes_intra = counters.bytes_intra
        record.bytes_inter = counters.bytes_inter
        record.messages_intra = counters.messages_intra
        record.messages_inter = counters.messages_inter
        record.seconds = time.perf_counter() - started
        return record

    def _failer(self, errors: list[BaseException], round_index: int
                ) -> Callable[[BaseException], None]:
        def fail(exc: BaseException) -> None:
            with self._lock:
                errors.append(exc)
                first = len(errors) == 1
            if first:  # wake every wait of this round: nobody sits out its timeout
                self.transport.abort_round(round_index, f"{type(exc).__name__}: {exc}")
        return fail

    def _guard(self, fail: Callable[[BaseException], None], fn: Callable[..., Any],
               *args: Any) -> Any:
        try:
            return fn(*args)
        except BaseException as exc:  # surfaced by run_round, earliest first
            fail(exc)
            return None

    def _client_send(self, node: str, r: int, draw: Draw) -> Any:
        """Train and send: from the parent's model of this round (it sends it down first;
        twice the timeout, so that if the parent is stuck its own wait fails first and
        names the node really missing), or, decentralized, from the node's own model (a
        node not drawn sends nothing: it only takes its drawn neighbours' models)."""
        trained = draw.trained
        if not self.graph.decentralized:
            parent = self.graph.parent[node]
            envelope = self.transport.receive(r, DOWN, parent, node, 2 * self.timeout)
            start = envelope.weights if not envelope.remote else self.pool.put(envelope.weights)
        else:
            start = self.current_model(node)
            if node not in trained:
                return start
            with self._lock:
                self._starts[node] = start
        update = self.pool.train(node, start, r)
        samples = self.pool.samples(node)
        nbytes = self._model_nbytes
        if not self.graph.decentralized:
            parent = self.graph.parent[node]
            sent = update if self.privacy is None else self.pool.put(self.privacy.protect(
                node, r, self.pool.resolve(start), self.pool.resolve(update),
                [c for c in self.graph.children(parent) if c in trained], parent))
            self.transport.send(r, UP, node, parent, sent, samples, nbytes)
        else:
            self.transport.send_many(r, PEER, node, self._mixing_peers(node, draw.mixing),
                                     update, samples, nbytes)
        return update

    def _mixing_peers(self, node: str, mixing: set[str]) -> list[str]:
        return [peer for peer in self.graph.peers.get(node, ()) if peer in mixing]

    def _client_receive(self, node: str, r: int, update: Any, draw: Draw,
                        record: RoundRecord) -> None:
        trained = draw.trained
        if self.graph.decentralized:
            # the node's own model (trained or not) and its trained neighbours'
            received = [(self.pool.resolve(update), self.pool.samples(node))]
            for peer in self.graph.peers.get(node, ()):
                if peer in trained:
                    env = self.transport.receive(r, PEER, peer, node, self.timeout)
                    received.append((self.pool.resolve(env.weights),
                                     self._trusted_samples(peer, env.samples, trained)))
            # the node's model before it trained is the reference: the mix minus it is the
            # round's pseudo-gradient, which a server optimizer (fedavgm, fedadam...) needs
            before = self.pool.resolve(self.current_model(node))
            mixed = self._mix(self._aggregator(node), 1, before, received)
            self._store_mixed(node, mixed, record,
                              evaluate=self.mixing_steps == 1 and node in trained)
        if node not in trained:
            return
        # (a tree's client keeps no model: it starts each round it takes part in from
        # the model its parent sends down then)
        correct, total = self.pool.personal_score(update)
        with self._lock:
            record.add_personal(correct, total)

    def _store_mixed(self, node: str, mixed: Weights, record: RoundRecord, *,
                     evaluate: bool) -> None:
        """The node's model after a mixing step; `evaluate` (after the round's last, for a
        node that trained in it) scores it as served (`_evaluate_global`), and the node's
        aggregator may go back to its best model (on_stall; kept by reference, not copied:
        `Aggregator.observe`'s `shared`)."""
        handle = self.pool.put(mixed)
        with self._lock:
            self._models[node] = handle
            start = self._starts.pop(node, None) if evaluate else None
        if not evaluate:
            return
        # the models as stored (on Ray: views of the object store's), so that a best or
        # first model the aggregator keeps by reference is no copy of its own
        accuracy, loss = self._observed(
            node, self.pool.resolve(handle), None if start is None else self.pool.resolve(start),
            record, shared=True)
        with self._lock:
            record.add_evaluation(accuracy, loss, self.pool.samples(node))

    def _mix_send(self, node: str, r: int, step: int, mixing: set[str]) -> None:
        """Mixing step `step` (2, 3, ...): the node's model after the previous step, to
        every neighbour that mixes this round."""
        handle = self.current_model(node)
        samples = self.pool.samples(node)
        self.transport.send_many(r, mixing_kind(step), node, self._mixing_peers(node, mixing),
                                 handle, samples, self._model_nbytes)

    def _mix_receive(self, node: str, r: int, step: int, draw: Draw,
                     record: RoundRecord) -> None:
        """Average the node's model with its neighbours' of the same step (the same
        weights as the first step's). A robust aggregator (median, krum, ...) mixes every
        step, so that a lying neighbour gains nothing from the extra steps; a server
        optimizer steps once per round, in the first step, and later steps average."""
        received = [(self.pool.resolve(self.current_model(node)), self.pool.samples(node))]
        for peer in self._mixing_peers(node, draw.mixing):
            env = self.transport.receive(r, mixing_kind(step), peer, node, self.timeout)
            received.append((self.pool.resolve(env.weights),
                             self._trusted_samples(peer, env.samples, draw.trained)))
        aggregator = (self._make_inner() if self._is_server_optimizer(node)
                      else self._aggregator(node))
        mixed = self._mix(aggregator, step, received[0][0], received)
        self._store_mixed(node, mixed, record,
                          evaluate=step == self.mixing_steps and node in draw.trained)

    def _mix(self, aggregator: Aggregate, step: int, before: Weights,
             received: list[tuple[Weights, int]]) -> Weights:
        """`aggregator`'s mix of `received` at mixing step `step`, with the pooled mean
        shared by every node of this cluster that averages the same models in that step
        (`SharedMeans`; a user's aggregator that is no `Aggregator` computes its own)."""
        if not self.share_work or not isinstance(aggregator, Aggregator):
            return aggregator.aggregate(before, received)
        with self._lock:
            shared = self._means.setdefault(step, SharedMeans())
        aggregator.means = shared
        try:
            return aggregator.aggregate(before, received)
        finally:
            aggregator.means = None

    def _is_server_optimizer(self, node: str) -> bool:
        return bool(getattr(self._aggregator(node), "server_optimizer", False))

    def _aggregator(self, node: str) -> Aggregate:
        """The node's own aggregator (its state persists across rounds): the job's for
        roots, hybrid groups and decentralized nodes; FedAvg for inner hierarchy levels."""
        with self._lock:
            if node not in self._aggregators:
                outer = (self.graph.decentralized or self.graph.root(node)
                         or self.graph.kind == "hybrid")
                self._aggregators[node] = (self._make_aggregator(node) if outer
                                           else self._make_inner())
            return self._aggregators[node]

    def combine_contributions(self, node: str, current: Weights,
                              contributions: list[Contribution], aggregator: Aggregate
                              ) -> Weights:
        """The model of an aggregation that closed early: every cluster's updates, a stale
        one moved onto `current` by its staleness weight, through the root's `aggregator`
        (with every contribution fresh, exactly a synchronous round's aggregation)."""
        rule = self.buffer.rule if self.buffer is not None else None
        updates: list[tuple[Weights, int]] = []
        for c in contributions:
            if c.base is None or rule is None:
                updates.extend(c.updates)
                continue
            w = rule.weight(c.staleness)
            updates.extend(({k: (current[k] + w * (v - c.base[k])).astype(current[k].dtype)
                             if current[k].dtype.kind == "f" else v for k, v in u.items()}, n)
                           for u, n in c.updates)
        return aggregator.aggregate(current, updates) if updates else current

    def _collect_program(self, node: str, r: int, active: Set[str],
                         record: RoundRecord) -> None:
        """A star root whose rounds close early: the round's model to the participants of
        the clusters that train in it, then the contributions its buffer lets through."""
        assert self.buffer is not None
        where = self.transport._locate
        children = [c for c in self.graph.children(node) if c in active
                    and (self.round_clusters is None or where(c) in self.round_clusters)]
        start = self.current_model(node)
        current = self.pool.resolve(start)
        self.buffer.expect(r, children, current)  # before any update of it can arrive
        self._send_down(node, r, children, start)
        taken = self.buffer.collect(r, self.timeout, own=self.cluster_id)
        contributions = []
        for contribution, envelopes in taken:
            contribution.updates = [(self.pool.resolve(env.weights),
                                     self._trusted_samples(src, env.samples, None))
                                    for src, env in envelopes]
            contributions.append(contribution)
        model = self.combine_contributions(node, current, contributions,
                                           self._aggregator(node))
        with self._lock:
            self._models[node] = self.pool.put(model)
        accuracy, loss = self._observed(node, model, current, record)
        samples = sum(n for c in contributions for _, n in c.updates)
        with self._lock:
            record.add_evaluation(accuracy, loss, max(samples, 1))
            record.contributions = applied(contributions)
            record.dropped += self.buffer.take_dropped()
        log.info("event=aggregation cluster=%s round=%d contributions=%s dropped=%d",
                 self.cluster_id, r, ",".join(f"{c.cluster}:s{c.staleness}"
                                              for c in contributions), record.dropped)

    def _send_down(self, node: str, r: int, children: list[str], model: Any) -> None:
        """The round's model to `children`, each cluster's on a thread of its own: a cluster
        slow to take it (a CPU quota, a long link) holds back no other's start. Once every
        cluster's sends ended, a failure is raised (its message names the cluster; the
        others' are logged)."""
        by_cluster: dict[str, list[str]] = {}
        for child in children:
            by_cluster.setdefault(self.transport._locate(child), []).append(child)

        def send(group: list[str]) -> None:
            for child in group:
                self.transport.send(r, DOWN, node, child, model, 0, self._model_nbytes)

        with ThreadPoolExecutor(max_workers=max(1, len(by_cluster)),
                                thread_name_prefix=f"down-{node}") as pool:
            sends = {c: pool.submit(send, group) for c, group in by_cluster.items()}
        failed = [(c, exc) for c, f in sends.items() if (exc := f.exception()) is not None]
        for cluster, exc in failed[1:]:
            log.warning("event=send_down_failed cluster=%s round=%d error=%s", cluster, r, exc)
        if failed:
            raise failed[0][1]

    def _aggregator_program(self, node: str, r: int, active: Set[str],
                            record: RoundRecord) -> None:
        graph = self.graph
        if self.buffer is not None and graph.root(node):
            self._collect_program(node, r, active, record)
            return
        nbytes = self._model_nbytes
        children = [c for c in graph.children(node) if c in active]
        # down first: the round's model to every participating child (one shared handle)
        if node in graph.parent:  # an inner level of a hierarchy starts from its parent's
            env = self.transport.receive(r, DOWN, graph.parent[node], node, self.timeout)
            start = env.weights if not env.remote else self.pool.put(env.weights)
        else:
            start = self.current_model(node)
        self._send_down(node, r, children, start)
        updates: list[tuple[Weights, int]] = []
        for child in children:
            env = self.transport.receive(r, UP, child, node, self.timeout)
            updates.append((self.pool.resolve(env.weights),
                            self._trusted_samples(child, env.samples, active)))
        samples = sum(n for _, n in updates)
        current = self.pool.resolve(start)
        # a hybrid group under a server optimizer averages its clients, and the optimizer
        # steps once on the mean of all groups at the exchange (see Aggregator.server_optimizer)
        group_optimizer = graph.kind == "hybrid" and self._is_server_optimizer(node)
        inner = self._make_inner() if group_optimizer else self._aggregator(node)
        private = self.privacy is not None and graph.kind in ("star", "hybrid")
        if private and self.privacy.combines and updates:
            updates = self.privacy.combine(current, updates, node)  # unmasked sum, noise
        model = inner.aggregate(current, updates) if updates else current
        if graph.exchanges(r):
            # groups weigh by the samples behind them, not by who trained this round
            behind = self._samples_behind(node)
            secure = private and self.privacy.spec.secure_aggregation
            if secure:  # every group masks its share of the groups' mean (one a cluster)
                groups = sorted([node, *graph.peers.get(node, ())])
                model = self.privacy.mask(node, r, flatten(model) - flatten(current), model,
                                          groups, {g: self._samples_behind(g) for g in groups},
                                          "exchange")
            handle = self.pool.put(model)
            for peer in graph.peers.get(node, ()):
                self.transport.send(r, PEER, node, peer, handle, behind, nbytes)
            group_models = {node: (model, behind)}
            for peer in graph.peers.get(node, ()):
                env = self.transport.receive(r, PEER, peer, node, self.timeout)
                group_models[peer] = (self.pool.resolve(env.weights),
                                      self._trusted_samples(peer, env.samples, None))
            # every group sums in the same order, so all of them reach the same model
            ordered = [group_models[g] for g in sorted(group_models)]
            if secure:  # the groups started from one model: their mean from the sum
                ordered = [(self.privacy.unmask(current, ordered), sum(k for _, k in ordered))]
            if group_optimizer:
                with self._lock:
                    anchor = self._anchors.get(node, current)
                model = self._aggregator(node).aggregate(anchor, ordered)
                with self._lock:
                    self._anchors[node] = model
            else:
                model = average(ordered, self._make_inner())
        handle = self.pool.put(model)
        if node in graph.parent:  # an inner level of a hierarchy: pass the merge up
            self.transport.send(r, UP, node, graph.parent[node], handle, samples, nbytes)
            return
        with self._lock:
            self._models[node] = handle
        accuracy, loss = self._observed(node, model, current, record)
        weight = self._samples_behind(node) if graph.kind == "hybrid" else max(samples, 1)
        with self._lock:
            record.add_evaluation(accuracy, loss, weight)

    def served(self, model: Weights) -> Weights:
        """A node's model as it is served, evaluated and delivered: its BatchNorm
        statistics measured on itself, over this cluster's own clients' samples
        (`NodeRuntime.calibrate`, which also decides whether to; a pool without it serves
        the model as it is). The clients' own statistics, pooled, describe their trained
        models, not their mean: measured on MNIST, BNCNN, beta 0.3, FedAvg's rounds 1-5
        evaluated 0.10 / 0.32 / 0.70 / 0.26 / 0.10 with them, 0.75 / 0.91 / 0.93 / 0.93 /
        0.93 with its own. The node's model itself keeps the pooled statistics, and its
        clients train from those: a small client's thin batches normalize with the running
        statistics it receives (`worker.training`), and measured ones describe only the
        clients of the cluster that measured them. Sent to the clients, they made the
        model depend on which cluster aggregates it (digits BNMLP, beta 0.1, 100 clients:
        hierarchical fedavg 0.911, star 0.930; now both 0.930) and, measured by each
        cluster on its own few dozen samples, sent k_connected's clients' training to NaN
        (breast-cancer table, BNMLP, beta 0.1, 50 clients: 0.850; now 0.920, star's)."""
        calibrate = getattr(self.pool, "calibrate", None)
        return model if calibrate is None else calibrate(model)

    def _evaluate_global(self, model: Weights) -> tuple[float, float]:
        """The accuracy and loss of a node's model as served (`served`), once a round per
        model (by `digest`): k_connected's nodes on a few clusters end a round with the
        same model, and each used to measure and evaluate it again."""
        def evaluate() -> tuple[float, float]:
            return self._evaluate_served(self.served(model))
        if not self.share_work:
            return evaluate()
        with self._lock:
            evaluations = self._evaluations
        result: tuple[float, float] = evaluations.get(digest(model), evaluate)
        return result

    def _observed(self, node: str, model: Weights, start: Weights | None, record: RoundRecord,
                  shared: bool = False) -> tuple[float, float]:
        """The accuracy and loss of the node's new model (`start`: the round's), or
        (aggregation.on_stall) of the model its aggregator goes on from instead when the
        job stalled (counted). `shared`: the aggregator keeps the best and the first model
        by reference (a decentralized node's: `Aggregator.observe`)."""
        accuracy, loss = self._evaluate_global(model)
        aggregator = self._aggregator(node)
        observe = getattr(aggregator, "observe", None)
        if observe is None or (shared and (start is None
                                           or not isinstance(aggregator, Aggregator))):
            return accuracy, loss   # (a user's own aggregator: its observe, if any, is its own)
        restored = (observe(model, accuracy, loss, start, shared=True) if shared
                    else observe(model, accuracy, loss, start))
        if restored is None:
            return accuracy, loss
        with self._lock:
            self._models[node] = self.pool.put(restored)
            if node in self._anchors:
                self._anchors[node] = restored
            record.stalls += 1
        accuracy, loss = self._evaluate_global(restored)
        if not (shared and isinstance(aggregator, Aggregator) and aggregator.diverged(loss)):
            return accuracy, loss
        # a decentralized node whose start had diverged too (it mixed in diverged
        # neighbours in a round it did not train): back to the job's initial model
        initial = self._initial_model()
        first = self.pool.resolve(initial)
        if not aggregator.restart_from(first):
            return accuracy, loss
        with self._lock:
            self._models[node] = initial
        log.warning("event=learning_stalled_action node=%s restored=initial loss=%s", node, loss)
        return self._evaluate_global(first)


@dataclass(frozen=True)
class Draw:
    """Who does what in a round. `trained`: the participants (`client_fraction`), which
    train. `mixing`: the nodes that exchange models; in a tree the participants; in a
    decentralized topology the participants and their neighbours (less those that sit
    out). In its first step every node of `mixing` averages its own model (trained or
    not) with its trained neighbours' (a trained node sends its model to all its
    neighbours), as star's FedAvg averages its sample only: what the round learnt is not
    diluted by untrained models. Later mixing steps average each node of `mixing` with its
    neighbours in it; the other nodes keep their models (nothing reached them to mix).
    Measured against the alternatives: docs/job.md, Participants."""
    trained: set[str]
    mixing: set[str]


def average(items: list[tuple[Weights, int]], fedavg: Aggregate) -> Weights:
    """Sample-weighted mean of models through a FedAvg aggregator (in the first's dtypes)."""
    return fedavg.aggregate(items[0][0], items)


__all__ = ["Aggregate", "ClientPool", "ClusterEngine", "average", "model_nbytes"]
