"""Adaptive server optimizers of Reddi et al., "Adaptive Federated Optimization"
(ICLR 2021), Algorithm 2: FedAdagrad, FedAdam and FedYogi.

Per round t, with the sample-weighted average `avg` of the client weights:
    delta = avg - w_global                      (the pseudo-gradient, negated)
    m = beta1 * m + (1 - beta1) * delta
    v = <second-moment rule of the subclass>
    w = w_global + server_lr * m_hat / (sqrt(v_hat) + tau)
with Adam's bias correction m_hat = m / (1 - beta1^t) (and v_hat = v / (1 - beta2^t) for
the exponential averages of FedAdam and FedYogi). m and v start at zero.

Scale. m_hat / sqrt(v_hat) is about 1 per coordinate whatever the model, so in the
literature's form (`aggregation.server_step = "plain"`) `server_lr` is how far every weight
moves each round, whatever the model's own scale: Reddi et al.'s region (10^-2..10^-1;
0.05 here, 0.03 for FedAdagrad) held a CNN with 5x5 kernels at chance for 15 rounds, where
FedAvg reached 0.92 (its weights are of that order; Flower's FedAdam has the same trap).
So by default (`server_step = "scaled"`) each tensor's step keeps Adam's direction but takes
the length of its own momentum pseudo-gradient, a layer-wise trust ratio as in LAMB:
    u = m_hat / (sqrt(v_hat) + tau);   step = server_lr * u * ||m_hat|| / ||u||
with server_lr 2.0, and never more than `max_step_ratio` (2; 1.5 for a model with BatchNorm
statistics, `Aggregator.step_ratio`) times FedAvg's own step for the tensor
(`base.bounded_step`); over the first WARMUP_ROUNDS rounds the direction turns
from the pseudo-gradient's own to Adam's (`scaled_direction`): Adam's first steps are sign
steps. The step then follows each tensor's scale, and the adaptivity redistributes it
across the tensor's coordinates (for a model with BatchNorm statistics, where the step is
at most `base.NORM_STEP_RATIO` (1.5) x FedAvg's length, without a first moment unless the job
sets `beta1`:
`base.NORM_MOMENTUM`, and turned only NORM_ADAM_SHARE of the way from FedAvg's direction to
Adam's).
A round whose pseudo-gradient points against the first
moment restarts it (`base.opposes`; m_hat becomes that round's delta), and that round's
step is FedAvg's at most (as fedavgm's: the job went past a minimum; 2x there amplified the
swing: digits SmallCNN beta 0.1, 20 clients, seeds 0/1/2, star fedadagrad 0.894 / 0.630 /
0.953 -> 0.889 / 0.936 / 0.964, fedadam 0.891 / 0.891 / 0.953 -> 0.883 / 0.942 / 0.964;
FedAvg 0.543 / 0.838 / 0.852; beta 0.3 cells unchanged). So is the first round's (its m_hat
is its delta: 2x only extrapolates FedAvg's first step, where the clients drift most):
digits SmallCNN beta 0.1, 50 clients, seed 2: at chance until round 4 (0.14), 0.936 / 0.933
-> 0.58 at round 4, 0.942 / 0.942 (fedadam / fedadagrad); the 20-client seeds above
0.877 / 0.944 / 0.964 and 0.869 / 0.936 / 0.964. Measured on
bench_learning's grid (several models, data sets and splits, one set of defaults): docs/job.md.
Buffers (BatchNorm statistics, counters) are averaged, never stepped (`base`).

Measured and not taken (stop 62), on the one family where the adaptive steps stay below
FedAvg (MNIST usercnn:Conv1dBN, beta 0.3, 20 clients, star; fedavg 0.652 / 0.369 / 0.628
over seeds 0-2, fedadam 0.614 / 0.348 / 0.614). On seed 0, FedAvg's direction for one
tensor at a time located the gap in the output layer: for the conv layer only 0.617, for
the linear head only 0.649, for both 0.645; an AdamP-style radial projection of the
BatchNorm'd conv weights 0.611; statistics measured instead of pooled 0.617 (fedavg 0.657).
The head along its pseudo-gradient on every BatchNorm model closed that family (0.649 /
0.367 / 0.622; fedadagrad 0.645 / 0.368 / 0.621) but cost usercnn:BNResCNN, where Adam's
head is the gain (digits, 20 clients: beta 0.3 seed 0 fedadam 0.858 -> 0.833, fedavg
0.838; beta 0.1 seed 1 0.877 -> 0.827, fedadagrad 0.877 -> 0.808, fedavg 0.833); on every
model it cost digits SmallCNN beta 0.1 seed 1 fedadam 0.947 -> 0.886. What closed it
(stop 64), in part: every tensor of a BatchNorm model turned only half of the way to
Adam's direction (NORM_ADAM_SHARE), not the head alone: seeds 0-2 -0.020 / -0.007 / -0.007
(a quarter of the way: -0.010 / +0.001 / -0.005, but -0.167 on a one-label-per-client split).
Stop 65: that model's learning rate was at the edge of killing it (its centralized run
ended at 0.100 on seed 1); at the rate the trial chooses for seed 2 (0.025,
`worker.training.learning_rate_trial`) the adaptive jobs end at 0.722-0.723 against
FedAvg's 0.724 (centralized 0.798). Whether NORM_ADAM_SHARE is still needed there is not
measured.
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
    bounded_step,
    cast_like,
    check_updates,
    has_statistics,
    opposes,
    plain_step,
    require,
    server_learning_rate,
)

if TYPE_CHECKING:
    from proto.job import AggregationSpec

log = logging.getLogger(__name__)


#: `aggregation.beta1` unset, with the scaled step: as fedavgm's MOMENTUM, the clients'
#: larger early pseudo-gradients (their learning rate decays) outweigh the recent ones in a
#: 0.9 average, and the step stays near FedAvg's length, so it went where the job had been.
#: Measured (digits, star fedadam, 15 rounds; 0.9 / 0.5, fedavg): BNCNN beta 1.0 50 clients
#: 0.947 / 0.961 (0.967); BNCNN beta 0.1 50 clients 0.900 / 0.925 (0.922); SmallCNN beta 0.3
#: 20 clients 0.813 / 0.850 (0.708); BNMLP beta 0.1 20 clients 0.903 / 0.880 (0.877; these two
#: before the near-equal batches). The direction was not it: Adam's, half Adam's or the
#: momentum's own gave 0.941-0.944 on the first cell at 0.9
BETA1 = 0.5
#: ... with the literature's plain step
PLAIN_BETA1 = 0.9
#: ... for a model with BatchNorm statistics: none (`base.NORM_MOMENTUM`; Adam's
#: second-moment preconditioning stays), as fedavgm's momentum. Measured (digits, 20
#: clients, star, 15 rounds, fedadam / fedyogi / fedadagrad against fedavg, 0.5 -> 0):
#: usercnn:Conv1dBN beta 0.3 seed 0 -0.019 / -0.017 / -0.025 -> 0 / 0 / +0.003, seed 2
#: +0.006 each -> +0.014 / +0.017 / +0.020; usercnn:BNResCNN beta 0.3 -0.003 -> +0.020 /
#: +0.020 / +0.014; BNMLP beta 0.1 seed 1 +0.025 / +0.020 / +0.020 -> +0.008 / +0.008 /
#: +0.006; BNCNN beta 0.3 seed 2 0 / +0.003 / 0 -> -0.003 each. The worst case went from
#: -0.025 to -0.003


class AdaptiveAggregator(Aggregator):
    """Base of FedAdagrad/FedAdam/FedYogi; subclasses define `second_moment`."""

    server_optimizer: ClassVar[bool] = True
    stall_step: ClassVar[bool] = True
    state_slots: ClassVar[dict[str, str]] = {"m": "model", "v": "nonnegative", "t": "rounds"}
    #: bias-correct the second moment (an exponential average); Adagrad's is a plain sum
    bias_corrected_v: ClassVar[bool] = True
    #: server_lr of the scaled step, in lengths of the momentum pseudo-gradient: Adam's
    #: direction spreads the step over every coordinate, so at 1.0 it gains less per round
    #: than FedAvg along FedAvg's own direction (measured: MNIST SmallCNN, 20 clients, 5
    #: rounds: loss 2.11 against FedAvg's 1.81); at 2.0 (within max_step_ratio) 1.51
    default_server_learning_rate: ClassVar[float] = 2.0
    #: server_lr of the literature's plain step (Reddi et al.'s recommended region)
    plain_server_learning_rate: ClassVar[float] = 0.05

    def __init__(self, spec: AggregationSpec) -> None:
        super().__init__(spec)
        self.server_lr = server_learning_rate(spec, type(self))
        self.plain = plain_step(spec)
        beta1 = getattr(spec, "beta1", None)
        self.beta1 = float(beta1 if beta1 is not None else PLAIN_BETA1 if self.plain else BETA1)
        self.beta2 = float(spec.beta2)
        self.tau = float(spec.tau)
        require(self.server_lr > 0, self.name, "server_learning_rate", self.server_lr, "> 0")
        require(0 <= self.beta1 < 1, self.name, "beta1", self.beta1, "0 <= beta1 < 1")
        require(0 <= self.beta2 < 1, self.name, "beta2", self.beta2, "0 <= beta2 < 1")
        require(self.tau > 0, self.name, "tau", self.tau, "> 0")
        if self.plain and self.server_lr >= 0.5:
            # every step moves each coordinate by up to ~server_lr: 1.0 diverges on digits
            log.warning(
                "event=large_server_learning_rate aggregator=%s server_learning_rate=%s "
                "server_step=plain hint=Reddi et al. tune it in 0.01..0.3 per model; "
                "server_step = 'scaled' needs no tuning", self.name, self.server_lr)

    @abstractmethod
    def second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        """The new second-moment estimate from the previous one and this round's delta."""

    def aggregate(self, global_weights: Mapping[str, np.ndarray], updates: Sequence[Update]) -> Weights:
        check_updates(global_weights, updates, self.name)
        avg = self.mean(updates)
        m_state = self._state.setdefault("m", {})
        v_state = self._state.setdefault("v", {})
        t_state = self._state.setdefault("t", {})
        out: Weights = {}
        ratio = self.step_ratio(global_weights)
        norm = has_statistics(global_weights)
        beta1 = self.moment(global_weights, self.beta1, "beta1")
        currents = self.trained(global_weights, avg)
        deltas = {name: avg[name] - current for name, current in currents.items()}
        restart = not self.plain and opposes(m_state, deltas)
        for name, mean in avg.items():
            if name not in deltas:
                out[name] = mean
                continue
            current, delta = currents[name], deltas[name]
            t = int(t_state[name]) + 1 if name in t_state else 1
            m = beta1 * m_state.get(name, 0.0) + (1 - beta1) * delta
            if restart:   # the momentum is forgotten: m_hat is this round's delta
                m = (1 - beta1**t) * delta
            v = self.second_moment(v_state.get(name, np.zeros_like(delta)), delta)
            m_state[name], v_state[name], t_state[name] = m, v, np.asarray(t, dtype=np.int64)
            m_hat = m / (1 - beta1**t)
            v_hat = v / (1 - self.beta2**t) if self.bias_corrected_v else v
            direction = m_hat / (np.sqrt(v_hat) + self.tau)
            if self.plain:
                out[name] = current + self.server_lr * self.step_scale * direction
                continue
            # a first round has no history: m_hat is its delta, and 2x would only extrapolate it
            lr = min(self.server_lr, 1.0) if t == 1 else self.server_lr
            # on_stall's halvings shrink the bound too (`stall_bound`)
            step = bounded_step(lr * self.step_scale * scaled_direction(
                m_hat, direction, t, NORM_ADAM_SHARE if norm else 1.0), delta,
                self.stall_bound(min(ratio, 1.0) if restart else ratio))
            out[name] = current + step
        return cast_like(out, global_weights)


#: how far the scaled step's direction turns from the pseudo-gradient's to Adam's, for a
#: model with BatchNorm statistics (`scaled_direction`'s share; 1 for any other): the
#: pooled running statistics were measured on the clients' models, which lie around
#: FedAvg's mean, so a step that leaves FedAvg's direction leaves its statistics behind, as
#: one that goes further than FedAvg's length does (`Aggregator.step_ratio`); but where the
#: clients pull apart, Adam's direction is the gain. Measured (stop 64; star fedadam minus
#: fedavg, 20 clients, 15 rounds unless said; share 1 / 0.5 / 0.25): MNIST usercnn:Conv1dBN
#: beta 0.3 seeds 0 / 1 / 2 -0.039 / -0.020 / -0.010, -0.021 / -0.007 / +0.001, -0.014 /
#: -0.007 / -0.005; digits usercnn:BNResCNN beta 0.3 s0 +0.020 / +0.014 / +0.012, beta 0.1
#: s1 +0.045 / +0.017 / -0.003; digits BNCNN beta 0.1 s0 -0.008 / -0.006 / +0.006; table
#: BNMLP beta 0.1 s1 +0.035 at each; a conv-BN-dropout CNN of a user's on digits with one
#: label per client (`labels`, 12 rounds) seeds 0 / 1 / 2: +0.200 / +0.194 / -0.095,
#: +0.160 / +0.153 / +0.156, -0.049 / +0.100 / -0.167 (FedAvg swings between 0.1 and 0.8
#: there). Worst case: -0.049 / -0.020 / -0.167
NORM_ADAM_SHARE = 0.5
#: rounds over which the scaled step turns from the pseudo-gradient's own direction to
#: Adam's: a first round's v_hat is delta^2 exactly, so Adam's first steps are sign steps
#: that spread the step evenly over every coordinate, whatever moved
WARMUP_ROUNDS = 5


def scaled_direction(m_hat: np.ndarray, direction: np.ndarray, t: int,
                     share: float = 1.0) -> np.ndarray:
    """The scaled step's direction at the length of `m_hat`: round t blends the unit
    vectors of `m_hat` and of Adam's `direction` with weight min(share, (t - 1) /
    WARMUP_ROUNDS) on the latter."""
    length = float(np.linalg.norm(m_hat))
    norm = float(np.linalg.norm(direction))
    if length == 0.0 or norm == 0.0:
        return np.zeros_like(m_hat)
    weight = min(share, (t - 1) / WARMUP_ROUNDS)
    blend = (1.0 - weight) * m_hat / length + weight * direction / norm
    size = float(np.linalg.norm(blend))
    return blend * (length / size) if size > 0 else np.zeros_like(m_hat)
