"""Aggregation config names -> aggregator classes, plus user classes `package.module:Class`."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
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


def get_aggregator(spec: AggregationSpec, buffers: Iterable[str] = (), classes: int = 0
                   ) -> Aggregator:
    """A fresh aggregator for `spec.name` (a built-in name or a user class
    `package.module:Class`); unknown names raise `AggregationError` listing the valid ones,
    bad settings raise it naming the `aggregation.*` key. `buffers` names the model's
    buffers (averaged, never stepped by a server optimizer); `classes` the job's classes
    (for `Aggregator.observe`, the on_stall rule)."""
    cls = AGGREGATORS.get(spec.name) or (user_aggregator(spec.name) if ":" in spec.name else None)
    if cls is None:
        raise AggregationError(
            f"unknown aggregation.name {spec.name!r}; use one of {', '.join(AGGREGATOR_NAMES)} "
            "or a user class as 'package.module:Class'"
        )
    try:
        aggregator = cls(spec)
    except TypeError as exc:  # e.g. an abstract method left out, or another __init__
        raise AggregationError(f"aggregation.name {spec.name!r}: cannot create it: {exc}") from None
    aggregator.buffers = frozenset(buffers)
    aggregator.classes = int(classes)
    return aggregator


def user_aggregator(name: str) -> type[Aggregator]:
    """The `Aggregator` subclass named `package.module:Class`, imported like user models
    (the module must be importable on every cluster, e.g. on PYTHONPATH)."""
    module_name, _, class_name = name.partition(":")
    if not module_name or not class_name:
        raise AggregationError(f"aggregation.name {name!r}: a user aggregator is written "
                               "'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AggregationError(f"aggregation.name {name!r}: cannot import module {module_name!r} "
                               f"({exc}); make sure it is installed or on PYTHONPATH on every "
                               "cluster") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise AggregationError(f"aggregation.name {name!r}: module {module_name!r} has no "
                               f"attribute {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Aggregator)):
        raise AggregationError(f"aggregation.name {name!r}: {class_name} is not a subclass of "
                               "worker.aggregators.Aggregator (see docs/job.md)")
    return cls
