"""FedAvgM (Hsu et al., 2019): FedAvg with server momentum on the pseudo-gradient.

With momentum 0.9 the literature's step (`aggregation.server_step = "plain"`) grows to ten
times FedAvg's once the pseudo-gradients line up. By default (`server_step = "scaled"`)
each tensor's step is at most `max_step_ratio` (2; 1.5 for a model with BatchNorm
statistics, `Aggregator.step_ratio`) times FedAvg's own step for it (`base.bounded_step`):
momentum still carries the direction through noisy rounds, and is forgotten in a round whose
pseudo-gradient points against it (`base.opposes`: the job went past a minimum; not
in the plain form). A model with BatchNorm statistics gets no momentum unless the job sets
`server_momentum` (`base.NORM_MOMENTUM`): bounded to FedAvg's length (until stop 75), momentum
only turned the step away from the round's pseudo-gradient; without momentum, at its
server rate of 1, its step there is FedAvg's.
"""

from __future__ import annotations

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
    opposes,
    plain_step,
    require,
    server_learning_rate,
)

if TYPE_CHECKING:
    from proto.job import AggregationSpec


#: `aggregation.server_momentum` unset, with the scaled step: the momentum only picks the
#: step's direction (its length is FedAvg's at most), and over ten rounds (0.9) the clients'
#: larger early pseudo-gradients (their learning rate decays) outweigh the recent ones, so
#: the job drifts after its peak. Measured (bench_learning cells, 20 clients, 15 rounds,
#: star): digits BNMLP beta 0.1 0.766 at 0.9, 0.866 at 0.5 (reference FedAvg 0.858);
#: digits BNCNN beta 0.1 0.772 / 0.833 (0.724); MNIST SmallCNN beta 0.3 0.943 / 0.957
#: (0.948); digits SmallCNN beta 0.3 0.813 / 0.822 (0.599)
MOMENTUM = 0.5
#: ... with the literature's plain step (Hsu et al.)
PLAIN_MOMENTUM = 0.9
#: ... for a model with BatchNorm statistics: none (`base.NORM_MOMENTUM`, FedAvg's step
#: with the scaled one). Measured (15 rounds, star, 0.5 against FedAvg): the grid's
#: BatchNorm cells +0.001 on average (31 cells, -0.008 to +0.020); two BatchNorm models that
#: came after the defaults, on digits beta 0.3, 20 clients (bench/usercnn.py): Conv1dBN
#: -0.031 / +0.003 / -0.022 (seeds 0-2; test loss 0.482 against 0.454 at seed 0), BNResCNN
#: -0.025 (loss 1.121 against 1.099)


class FedAvgM(Aggregator):
    """g = w_global - avg; v = momentum * v + g; w = w_global - server_lr * v.

    Buffers (normalization statistics, counters) take the pooled mean, never a step.
    """

    name = "fedavgm"
    server_optimizer = True
    stall_step = True
    state_slots: ClassVar[dict[str, str]] = {"velocity": "model"}

    def __init__(self, spec: AggregationSpec) -> None:
        super().__init__(spec)
        self.server_lr = server_learning_rate(spec, type(self))
        self.plain = plain_step(spec)
        momentum = getattr(spec, "server_momentum", None)
        self.momentum = float(momentum if momentum is not None else
                              PLAIN_MOMENTUM if self.plain else MOMENTUM)
        require(self.server_lr > 0, self.name, "server_learning_rate", self.server_lr, "> 0")
        require(0 <= self.momentum < 1, self.name, "server_momentum", self.momentum, "0 <= m < 1")

    def aggregate(self, global_weights: Mapping[str, np.ndarray], updates: Sequence[Update]) -> Weights:
        check_updates(global_weights, updates, self.name)
        avg = self.mean(updates)
        velocity = self._state.setdefault("velocity", {})
        out: Weights = {}
        ratio = self.step_ratio(global_weights)
        momentum = self.moment(global_weights, self.momentum, "server_momentum")
        currents = self.trained(global_weights, avg)
        grads = {name: current - avg[name] for name, current in currents.items()}
        if not self.plain and opposes(velocity, grads):
            velocity.clear()
        for name, mean in avg.items():
            if name not in grads:
                out[name] = mean
                continue
            grad = grads[name]
            v = momentum * velocity[name] + grad if name in velocity else grad
            velocity[name] = v
            step = bounded_step(self.server_lr * self.step_scale * v, grad,
                                self.stall_bound(ratio))
            out[name] = currents[name] - step
        return cast_like(out, global_weights)
