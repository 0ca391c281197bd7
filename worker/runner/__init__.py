"""The single-cluster job runner: `run_job(spec, context)` yields one `RoundMetrics` per round.

Everything the job names (dataset, partition, model, optimizer settings, aggregator,
topology, placement) is checked by `prepare_job` before any actor starts; a bad value
raises `JobError` naming the key. Then the placement group is reserved (failing at once if
the cluster cannot hold it) and rounds run as the topology says:

- star / hierarchical: aggregators (run in this driver) send the model down by reference,
  clients train and send updates up; intermediate aggregators take the sample-weighted
  mean (FedAvg), the server applies the configured aggregator. `accuracy` is the global
  model's on the test set.
- ring / k_connected / full / custom (decentralized): every client trains, sends its model
  to its neighbours and averages with what it receives (the configured aggregator, its
  own weights as reference). `accuracy` is the MEAN OF THE NODE MODELS' accuracies on the
  test set; the consensus (sample-weighted average) model's accuracy is reported in
  `extra["consensus_accuracy"]` on the last round.
- hybrid: each group aggregator aggregates its clients every round; every
  `inter_cluster_period` rounds the groups average their models. `accuracy` is the
  sample-weighted mean of the group models' accuracies.

`personalized_accuracy` is the sample-weighted accuracy of each client's own model (after
local training, or after mixing when decentralized) on the client's own test split.
Nodes this runner does not run (`local_clients`, `local_aggregators`) are reached through
`transport`; the round code is the same either way.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from proto.job import JobSpec
from worker.context import ExecutionContext
from worker.nodes import NodeConfig, NodeManager
from worker.topology import RemoteTransport, TopologyManager
from worker.topology.messages import weights_nbytes

from .prepare import JobError, PreparedJob, prepare_job
from .rounds import RoundResult, decentralized_round, hybrid_round, tree_round

log = logging.getLogger(__name__)

__all__ = ["JobError", "JobRun", "PreparedJob", "RoundMetrics", "prepare_job", "run_job"]


@dataclass(frozen=True)
class RoundMetrics:
    """What one round did and measured (NaN where this cluster cannot measure it)."""

    round: int
    accuracy: float
    loss: float
    personalized_accuracy: float
    train_loss: float
    bytes_intra: int
    bytes_inter: int
    messages_intra: int
    messages_inter: int
    seconds: float
    clients_trained: int
    accuracy_of: str
    actors_created: int
    materializations: int
    extra: dict[str, float] = field(default_factory=dict)


def run_job(
    spec: JobSpec,
    context: ExecutionContext,
    *,
    transport: RemoteTransport | None = None,
    local_clients: Collection[int] | None = None,
    local_aggregators: Collection[str] | None = None,
    groups: Sequence[Sequence[int]] | None = None,
    progress: Callable[[RoundMetrics], None] | None = None,
    cpus_per_node: float | None = None,
    recycle_actors: bool = True,
) -> JobRun:
    """Validate `spec`, reserve the placement group, and return the rounds as an iterator.

    Raises `JobError` (bad job) or `PlacementError` (cluster too small) right here, before
    any actor exists. `local_clients` / `local_aggregators` default to every client /
    aggregator of the topology; `groups` are the hybrid groups. `cpus_per_node` defaults
    to an even share of the available CPUs over the `max_materialized` actors (at most 1).
    Iterate the result (or use it as a context manager) to run the rounds; actors and the
    placement group are released when the rounds end, fail, or `close()` is called.
    """
    prepared = prepare_job(spec, local_clients=local_clients,
                           local_aggregators=local_aggregators, groups=groups)
    return JobRun(prepared, context, transport=transport, progress=progress,
                  cpus_per_node=cpus_per_node, recycle_actors=recycle_actors)


class JobRun(Iterator[RoundMetrics]):
    """A running job: `next()` runs one round. `final_weights` holds the resulting model."""

    def __init__(self, prepared: PreparedJob, context: ExecutionContext, *,
                 transport: RemoteTransport | None,
                 progress: Callable[[RoundMetrics], None] | None,
                 cpus_per_node: float | None, recycle_actors: bool) -> None:
        import torch

        self.prepared = prepared
        self.context = context
        self.spec = spec = prepared.spec
        self.progress = progress
        self.topology = TopologyManager(prepared.graph, context, prepared.local_nodes, transport)
        cfg = NodeConfig(spec.job_id, spec.seed, spec.model, spec.training, spec.aggregation,
                         prepared.dataset.input_shape, prepared.dataset.num_classes)
        capacity = min(spec.placement.max_materialized, max(1, len(prepared.local_clients)))
        share = cpus_per_node if cpus_per_node is not None else _cpu_share(context, capacity)
        self.nodes = NodeManager(
            context, cfg, prepared.dataset, prepared.partition, prepared.local_clients,
            max_materialized=spec.placement.max_materialized,
            strategy=spec.placement.placement_group_strategy, cpus_per_node=share,
            recycle=recycle_actors)
        self._torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the same arithmetic as the single-threaded actors
        self.round = 0
        self.final_weights: dict[str, np.ndarray] = dict(prepared.initial_weights)
        self.model_nbytes = weights_nbytes(prepared.initial_weights)
        self.state = prepared.initial_state()
        self._closed = False
        try:
            if prepared.local_clients:
                self.nodes.start()
        except BaseException:
            self.close()
            raise
        log.info("event=job_started job=%s topology=%s clients=%d local=%d cpus_per_node=%g",
                 spec.job_id, spec.topology.kind, spec.data.number_of_clients,
                 len(prepared.local_clients), share)

    def __next__(self) -> RoundMetrics:
        if self._closed or self.round >= self.spec.training.federated_learning_rounds:
            self.close()
            raise StopIteration
        self.round += 1
        started = time.perf_counter()
        try:
            result = self._run_round(self.round)
        except BaseException:
            self.close()
            raise
        traffic = self.topology.take_traffic()
        self.topology.end_round(self.round)
        metrics = RoundMetrics(
            round=self.round, accuracy=result.accuracy, loss=result.loss,
            personalized_accuracy=result.personalized_accuracy, train_loss=result.train_loss,
            bytes_intra=traffic.bytes_intra, bytes_inter=traffic.bytes_inter,
            messages_intra=traffic.messages_intra, messages_inter=traffic.messages_inter,
            seconds=time.perf_counter() - started, clients_trained=result.clients_trained,
            accuracy_of=result.accuracy_of, actors_created=self.nodes.stats.created,
            materializations=self.nodes.stats.materializations, extra=result.extra)
        log.info("event=round_done job=%s round=%d accuracy=%.4f loss=%.4f personalized=%.4f "
                 "bytes_intra=%d bytes_inter=%d seconds=%.3f", self.spec.job_id, metrics.round,
                 metrics.accuracy, metrics.loss, metrics.personalized_accuracy,
                 metrics.bytes_intra, metrics.bytes_inter, metrics.seconds)
        if self.progress is not None:
            self.progress(metrics)
        if self.round >= self.spec.training.federated_learning_rounds:
            self.close()
        return metrics

    def _run_round(self, round_index: int) -> RoundResult:
        kind = self.prepared.family
        last = round_index == self.spec.training.federated_learning_rounds
        if kind == "tree":
            result = tree_round(self, round_index)
        elif kind == "hybrid":
            result = hybrid_round(self, round_index)
        else:
            result = decentralized_round(self, round_index, final=last)
        if result.final_weights is not None:
            self.final_weights = result.final_weights
        return result

    def close(self) -> None:
        """Kill the job's actors and release its placement group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        import torch

        try:
            self.nodes.close()
        finally:
            torch.set_num_threads(self._torch_threads)
            log.info("event=job_closed job=%s rounds=%d actors_created=%d", self.spec.job_id,
                     self.round, self.nodes.stats.created)

    def __enter__(self) -> JobRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def evaluate(self, weights: dict[str, np.ndarray]) -> tuple[float, float]:
        """(accuracy, loss) of `weights` on the dataset's test set, in this process."""
        return self.prepared.evaluate(weights)

    def node_weights(self, clients: Sequence[int]) -> list[Any]:
        """The current model messages of local `clients` (decentralized final models)."""
        return list(self.context.get([self.nodes.call(c, "weights") for c in clients]))


def _cpu_share(context: ExecutionContext, slots: int) -> float:
    available = float(context.resources()["available"].get("CPU", 0.0))
    share = math.floor(min(1.0, available / max(1, slots)) * 100) / 100
    return max(share, 0.01)
