"""FedAvg (McMahan et al., 2017): the sample-weighted mean of the client weights
(normalization statistics pooled, `base.pool_statistics`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .base import (
    Aggregator,
    Update,
    Weights,
    cast_like,
    check_updates,
)


class FedAvg(Aggregator):
    """w = sum_i n_i w_i / sum_i n_i; once `on_stall` halved the step (scale s < 1), the
    trained tensors go that share of the way there, w = w_global + s (mean - w_global)
    (buffers take the mean: they describe the clients' models)."""

    name = "fedavg"
    stall_step = True

    def aggregate(self, global_weights: Mapping[str, np.ndarray], updates: Sequence[Update]) -> Weights:
        check_updates(global_weights, updates, self.name)
        mean = self.mean(updates)
        scale = self.step_scale
        if scale >= 1.0:
            return cast_like(mean, global_weights)
        currents = self.trained(global_weights, mean)
        return cast_like({name: currents[name] + scale * (value - currents[name])
                          if name in currents else value for name, value in mean.items()},
                         global_weights)
