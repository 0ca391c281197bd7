"""Coordinate-wise trimmed mean (Yin et al., 2018)."""

from __future__ import annotations

import logging
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

log = logging.getLogger(__name__)
#: (updates, trim_ratio) said once per process: a decentralized job's nodes are many
_SAID: set[tuple[int, float]] = set()


class TrimmedMean(Aggregator):
    """Per coordinate, drop the k = floor(trim_ratio * n) largest and k smallest client
    values and average the rest (unweighted). With fewer than 1 / trim_ratio updates (a
    hierarchy's root or a hybrid group at client_fraction < 1) k is 0 and nothing is
    trimmed: the mean, said once per process and count (`trimmed_mean_trims_nothing`)."""

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
        if k == 0 and n > 1 and self.trim_ratio > 0 and (n, self.trim_ratio) not in _SAID:
            _SAID.add((n, self.trim_ratio))
            log.warning("event=trimmed_mean_trims_nothing updates=%d trim_ratio=%s hint=with "
                        "fewer than 1 / trim_ratio updates this aggregation is their mean "
                        "(raise training.client_fraction or aggregation.trim_ratio, or use "
                        "median)", n, self.trim_ratio)
        out = {}
        for name in global_weights:
            values = np.sort(stack(updates, name), axis=0)
            out[name] = values[k : n - k].mean(axis=0)
        return cast_like(out, global_weights)
