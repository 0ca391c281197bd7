"""Coordinate-wise median (Yin et al., 2018): robust to a minority of arbitrary updates."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .base import Aggregator, Update, Weights, cast_like, check_updates, stack


class Median(Aggregator):
    """Each coordinate is the median of the clients' values (unweighted; even counts take
    the mean of the two middle values)."""

    name = "median"

    def aggregate(self, global_weights: Mapping[str, np.ndarray], updates: Sequence[Update]) -> Weights:
        check_updates(global_weights, updates, self.name)
        return coordinate_median(global_weights, updates)


def coordinate_median(global_weights: Mapping[str, np.ndarray], updates: Sequence[Update]
                      ) -> Weights:
    """Each coordinate's median over `updates` (checked), in `global_weights`' dtypes."""
    return cast_like(
        {name: np.median(stack(updates, name), axis=0) for name in global_weights},
        global_weights,
    )
