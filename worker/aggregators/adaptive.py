"""Adaptive server optimizers of Reddi et al., "Adaptive Federated Optimization"
(ICLR 2021), Algorithm 2: FedAdagrad, FedAdam and FedYogi.

Per round t, with the sample-weighted average `avg` of the client weights:
    delta = avg - w_global                      (the pseudo-gradient, negated)
    m = beta1 * m + (1 - beta1) * delta
    v = <second-moment rule of the subclass>
    w = w_global + server_lr * m_hat / (sqrt(v_hat) + tau)
with Adam's bias correction m_hat = m / (1 - beta1^t) (and v_hat = v / (1 - beta2^t) for
the exponential averages of FedAdam and FedYogi). m and v start at zero.

Scale. m_hat / sqrt(v_hat) is about 1 per coordinate whatever the model, so `server_lr`
is roughly how far every weight moves each round, whatever the model's own scale. The
defaults sit in Reddi et al.'s recommended region (server_lr 10^-2..10^-1, tau 10^-3,
beta1 0.9, beta2 0.99): 0.05 for FedAdam and FedYogi, 0.03 for FedAdagrad. Measured with
the cosine client schedule (bench_learning): FedAdam reaches 0.928 with a two-conv CNN on
MNIST (FedAvg 0.913) and 0.967 on the digits demo (hybrid, mlp); the former 0.1 without
bias correction (tuned on the digits mlp) held the CNN at chance from round 1, and 0.02
gave the demo 0.936. A job that sits at chance says so on its progress line
(scheduler/run/health.py).
Non-float tensors (counters) take the plain weighted average.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

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

    server_optimizer: ClassVar[bool] = True
    #: bias-correct the second moment (an exponential average); Adagrad's is a plain sum
    bias_corrected_v: ClassVar[bool] = True

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
            # every step moves each coordinate by up to ~server_lr: 1.0 diverges on digits
            log.warning(
                "event=large_server_learning_rate aggregator=%s server_learning_rate=%s "
                "hint=Reddi et al. tune it in 0.01..0.3; the default (%s) suits an mlp and a "
                "CNN alike", self.name, self.server_lr, type(self).default_server_learning_rate)

    @abstractmethod
    def second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        """The new second-moment estimate from the previous one and this round's delta."""

    def aggregate(self, global_weights: Mapping[str, np.ndarray], updates: Sequence[Update]) -> Weights:
        check_updates(global_weights, updates, self.name)
        avg = weighted_average(updates, sample_weights(updates, self.name))
        m_state = self._state.setdefault("m", {})
        v_state = self._state.setdefault("v", {})
        t_state = self._state.setdefault("t", {})
        out: Weights = {}
        for name, mean in avg.items():
            if not is_float(global_weights[name]):
                out[name] = mean
                continue
            current = np.asarray(global_weights[name], dtype=np.float64)
            delta = mean - current
            t = int(t_state[name]) + 1 if name in t_state else 1
            m = self.beta1 * m_state.get(name, 0.0) + (1 - self.beta1) * delta
            v = self.second_moment(v_state.get(name, np.zeros_like(delta)), delta)
            m_state[name], v_state[name], t_state[name] = m, v, np.asarray(t, dtype=np.int64)
            m_hat = m / (1 - self.beta1**t)
            v_hat = v / (1 - self.beta2**t) if self.bias_corrected_v else v
            out[name] = current + self.server_lr * m_hat / (np.sqrt(v_hat) + self.tau)
        return cast_like(out, global_weights)
