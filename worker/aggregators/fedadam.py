"""FedAdam (Reddi et al., 2021): Adam on the server, v = beta2 v + (1 - beta2) delta^2."""

from __future__ import annotations

import numpy as np

from .adaptive import AdaptiveAggregator


class FedAdam(AdaptiveAggregator):
    """Adaptive server optimizer with Adam's second moment (see `adaptive`)."""

    name = "fedadam"

    def second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        return self.beta2 * v + (1 - self.beta2) * delta**2
