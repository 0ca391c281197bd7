"""The aggregator interface and the checks and helpers every algorithm shares.

An aggregator turns the current global weights and a list of client updates
(weights, number of samples) into new global weights. Everything is numpy on
`dict[str, np.ndarray]`; arithmetic is float64 and results take the global tensors' dtypes.
Stateful algorithms (server momentum, adaptive moments) keep their state in the instance
and expose it through `state_dict`/`load_state_dict` so it can move with a migrating node.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from worker.errors import WorkerError

if TYPE_CHECKING:
    from proto.job import AggregationSpec

Weights = dict[str, np.ndarray]
Update = tuple[Mapping[str, np.ndarray], int]


class AggregationError(WorkerError, ValueError):
    """Updates or settings cannot be aggregated; the message names the update, tensor or key."""


class Aggregator(ABC):
    """One aggregation algorithm. Subclasses set `name` and implement `aggregate`."""

    name: ClassVar[str]
    # Used when `spec.server_learning_rate` is None (per-algorithm default).
    default_server_learning_rate: ClassVar[float] = 1.0
    #: a server optimizer acts on the round's pseudo-gradient (the mean update), not on
    #: the individual client updates: where clients are first averaged in groups (hybrid),
    #: it is applied once to the mean of the groups, so the job follows one trajectory
    server_optimizer: ClassVar[bool] = False

    def __init__(self, spec: AggregationSpec) -> None:
        self.spec = spec
        self._state: dict[str, Weights] = {}

    @abstractmethod
    def aggregate(self, global_weights: Mapping[str, np.ndarray], updates: Sequence[Update]) -> Weights:
        """Return the new global weights (fresh arrays; inputs are never modified)."""

    def reset(self) -> None:
        """Forget any server state (a new job or a restart from scratch)."""
        self._state = {}

    def state_dict(self) -> Weights:
        """Server state as flat named arrays ("slot/tensor"), e.g. for safetensors."""
        return {f"{slot}/{k}": v.copy() for slot, tensors in self._state.items()
                for k, v in tensors.items()}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore what `state_dict` returned."""
        restored: dict[str, Weights] = {}
        for key, value in state.items():
            slot, sep, name = key.partition("/")
            if not sep:
                raise AggregationError(f"{self.name} state key {key!r} is not 'slot/tensor'")
            restored.setdefault(slot, {})[name] = np.array(value, dtype=np.float64)
        self._state = restored


def server_learning_rate(spec: AggregationSpec, cls: type[Aggregator]) -> float:
    """`spec.server_learning_rate`, or the algorithm's own default when it is None."""
    value = getattr(spec, "server_learning_rate", None)
    return cls.default_server_learning_rate if value is None else float(value)


def check_updates(global_weights: Mapping[str, np.ndarray], updates: Sequence[Update],
                  algorithm: str) -> None:
    """Raise `AggregationError` unless every update has the global tensors' names and shapes
    and a non-negative integer sample count."""
    if not updates:
        raise AggregationError(f"{algorithm}: no updates to aggregate")
    expected = set(global_weights)
    for i, (weights, num_samples) in enumerate(updates):
        if isinstance(num_samples, bool) or not isinstance(num_samples, int | np.integer) \
                or num_samples < 0:
            raise AggregationError(
                f"{algorithm}: update {i} has sample count {num_samples!r}; need an integer >= 0"
            )
        if set(weights) != expected:
            missing = sorted(expected - set(weights))
            extra = sorted(set(weights) - expected)
            raise AggregationError(
                f"{algorithm}: update {i} does not match the global model: missing "
                f"{missing or 'none'}, unexpected {extra or 'none'}"
            )
        for name, value in weights.items():
            if np.shape(value) != np.shape(global_weights[name]):
                raise AggregationError(
                    f"{algorithm}: update {i} tensor {name!r} has shape {np.shape(value)}, the "
                    f"global model has {np.shape(global_weights[name])}"
                )


def sample_weights(updates: Sequence[Update], algorithm: str) -> np.ndarray:
    """Each update's share of the total sample count (they sum to 1)."""
    counts = np.array([n for _, n in updates], dtype=np.float64)
    total = counts.sum()
    if total <= 0:
        raise AggregationError(
            f"{algorithm}: all {len(updates)} updates report 0 samples; nothing to weight by"
        )
    return counts / total


def weighted_average(updates: Sequence[Update], shares: np.ndarray) -> Weights:
    """Per tensor, sum_i shares[i] * update_i, in float64."""
    names = list(updates[0][0])
    out: Weights = {}
    for name in names:
        acc = np.zeros(np.shape(updates[0][0][name]), dtype=np.float64)
        for (weights, _), share in zip(updates, shares, strict=True):
            acc += share * np.asarray(weights[name], dtype=np.float64)
        out[name] = acc
    return out


def stack(updates: Sequence[Update], name: str) -> np.ndarray:
    """The tensor `name` of every update stacked along a new first axis (float64)."""
    return np.stack([np.asarray(w[name], dtype=np.float64) for w, _ in updates])


def cast_like(values: Mapping[str, np.ndarray], like: Mapping[str, np.ndarray]) -> Weights:
    """Cast each float64 result to the dtype of the matching global tensor (ints rounded)."""
    out: Weights = {}
    for name, value in values.items():
        dtype = np.asarray(like[name]).dtype
        if np.issubdtype(dtype, np.integer):
            out[name] = np.rint(value).astype(dtype)
        else:
            out[name] = np.asarray(value).astype(dtype)
    return out


def is_float(array: np.ndarray) -> bool:
    """Whether a tensor is trainable-looking (floating point) rather than a counter."""
    return bool(np.issubdtype(np.asarray(array).dtype, np.floating))


def require(condition: bool, algorithm: str, key: str, value: object, allowed: str) -> None:
    """Raise an `AggregationError` naming the aggregation key unless `condition` holds."""
    if not condition or (isinstance(value, float) and not math.isfinite(value)):
        raise AggregationError(
            f"aggregation.{key} = {value!r} is not valid for {algorithm}; need {allowed}"
        )
