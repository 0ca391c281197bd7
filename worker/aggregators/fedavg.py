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
    """w = sum_i n_i w_i / sum_i n_i."""

    name = "fedavg"

    def aggregate(self, global_weights: Mapping[str, np.ndarray], updates: Sequence[Update]) -> Weights:
        check_updates(global_weights, updates, self.name)
        return cast_like(self.mean(updates), global_weights)
