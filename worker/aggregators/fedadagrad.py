"""FedAdagrad (Reddi et al., 2021): v = v + delta^2."""

from __future__ import annotations

import numpy as np

from .adaptive import AdaptiveAggregator


class FedAdagrad(AdaptiveAggregator):
    """Adaptive server optimizer with Adagrad's accumulated second moment (see `adaptive`)."""

    name = "fedadagrad"
    plain_server_learning_rate = 0.03
    bias_corrected_v = False

    def second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        return v + delta**2
