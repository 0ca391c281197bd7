"""Private by construction: secure aggregation between clusters and differential privacy
(`[privacy]` of the job; docs/security.md says who sees what with each option).

`Privacy` is what the round engine calls where updates are combined: `protect` on each
client's trained model before it goes up (clip, local noise, quantize and mask), and
`combine` on what a star's root or a hybrid group received (unmask the sum, or clip and
average, then central noise), which leaves one update for the job's aggregator; at a
hybrid exchange every group `mask`s its share and each `unmask`s the groups' mean. The pure parts are `secagg`
(masks, fixed point, Shamir) and `dp` (clipping, noise, the accountant).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fedcore import dp
from proto.job import JobSpec
from worker.privacy import secagg

Weights = dict[str, np.ndarray]
#: adaptive clipping's geometric rate (Andrew et al. 2021, TFF and Flower: 0.2)
CLIP_RATE = 0.2
log = logging.getLogger("fedpilot.executor")


def _floats(weights: Mapping[str, np.ndarray]) -> list[str]:
    """The tensors privacy applies to, in name order: the floating ones. Integer buffers
    (BatchNorm's batch counter) carry no gradient; they travel and are averaged as they are."""
    return [k for k in sorted(weights) if np.asarray(weights[k]).dtype.kind == "f"]


def flatten(weights: Mapping[str, np.ndarray]) -> np.ndarray:
    """The model's floating tensors (in name order) as one float64 vector."""
    return np.concatenate([np.asarray(weights[k], dtype=np.float64).ravel()
                           for k in _floats(weights)] or [np.zeros(0)])


def unflatten(vector: np.ndarray, like: Mapping[str, np.ndarray]) -> Weights:
    """`vector` cut back into `like`'s floating tensors (their shapes and dtypes); the
    others are `like`'s."""
    out: Weights = dict(like)
    at = 0
    for k in _floats(like):
        ref = np.asarray(like[k])
        out[k] = vector[at:at + ref.size].reshape(ref.shape).astype(ref.dtype)
        at += ref.size
    return out


def _mean_rest(updates: list[tuple[Weights, int]]) -> Weights:
    """The sample-weighted mean of the updates' integer tensors (rounded)."""
    first = updates[0][0]
    total = max(1, sum(n for _, n in updates))
    return {k: np.rint(sum(np.asarray(w[k], dtype=np.float64) * n for w, n in updates) / total
                       ).astype(np.asarray(first[k]).dtype)
            for k in first if k not in set(_floats(first))}


class Privacy:
    """One job's privacy on one cluster (None of it when `[privacy]` asks for nothing)."""

    def __init__(self, spec: JobSpec, cluster_id: str, *, locate: Callable[[str], str],
                 samples: Callable[[str], int]) -> None:
        p = spec.privacy
        self.spec = p
        self.job_id = spec.job_id
        self.cluster_id = cluster_id
        self.locate = locate
        self.samples = samples
        self.rounds = spec.training.federated_learning_rounds
        self.sampling_rate = dp.sampling_rate(p.dp, spec.training.client_fraction)
        # JobSpec's rules: with DP, a noise multiplier or a target epsilon
        self.noise_multiplier = (
            float(p.noise_multiplier or 0.0) if p.dp == "none" else
            dp.multiplier(p.noise_multiplier, p.epsilon, p.delta, self.sampling_rate, self.rounds))
        #: adaptive clipping (Andrew et al. 2021; TFF's and Flower's defaults): each
        #: aggregating node's clip norm starts at clip_norm and follows clip_quantile of the
        #: updates' norms, from a noised count of the updates within it. The count's noise
        #: (std 0.05 x the clients a round, or z where that is less) is split off z: a round
        #: stays one Gaussian of z for the accountant (the paper's Theorem 1)
        self.clip: dict[str, float] = {}
        self.count_std, self.update_z = 0.0, self.noise_multiplier
        if p.clip_quantile is not None:
            clients = spec.data.number_of_clients * self.sampling_rate
            self.count_std = max(0.05 * clients, self.noise_multiplier)
            self.update_z = (self.noise_multiplier ** -2 - (2 * self.count_std) ** -2) ** -0.5
        self.key = secagg.new_key() if p.secure_aggregation else None
        self._secrets: dict[str, bytes] = {}
        #: the round's attempt (round.run's): a repeated round masks afresh, so no mask
        #: is ever used in two sums
        self.attempt = 0
        self._masks: dict[tuple[int, int, str, str], np.ndarray] = {}
        self._lock = threading.Lock()
        self._rng = np.random.default_rng()  # noise is never reproducible from the seed

    @classmethod
    def for_job(cls, spec: JobSpec, cluster_id: str, **kw: Any) -> Privacy | None:
        p = spec.privacy
        return cls(spec, cluster_id, **kw) if p.secure_aggregation or p.dp != "none" else None

    # -- the accountant --------------------------------------------------------------------
    def epsilon(self, rounds: int) -> float:
        """The epsilon spent after `rounds` rounds (NaN without DP)."""
        if self.spec.dp == "none":
            return math.nan
        return dp.epsilon(self.noise_multiplier, self.sampling_rate, rounds, self.spec.delta)

    def max_rounds(self) -> int:
        """How many of the job's rounds fit the budget `epsilon` (all without one)."""
        budget = self.spec.epsilon
        if self.spec.dp == "none" or budget is None:
            return self.rounds
        low, high = 0, self.rounds  # epsilon grows with the rounds: bisect
        while low < high:
            mid = (low + high + 1) // 2
            if self.epsilon(mid) <= budget * (1 + 1e-9):
                low = mid
            else:
                high = mid - 1
        return low

    # -- secure aggregation's keys ---------------------------------------------------------
    def public_key(self) -> bytes | None:
        return None if self.key is None else secagg.public_bytes(self.key)

    def set_peer_keys(self, keys: Mapping[str, bytes]) -> None:
        """Every contributing cluster's public key (this one's among them)."""
        assert self.key is not None
        secrets = {c: secagg.pair_secret(self.key, k, self.job_id) for c, k in keys.items()}
        with self._lock:
            self._secrets = secrets
            self._masks.clear()

    # -- the seams ---------------------------------------------------------------------------
    @property
    def combines(self) -> bool:
        """Whether the aggregation over clients goes through `combine`."""
        return self.spec.secure_aggregation or self.spec.dp == "central"

    def protect(self, node: str, r: int, start: Weights, trained: Weights,
                contributors: Sequence[str], aggregation: str) -> Weights:
        """What client `node` sends up to `aggregation`: its update clipped (DP) and noised
        (local DP), then, with secure aggregation, masked among `contributors` (every
        client whose update the same aggregation sums this round)."""
        p = self.spec
        base = flatten(start)
        delta = flatten(trained) - base
        if p.dp != "none" and p.clip_quantile is None:  # else the aggregator's clip
            delta, _ = dp.clip(delta, p.clip_norm)
        if p.dp == "local":
            delta = delta + dp.gaussian(delta.size, self.noise_multiplier * p.clip_norm,
                                        self._rng)
        if not p.secure_aggregation:
            return unflatten(base + delta, trained)
        weights = ({c: 1 for c in contributors} if p.dp != "none"  # DP: equal weights
                   else {c: self.samples(c) for c in contributors})
        return self.mask(node, r, delta, trained, contributors, weights, aggregation)

    def tag(self, r: int, aggregation: str) -> str:
        """The label of round `r`'s masks for the sum `aggregation` takes (its attempt in
        it: a repeated round masks afresh; `secagg.dropped_correction` takes the same)."""
        return f"{self.job_id}/{r}.{self.attempt}/{aggregation}"

    def mask(self, node: str, r: int, delta: np.ndarray, like: Weights,
             contributors: Sequence[str], weights: Mapping[str, int], aggregation: str
             ) -> Weights:
        """`node`'s share weights[node] / sum(weights) of `delta`, quantized and masked
        among `contributors` for the sum `aggregation` takes in round `r` (a model of
        `like`'s shapes whose floating values are ring elements, its other tensors as
        they are)."""
        share = weights[node] / max(1, sum(weights[c] for c in contributors))
        q, clipped = secagg.quantize(delta, share, self.spec.clip_range)
        if clipped:  # a clip_range too small for the job's updates changes what it learns
            log.info("event=secagg_clipped node=%s round=%d coordinates=%d clip_range=%g",
                     node, r, clipped, self.spec.clip_range)
        key = (r, self.attempt, aggregation, node)
        with self._lock:
            if key not in self._masks:
                where = {c: self.locate(c) for c in contributors}
                mine = [c for c in contributors if where[c] == self.cluster_id]
                masks = secagg.cluster_masks(self.cluster_id, mine, sorted(set(where.values())),
                                             self._secrets, self.tag(r, aggregation), q.size)
                self._masks = {k: v for k, v in self._masks.items() if k[0] >= r}
                self._masks.update({(r, self.attempt, aggregation, c): m
                                    for c, m in masks.items()})
            m = self._masks.pop(key)
        return unflatten(secagg.mask(q, m).astype(np.float64), like)

    def unmask(self, current: Weights, updates: list[tuple[Weights, int]]) -> Weights:
        """The weighted mean model that masked `updates` of models from `current` sum to."""
        return unflatten(flatten(current) + self._mean_delta(updates),
                         {**current, **_mean_rest(updates)})

    def _mean_delta(self, updates: list[tuple[Weights, int]]) -> np.ndarray:
        total = secagg.masked_sum([flatten(w).astype(np.uint32) for w, _ in updates])
        return secagg.dequantize(total, self.spec.clip_range)

    def combine(self, current: Weights, updates: list[tuple[Weights, int]], node: str = ""
                ) -> list[tuple[Weights, int]]:
        """The one update the aggregator's rule sees in place of clients' `updates`: the
        round's start plus the (weighted, or under DP clipped and equally weighted) mean
        update, unmasked from its sum with secure aggregation, with central DP's noise."""
        p = self.spec
        base = flatten(current)
        bound = self.clip.get(node, p.clip_norm)  # the clients' clip_norm, or adapted
        if p.secure_aggregation:
            mean = self._mean_delta(updates)
        else:
            deltas = [flatten(w) - base for w, _ in updates]
            if p.dp != "none":
                clipped = [dp.clip(d, bound) for d in deltas]
                deltas = [d for d, _ in clipped]
                weights = np.full(len(deltas), 1.0 / len(deltas))
                if p.clip_quantile is not None:  # the count less half of them: sensitivity 1/2
                    within = sum(n <= bound for _, n in clipped) - len(clipped) / 2
                    share = 0.5 + (within + self._rng.normal(0.0, self.count_std)) / len(clipped)
                    self.clip[node] = bound * math.exp(-CLIP_RATE * (share - p.clip_quantile))
                    log.info("event=dp_clip node=%s clip_norm=%.4g next=%.4g", node, bound,
                             self.clip[node])
            else:
                n = np.array([k for _, k in updates], dtype=np.float64)
                weights = n / n.sum()
            mean = sum(w * d for w, d in zip(weights, deltas, strict=True))
        if p.dp == "central":
            mean = mean + dp.gaussian(base.size, self.update_z * bound / len(updates),
                                      self._rng)
        return [(unflatten(base + mean, {**current, **_mean_rest(updates)}),
                 sum(k for _, k in updates))]


__all__ = ["Privacy", "dp", "flatten", "secagg", "unflatten"]
