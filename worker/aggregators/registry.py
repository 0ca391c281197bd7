"""Aggregation config names -> aggregator classes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import AggregationError, Aggregator
from .fedadagrad import FedAdagrad
from .fedadam import FedAdam
from .fedavg import FedAvg
from .fedavgm import FedAvgM
from .fedprox import FedProx
from .fedyogi import FedYogi
from .krum import Krum
from .median import Median
from .trimmed_mean import TrimmedMean

if TYPE_CHECKING:
    from proto.job import AggregationSpec

AGGREGATORS: dict[str, type[Aggregator]] = {
    cls.name: cls
    for cls in (FedAvg, FedProx, FedAvgM, FedAdam, FedYogi, FedAdagrad, Median, TrimmedMean, Krum)
}
AGGREGATOR_NAMES = tuple(AGGREGATORS)


def get_aggregator(spec: AggregationSpec) -> Aggregator:
    """A fresh aggregator for `spec.name`; unknown names raise `AggregationError` listing
    the valid ones, bad settings raise it naming the `aggregation.*` key."""
    cls = AGGREGATORS.get(spec.name)
    if cls is None:
        raise AggregationError(
            f"unknown aggregation.name {spec.name!r}; use one of {', '.join(AGGREGATOR_NAMES)}"
        )
    return cls(spec)
