"""Coordinate-wise trimmed mean (Yin et al., 2018)."""

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
    require,
    stack,
)

if TYPE_CHECKING:
    from proto.job import AggregationSpec


class TrimmedMean(Aggregator):
    """Per coordinate, drop the k = floor(trim_ratio * n) largest and k smallest client
    values and average the rest (unweighted)."""

    name = "trimmed_mean"

    def __init__(self, spec: AggregationSpec) -> None:
        super().__init__(spec)
        self.trim_ratio = float(spec.trim_ratio)
        require(0 <= self.trim_ratio < 0.5, self.name, "trim_ratio", self.trim_ratio,
                "0 <= ratio < 0.5 (the share trimmed from each side)")

    def aggregate(self, global_weights: Mapping[str, np.ndarray], updates: Sequence[Update]) -> Weights:
        check_updates(global_weights, updates, self.name)
        n = len(updates)
        k = int(np.floor(self.trim_ratio * n))
        out = {}
        for name in global_weights:
            values = np.sort(stack(updates, name), axis=0)
            out[name] = values[k : n - k].mean(axis=0)
        return cast_like(out, global_weights)
