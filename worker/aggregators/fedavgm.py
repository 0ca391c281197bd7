"""FedAvgM (Hsu et al., 2019): FedAvg with server momentum on the pseudo-gradient."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .base import (
    Aggregator,
    Update,
    Weights,
    cast_like,
    check_updates,
    is_float,
    require,
    sample_weights,
    server_learning_rate,
    weighted_average,
)

if TYPE_CHECKING:
    from proto.job import AggregationSpec


class FedAvgM(Aggregator):
    """g = w_global - avg; v = momentum * v + g; w = w_global - server_lr * v.

    Non-float tensors (counters) take the plain weighted average.
    """

    name = "fedavgm"
    server_optimizer = True

    def __init__(self, spec: AggregationSpec) -> None:
        super().__init__(spec)
        self.server_lr = server_learning_rate(spec, type(self))
        self.momentum = float(spec.server_momentum)
        require(self.server_lr > 0, self.name, "server_learning_rate", self.server_lr, "> 0")
        require(0 <= self.momentum < 1, self.name, "server_momentum", self.momentum, "0 <= m < 1")

    def aggregate(self, global_weights: Mapping[str, np.ndarray], updates: Sequence[Update]) -> Weights:
        check_updates(global_weights, updates, self.name)
        avg = weighted_average(updates, sample_weights(updates, self.name))
        velocity = self._state.setdefault("velocity", {})
        out: Weights = {}
        for name, mean in avg.items():
            current = np.asarray(global_weights[name], dtype=np.float64)
            if not is_float(global_weights[name]):
                out[name] = mean
                continue
            grad = current - mean
            v = self.momentum * velocity[name] + grad if name in velocity else grad
            velocity[name] = v
            out[name] = current - self.server_lr * v
        return cast_like(out, global_weights)
