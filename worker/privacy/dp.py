"""Differential privacy of client updates: L2 clipping, Gaussian noise, and the privacy spent,
tracked by Google's `dp-accounting` (its privacy-loss-distribution accountant: for the same
epsilon it allows 6-12% less noise than the RDP accountant, e.g. z = 2.32 instead of 2.47
for 15 full rounds at epsilon 8, delta 1e-5).

Central DP (DP-FedAvg, McMahan et al. 2018): the aggregation clips every client's update
(its model minus the round's start) to `clip_norm`, averages them with equal weights and
adds N(0, (z * clip_norm / m)^2) to the mean of m updates, so one client changes the
released mean by at most clip_norm / m, z times the noise's scale. The round samples clients
at rate q (`training.client_fraction`); the accountant composes one Poisson-sampled Gaussian
per round (the engine draws a fixed number, the usual approximation).
Tree noise (central DP from a target epsilon, where it leaves less noise in the model):
the noise of binary-tree aggregation (DP-FTRL's, Kairouz et al. 2021) in place of a fresh
draw a round: the sum of the rounds' means, which the model follows, then carries at
most log2(T) + 1 node noises rather than T round noises, while each client enters
log2(T) + 1 releases rather than T, unsampled (the tree gets no amplification). At 15
full rounds and epsilon 8 the noise on the sum is 3.7 times smaller (z 1.20 on 4 nodes
against 2.32 on 15 rounds); with few clients a round sampled (q 0.05) a draw a round
stays.
Local DP: each client adds N(0, (z * clip_norm)^2) to its own clipped update before it
leaves; nobody, the aggregator included, sees it without noise. Its accountant takes q = 1:
who takes part in a round is visible to the aggregator, so sampling does not amplify.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
from dp_accounting import pld

#: the PLD's discretization of privacy loss: its pessimistic estimate stays an upper bound
#: (epsilon 1..8 over 15..200 rounds: 0.1-0.2 s an accounting, within 1% of 1e-4's)
DISCRETIZATION = 1e-3


def accountant() -> pld.PLDAccountant:
    return pld.PLDAccountant(value_discretization_interval=DISCRETIZATION)


def clip(update: np.ndarray, clip_norm: float) -> tuple[np.ndarray, float]:
    """`update` scaled to L2 norm at most `clip_norm`, and its norm before."""
    norm = float(np.linalg.norm(update))
    if norm > clip_norm:
        update = update * (clip_norm / norm)
    return update, norm


def gaussian(n: int, std: float, rng: np.random.Generator) -> np.ndarray:
    return rng.normal(0.0, std, size=n) if std > 0 else np.zeros(n)


def event(noise_multiplier: float, sampling_rate: float, rounds: int) -> dp_accounting.DpEvent:
    """`rounds` compositions of the Gaussian mechanism, Poisson-sampled at `sampling_rate`."""
    gauss: dp_accounting.DpEvent = dp_accounting.GaussianDpEvent(noise_multiplier)
    if sampling_rate < 1.0:
        gauss = dp_accounting.PoissonSampledDpEvent(sampling_rate, gauss)
    return dp_accounting.SelfComposedDpEvent(gauss, rounds)


def epsilon(noise_multiplier: float, sampling_rate: float, rounds: int, delta: float) -> float:
    """The epsilon spent after `rounds` rounds (inf with no noise; 0 after none)."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    spent = accountant()
    spent.compose(event(noise_multiplier, sampling_rate, rounds))
    return float(spent.get_epsilon(delta))


def noise_for(target_epsilon: float, delta: float, sampling_rate: float, rounds: int) -> float:
    """The smallest noise multiplier whose `rounds` rounds spend at most `target_epsilon`."""
    return float(dp_accounting.calibrate_dp_mechanism(
        accountant,
        lambda z: event(z, sampling_rate, rounds),
        target_epsilon, delta,
        bracket_interval=dp_accounting.LowerEndpointAndGuess(0.0, 1.0)))


def tree_depth(rounds: int) -> int:
    """How many nodes of binary-tree aggregation hold one round among `rounds`: the
    dyadic intervals [a, a + 2^l) with a leaf in them that end by `rounds`."""
    return max(1, rounds).bit_length()


class TreeNoise:
    """The noise of a sum of per-round values by binary-tree aggregation (Dwork et al.
    2010; DP-FTRL, Kairouz et al. 2021): every dyadic interval of rounds [a, a + 2^l)
    gets one Gaussian draw, the sum of rounds 1..t carries those of t's binary
    decomposition (at most `tree_depth(t)`), and round t is given their change since
    t - 1. A sum of T rounds then holds sqrt(depth) node noises instead of sqrt(T) round
    noises, at the price of each value entering `tree_depth(T)` node releases."""

    def __init__(self, n: int, std: float, rng: np.random.Generator) -> None:
        self.n, self.std, self.rng = n, std, rng
        self._nodes: dict[tuple[int, int], np.ndarray] = {}

    @staticmethod
    def nodes(t: int) -> list[tuple[int, int]]:
        """The dyadic intervals (start, level) whose union is rounds 1..t."""
        out, start = [], 0
        for level in reversed(range(t.bit_length())):
            if t >> level & 1:
                out.append((start, level))
                start += 1 << level
        return out

    def increment(self, t: int) -> np.ndarray:
        """What round t (1, 2, ...) adds: the noise of rounds 1..t minus that of
        1..t - 1 (the same again for a repeated round: its nodes are kept)."""
        before, now = self.nodes(t - 1), self.nodes(t)
        self._nodes = {k: self._nodes[k] if k in self._nodes
                       else gaussian(self.n, self.std, self.rng) for k in {*before, *now}}
        return (sum((self._nodes[k] for k in now), np.zeros(self.n))
                - sum((self._nodes[k] for k in before), np.zeros(self.n)))


__all__ = ["TreeNoise", "tree_depth", "accountant", "clip", "epsilon", "event", "gaussian", "noise_for"]
