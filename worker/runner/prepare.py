"""Checking and preparing a job before anything starts: data, model, aggregator, topology."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np

from proto.job import PLACEMENT_GROUP_STRATEGIES, AggregationSpec, JobSpec
from worker.data import ClientPartition, Dataset, client_data, load_dataset
from worker.topology import (
    DECENTRALIZED_KINDS,
    aggregators_by_level,
    build_topology,
    children,
    clients_of,
)


class JobError(ValueError):
    """The job cannot run as specified; the message names the job, the key and the fix."""


@dataclass
class PreparedJob:
    """Everything a run needs, built and checked up front (no actor exists yet)."""

    spec: JobSpec
    dataset: Dataset
    partition: ClientPartition
    graph: nx.Graph
    family: str                     # "tree" | "hybrid" | "decentralized"
    local_clients: list[int]
    local_aggregators: list[str]
    initial_weights: dict[str, np.ndarray]
    levels: list[list[str]]
    parent: dict[Any, Any]
    kids: dict[Any, list[Any]]
    _eval_model: Any = field(repr=False, default=None)

    @property
    def local_nodes(self) -> list[Any]:
        return [*self.local_clients, *self.local_aggregators]

    def samples(self, client: int) -> int:
        return len(self.partition.train_indices[client])

    def participants(self, round_index: int) -> list[int]:
        """Clients that train in `round_index` (all of them unless client_fraction < 1);
        the same on every cluster and backend for the job's seed."""
        n = self.spec.data.number_of_clients
        fraction = self.spec.training.client_fraction
        if fraction >= 1.0 or self.family == "decentralized":
            return list(range(n))
        k = max(1, round(fraction * n))
        rng = np.random.default_rng([self.spec.seed, round_index, 0x5EED])
        return sorted(int(c) for c in rng.choice(n, size=k, replace=False))

    def evaluate(self, weights: dict[str, np.ndarray]) -> tuple[float, float]:
        """(accuracy, loss) of `weights` on the test set, in this process."""
        from worker.serialization import load_weights
        from worker.training import evaluate

        load_weights(self._eval_model, weights)
        result = evaluate(self._eval_model, self.dataset.x_test, self.dataset.y_test)
        return result.accuracy, result.loss

    def initial_state(self) -> dict[str, Any]:
        """Per-run mutable state of the driver-side aggregators."""
        from worker.aggregators import get_aggregator

        state: dict[str, Any] = {"global": dict(self.initial_weights),
                                 "server": get_aggregator(self.spec.aggregation),
                                 "relay": get_aggregator(AggregationSpec(name="fedavg"))}
        if self.family == "hybrid":
            state["groups"] = {g: dict(self.initial_weights) for g in self.levels[0]}
            state["group_aggregators"] = {g: get_aggregator(self.spec.aggregation)
                                          for g in self.levels[0]}
        return state


def prepare_job(spec: JobSpec, *, local_clients: Collection[int] | None = None,
                local_aggregators: Collection[str] | None = None,
                groups: Sequence[Sequence[int]] | None = None) -> PreparedJob:
    """Load and check everything `spec` names; raise `JobError` naming what is wrong."""
    where = f"job {spec.job_id!r}"
    _check_numbers(spec, where)
    try:
        dataset = load_dataset(spec.data.dataset)
        partition = client_data(dataset, spec.data, spec.seed)
    except ValueError as exc:
        raise JobError(f"{where}: data: {exc}") from exc
    try:
        from worker.models import build_model
        from worker.serialization import model_weights
        from worker.training import train_local

        model = build_model(spec.model, dataset.input_shape, dataset.num_classes, seed=spec.seed)
        initial = model_weights(model)
        # validates optimizer, epochs, batch size and fedprox_mu without training
        train_local(model, dataset.x_train[:0], dataset.y_train[:0], spec.training, seed=0)
        eval_model = build_model(spec.model, dataset.input_shape, dataset.num_classes,
                                 seed=spec.seed)
    except ValueError as exc:
        raise JobError(f"{where}: model/training: {exc}") from exc
    try:
        from worker.aggregators import get_aggregator

        get_aggregator(spec.aggregation)
    except ValueError as exc:
        raise JobError(f"{where}: aggregation: {exc}") from exc
    try:
        graph = build_topology(spec.topology, spec.data.number_of_clients, seed=spec.seed,
                               histograms=partition.histograms, groups=groups)
    except ValueError as exc:
        raise JobError(f"{where}: topology: {exc}") from exc
    kind = spec.topology.kind
    family = ("decentralized" if kind in DECENTRALIZED_KINDS
              else "hybrid" if kind == "hybrid" else "tree")
    levels = aggregators_by_level(graph)
    all_aggregators = [a for level in levels for a in level]
    clients = clients_of(graph)
    local_c = sorted(clients if local_clients is None else {int(c) for c in local_clients})
    bad = [c for c in local_c if c not in set(clients)]
    if bad:
        raise JobError(f"{where}: local_clients {bad[:5]} are not clients 0..{len(clients) - 1}")
    local_a = list(all_aggregators if local_aggregators is None else
                   [a for a in all_aggregators if a in set(local_aggregators)])
    unknown = sorted(set(local_aggregators or ()) - set(all_aggregators))
    if unknown:
        raise JobError(f"{where}: local_aggregators {unknown} are not aggregators of the "
                       f"{kind} topology ({all_aggregators[:5]}...)")
    parent = {n: d["parent"] for n, d in graph.nodes(data=True) if "parent" in d}
    kids = {a: children(graph, a) for a in all_aggregators}
    return PreparedJob(spec, dataset, partition, graph, family, local_c, local_a, initial,
                       levels, parent, kids, eval_model)


def _check_numbers(spec: JobSpec, where: str) -> None:
    problems = []
    if spec.data.number_of_clients < 1:
        problems.append(f"data.number_of_clients must be >= 1, got {spec.data.number_of_clients}")
    if spec.training.federated_learning_rounds < 0:
        problems.append("training.federated_learning_rounds must be >= 0, got "
                        f"{spec.training.federated_learning_rounds}")
    if not 0.0 < spec.training.client_fraction <= 1.0:
        problems.append(f"training.client_fraction must be in (0, 1], got "
                        f"{spec.training.client_fraction}")
    if spec.placement.max_materialized < 1:
        problems.append(f"placement.max_materialized must be >= 1, got "
                        f"{spec.placement.max_materialized}")
    if spec.placement.placement_group_strategy not in PLACEMENT_GROUP_STRATEGIES:
        problems.append(f"placement.placement_group_strategy must be one of "
                        f"{', '.join(PLACEMENT_GROUP_STRATEGIES)}, got "
                        f"{spec.placement.placement_group_strategy!r}")
    if problems:
        raise JobError(f"{where}: " + "; ".join(problems))
