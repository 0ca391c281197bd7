"""FedYogi (Reddi et al., 2021): v = v - (1 - beta2) delta^2 sign(v - delta^2)."""

from __future__ import annotations

import numpy as np

from .adaptive import AdaptiveAggregator


class FedYogi(AdaptiveAggregator):
    """Adaptive server optimizer with Yogi's additive second moment (see `adaptive`)."""

    name = "fedyogi"

    def second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        sq = delta**2
        return v - (1 - self.beta2) * sq * np.sign(v - sq)
