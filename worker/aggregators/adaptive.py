"""Shared core of the adaptive server optimizers of Reddi et al., "Adaptive Federated
Optimization" (ICLR 2021), Algorithm 2: FedAdagrad, FedAdam and FedYogi.

Per round, with the sample-weighted average `avg` of the client weights:
    delta = avg - w_global
    m = beta1 * m + (1 - beta1) * delta
    v = <second-moment rule of the subclass>
    w = w_global + server_lr * m / (sqrt(v) + tau)
m and v start at zero (as in Flower); there is no bias correction (as in the paper).
server_learning_rate = None picks the subclass default (tuned on digits, beta = 0.1).
Non-float tensors (counters) take the plain weighted average.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
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

log = logging.getLogger(__name__)


class AdaptiveAggregator(Aggregator):
    """Base of FedAdagrad/FedAdam/FedYogi; subclasses define `second_moment`."""

    def __init__(self, spec: AggregationSpec) -> None:
        super().__init__(spec)
        self.server_lr = server_learning_rate(spec, type(self))
        self.beta1 = float(spec.beta1)
        self.beta2 = float(spec.beta2)
        self.tau = float(spec.tau)
        require(self.server_lr > 0, self.name, "server_learning_rate", self.server_lr, "> 0")
        require(0 <= self.beta1 < 1, self.name, "beta1", self.beta1, "0 <= beta1 < 1")
        require(0 <= self.beta2 < 1, self.name, "beta2", self.beta2, "0 <= beta2 < 1")
        require(self.tau > 0, self.name, "tau", self.tau, "> 0")
        if self.server_lr >= 0.5:
            # Every step moves each coordinate by up to ~server_lr: 1.0 diverges on digits.
            log.warning(
                "event=large_server_learning_rate aggregator=%s server_learning_rate=%s "
                "hint=Reddi et al. tune it in 0.01..0.3; 0.1 works well on digits",
                self.name, self.server_lr,
            )

    @abstractmethod
    def second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        """The new second-moment estimate from the previous one and this round's delta."""

    def aggregate(self, global_weights: Mapping[str, np.ndarray], updates: Sequence[Update]) -> Weights:
        check_updates(global_weights, updates, self.name)
        avg = weighted_average(updates, sample_weights(updates, self.name))
        m_state = self._state.setdefault("m", {})
        v_state = self._state.setdefault("v", {})
        out: Weights = {}
        for name, mean in avg.items():
            if not is_float(global_weights[name]):
                out[name] = mean
                continue
            current = np.asarray(global_weights[name], dtype=np.float64)
            delta = mean - current
            m = self.beta1 * m_state.get(name, np.zeros_like(delta)) + (1 - self.beta1) * delta
            v = self.second_moment(v_state.get(name, np.zeros_like(delta)), delta)
            m_state[name], v_state[name] = m, v
            out[name] = current + self.server_lr * m / (np.sqrt(v) + self.tau)
        return cast_like(out, global_weights)
