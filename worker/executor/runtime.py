"""One job's runtime on one cluster: data, VirtualNodes, actors, models, aggregators.

Implements the service's `JobRuntime`. Clients are VirtualNodes of a `NodeManager`
(FederatedNode actors in a placement group, at most `max_materialized` alive); their
updates travel by object reference. Evaluation of received models on the clients' own
test splits and of aggregated models on the global test set happens in this process
(small forward passes), so actors only train.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from proto.job import JobSpec
from worker.context import ExecutionContext, InProcessContext
from worker.executor.codec import EdgeCodec
from worker.executor.graph import client_index
from worker.topology.messages import Message

log = logging.getLogger("fedpilot.executor")

Weights = dict[str, np.ndarray]


def open_context(address: str, *, num_cpus: float | None = None) -> ExecutionContext:
    """`inprocess` → threads; `local` → an embedded Ray on loopback; else join `address`."""
    if address == "inprocess":
        return InProcessContext()
    from worker.context import RayContext

    if address == "local":
        kwargs: dict[str, Any] = {"_node_ip_address": "127.0.0.1"}
        if num_cpus is not None:
            kwargs["num_cpus"] = num_cpus
        return RayContext(None, **kwargs)
    return RayContext(address)


class NodeRuntime:
    def __init__(self, spec: JobSpec, context: ExecutionContext, cluster_id: str) -> None:
        import torch

        from worker.data import client_data, load_dataset
        from worker.models import build_model
        from worker.nodes import NodeConfig, NodeManager
        from worker.serialization import model_weights

        torch.set_num_threads(1)
        self.spec = spec
        self.context = context
        self.cluster_id = cluster_id
        self.dataset = load_dataset(spec.data.dataset)
        self.partition = client_data(self.dataset, spec.data, spec.seed)
        self._model = build_model(spec.model, self.dataset.input_shape, self.dataset.num_classes,
                                  seed=spec.seed)
        self.initial_weights: Weights = model_weights(self._model)
        self._eval_lock = threading.Lock()
        config = NodeConfig(job_id=spec.job_id, seed=spec.seed, model=spec.model,
                            training=spec.training, aggregation=spec.aggregation,
                            input_shape=tuple(self.dataset.input_shape),
                            num_classes=self.dataset.num_classes)
        self.manager = NodeManager(
            context, config, self.dataset, self.partition,
            range(spec.data.number_of_clients),
            max_materialized=spec.placement.max_materialized,
            strategy=spec.placement.placement_group_strategy,
            name_prefix=f"fedpilot/{spec.job_id}/{cluster_id}")
        self._started = False
        self._local: list[int] = []

    # -- JobRuntime --------------------------------------------------------------------------
    def histograms(self, clients: list[int]) -> dict[int, list[int]]:
        n = self.spec.data.number_of_clients
        bad = [c for c in clients if not 0 <= c < n]
        if bad:
            raise ValueError(f"clients {bad[:5]} are outside 0..{n - 1}")
        return {c: [int(x) for x in self.partition.histograms[c]] for c in clients}

    def capacity(self) -> int:
        return 0  # the daemon's configured capacity is authoritative

    def assign(self, clients: list[str]) -> None:
        self._local = [client_index(c) for c in clients]
        if self._local and not self._started:
            # the placement group is reserved before any actor starts, and fails at once
            self.manager.start()
            self._started = True

    def actors_materialized(self) -> int:
        return int(self.manager.stats.created)

    def samples(self, node: str) -> int:
        return int(len(self.partition.train_indices[client_index(node)]))

    def put(self, weights: Weights) -> Any:
        return self.context.put(weights)

    def resolve(self, handle: Any) -> Weights:
        value = handle if isinstance(handle, dict | Message) else self.context.get(handle)
        if isinstance(value, Message):
            return dict(value.weights)
        return dict(value)

    def train(self, node: str, model: Any, round_index: int) -> Any:
        return self.manager.call(client_index(node), "train", round_index, model)

    def evaluate_personal(self, node: str, model: Any) -> tuple[int, int, float]:
        idx = self.partition.test_indices[client_index(node)]
        if len(idx) == 0:
            return 0, 0, 0.0
        result = self._evaluate(self.resolve(model), self.dataset.x_train[idx],
                                self.dataset.y_train[idx])
        correct = int(round(result.accuracy * result.num_samples))
        return correct, int(result.num_samples), float(result.loss * result.num_samples)

    def evaluate_global(self, weights: Weights) -> tuple[float, float]:
        result = self._evaluate(weights, self.dataset.x_test, self.dataset.y_test)
        return float(result.accuracy), float(result.loss)

    def _evaluate(self, weights: Weights, x: np.ndarray, y: np.ndarray) -> Any:
        from worker.serialization import load_weights
        from worker.training import evaluate

        with self._eval_lock:
            load_weights(self._model, weights)
            return evaluate(self._model, x, y)

    def make_aggregator(self, node: str) -> Any:
        from worker.aggregators import get_aggregator

        return get_aggregator(self.spec.aggregation)

    def make_inner_aggregator(self) -> Any:
        from worker.aggregators import get_aggregator

        return get_aggregator(replace(self.spec.aggregation, name="fedavg"))

    def make_codec(self) -> EdgeCodec:
        return EdgeCodec(self.spec.transfer, self.initial_weights)

    def weights_to_bytes(self, weights: Weights) -> bytes:
        from worker.serialization import weights_to_bytes

        return weights_to_bytes(weights)

    def bytes_to_weights(self, data: bytes) -> Weights:
        from worker.serialization import bytes_to_weights

        return bytes_to_weights(data)

    def close(self) -> None:
        self.manager.close()


def runtime_factory(context: ExecutionContext, cluster_id: str) -> Callable[[JobSpec], NodeRuntime]:
    def make(spec: JobSpec) -> NodeRuntime:
        return NodeRuntime(spec, context, cluster_id)

    return make
