"""Aggregation algorithms, one class per module behind `Aggregator`, chosen by name."""

from .base import AggregationError, Aggregator, Update, Weights
from .registry import AGGREGATOR_NAMES, AGGREGATORS, get_aggregator

__all__ = [
    "AGGREGATORS",
    "AGGREGATOR_NAMES",
    "AggregationError",
    "Aggregator",
    "Update",
    "Weights",
    "get_aggregator",
]
