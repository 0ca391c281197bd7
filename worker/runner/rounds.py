"""One round of each topology family, written as the programs of the nodes run here.

Each function runs the part of the round that belongs to this runner's local nodes; every
message goes through the TopologyManager (a reference for a local receiver, bytes through
the transport for a remote one), so the code is identical on one cluster or many.
Aggregator nodes run in this driver process; clients run in FederatedNode actors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from worker.topology.messages import LocalUpdate, Message, as_message

if TYPE_CHECKING:
    from . import JobRun

NAN = float("nan")


@dataclass
class RoundResult:
    accuracy: float = NAN
    loss: float = NAN
    personalized_accuracy: float = NAN
    train_loss: float = NAN
    clients_trained: int = 0
    accuracy_of: str = "remote"
    extra: dict[str, float] = field(default_factory=dict)
    final_weights: dict[str, np.ndarray] | None = None


def _train_clients(run: JobRun, round_index: int, clients: list[int]) -> dict[int, Any]:
    """Every local participant receives its parent's model, trains, sends its update up."""
    prep, topo = run.prepared, run.topology
    updates = {}
    for client in clients:
        parent = prep.parent[client]
        (_, model_ref), = topo.receive(client, round_index, [parent])
        update = run.nodes.call(client, "train", round_index, model_ref)
        topo.send(client, parent, update, round_index, nbytes=run.model_nbytes)
        updates[client] = update
    return updates


def _client_summary(run: JobRun, updates: dict[int, Any], result: RoundResult) -> None:
    """Personalized accuracy and train loss over the local clients' updates."""
    values: list[LocalUpdate] = list(run.context.get(list(updates.values()))) if updates else []
    result.clients_trained = len(values)
    if not values:
        return
    local = sum(u.local_samples for u in values)
    samples = sum(u.num_samples for u in values)
    if local:
        result.personalized_accuracy = sum(u.local_accuracy * u.local_samples
                                           for u in values) / local
    if samples:
        result.train_loss = sum(u.loss * u.num_samples for u in values) / samples


def _aggregate(run: JobRun, aggregator: Any, reference: dict[str, np.ndarray],
               refs: list[Any]) -> tuple[dict[str, np.ndarray], int]:
    messages = [as_message(m) for m in run.context.get(refs)]
    updates = [(dict(m.weights), int(m.num_samples)) for m in messages]
    return aggregator.aggregate(reference, updates), sum(n for _, n in updates)


def tree_round(run: JobRun, round_index: int) -> RoundResult:
    """Star or hierarchical: model down the tree, updates up, aggregation at every level."""
    prep, topo, ctx, state = run.prepared, run.topology, run.context, run.state
    local_aggs = set(prep.local_aggregators)
    active: set[Any] = set(prep.participants(round_index))
    for level in prep.levels:
        active.update(a for a in level if any(k in active for k in prep.kids[a]))
    held: dict[Any, Any] = {}
    for level in reversed(prep.levels):  # down: the root first
        for agg in level:
            if agg not in active or agg not in local_aggs:
                continue
            if agg in prep.parent:
                (_, held[agg]), = topo.receive(agg, round_index, [prep.parent[agg]])
            else:
                held[agg] = ctx.put(state["global"])
            topo.broadcast(agg, [k for k in prep.kids[agg] if k in active], held[agg],
                           round_index, nbytes=run.model_nbytes)
    clients = [c for c in prep.local_clients if c in active]
    updates = _train_clients(run, round_index, clients)
    result = RoundResult()
    for level in prep.levels:  # up: the lowest level first
        for agg in level:
            if agg not in active or agg not in local_aggs:
                continue
            inbox = topo.receive(agg, round_index, [k for k in prep.kids[agg] if k in active])
            refs = [ref for _, ref in inbox]
            if agg in prep.parent:
                reference = as_message(ctx.get(held[agg])).weights
                merged, samples = _aggregate(run, state["relay"], dict(reference), refs)
                topo.send(agg, prep.parent[agg], ctx.put(Message(merged, samples)),
                          round_index, nbytes=run.model_nbytes)
            else:
                state["global"], _ = _aggregate(run, state["server"], state["global"], refs)
                result.accuracy, result.loss = run.evaluate(state["global"])
                result.accuracy_of = "global_model"
                result.final_weights = state["global"]
    _client_summary(run, updates, result)
    return result


def hybrid_round(run: JobRun, round_index: int) -> RoundResult:
    """Groups aggregate their clients every round and average with each other every
    `inter_cluster_period` rounds."""
    prep, topo, ctx, state = run.prepared, run.topology, run.context, run.state
    groups = prep.levels[0]
    local_groups = [g for g in groups if g in set(prep.local_aggregators)]
    participants = set(prep.participants(round_index))
    models: dict[str, dict[str, np.ndarray]] = state["groups"]
    for g in local_groups:
        kids = [k for k in prep.kids[g] if k in participants]
        if kids:
            topo.broadcast(g, kids, ctx.put(models[g]), round_index, nbytes=run.model_nbytes)
    clients = [c for c in prep.local_clients if c in participants]
    updates = _train_clients(run, round_index, clients)
    for g in local_groups:
        kids = [k for k in prep.kids[g] if k in participants]
        if kids:
            refs = [ref for _, ref in topo.receive(g, round_index, kids)]
            models[g], _ = _aggregate(run, state["group_aggregators"][g], models[g], refs)
    group_samples = {g: sum(prep.samples(c) for c in prep.kids[g]) for g in groups}
    result = RoundResult(accuracy_of="mean_group_models")
    if round_index % int(prep.graph.graph["inter_cluster_period"]) == 0 and len(groups) > 1:
        result.extra["exchanged"] = 1.0
        for g in local_groups:
            others = [h for h in groups if h != g]
            topo.broadcast(g, others, ctx.put(Message(models[g], group_samples[g])),
                           round_index, nbytes=run.model_nbytes)
        mixed = {}
        for g in local_groups:
            refs = [ref for _, ref in topo.receive(g, round_index, [h for h in groups if h != g])]
            own = ctx.put(Message(models[g], group_samples[g]))
            mixed[g], _ = _aggregate(run, state["relay"], models[g], [own, *refs])
        models.update(mixed)
    if local_groups:
        scores = [(run.evaluate(models[g]), group_samples[g]) for g in local_groups]
        total = sum(n for _, n in scores)
        result.accuracy = sum(acc * n for (acc, _), n in scores) / total
        result.loss = sum(loss * n for (_, loss), n in scores) / total
        result.final_weights = _weighted_mean([(models[g], group_samples[g])
                                               for g in local_groups])
    _client_summary(run, updates, result)
    return result


def decentralized_round(run: JobRun, round_index: int, *, final: bool) -> RoundResult:
    """Ring / k_connected / full / custom: train, send to neighbours, mix, evaluate."""
    prep, topo, ctx = run.prepared, run.topology, run.context
    clients = prep.local_clients
    updates = {}
    for c in clients:
        updates[c] = run.nodes.call(c, "train", round_index)
        topo.broadcast(c, topo.neighbours(c), updates[c], round_index, nbytes=run.model_nbytes)
    reports = []
    for c in clients:
        inbox = topo.receive(c, round_index, topo.neighbours(c))
        reports.append(run.nodes.call(c, "mix", round_index, *[ref for _, ref in inbox]))
    result = RoundResult(accuracy_of="mean_node_models", clients_trained=len(clients))
    values = ctx.get(reports)
    if values:
        result.accuracy = float(np.mean([r.accuracy for r in values]))
        result.loss = float(np.mean([r.loss for r in values]))
        local = sum(r.local_samples for r in values)
        if local:
            result.personalized_accuracy = sum(r.local_accuracy * r.local_samples
                                               for r in values) / local
        trained: list[LocalUpdate] = ctx.get(list(updates.values()))
        samples = sum(u.num_samples for u in trained)
        if samples:
            result.train_loss = sum(u.loss * u.num_samples for u in trained) / samples
    if final and clients:
        messages = run.node_weights(clients)
        consensus = _weighted_mean([(dict(m.weights), m.num_samples) for m in messages])
        result.extra["consensus_accuracy"], result.extra["consensus_loss"] = \
            run.evaluate(consensus)
        result.final_weights = consensus
    return result


def _weighted_mean(items: list[tuple[dict[str, np.ndarray], int]]) -> dict[str, np.ndarray]:
    """Sample-weighted mean of several models (equal weights if no samples are known)."""
    counts = np.array([n for _, n in items], dtype=np.float64)
    if counts.sum() == 0:
        counts = np.ones(len(items))
    coeffs = counts / counts.sum()
    first = items[0][0]
    return {k: np.sum([c * np.asarray(m[k], dtype=np.float64)
                       for (m, _), c in zip(items, coeffs, strict=True)], axis=0)
            .astype(first[k].dtype) for k in first}
