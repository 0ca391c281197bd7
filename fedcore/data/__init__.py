"""Datasets and client partitioning, numpy only (the scheduler imports this; no torch, no ray).

The partition function lives at `fedcore.data.partition.partition`; it is not re-exported
here so that `fedcore.data.partition` stays the module.
"""

from .datasets import (
    Dataset,
    DatasetError,
    clear_cache,
    load_dataset,
    moments,
    prepare,
    scaling,
    shared_scaling,
    standardized,
)
from .partition import (
    DISTRIBUTIONS,
    ClientPartition,
    PartitionError,
    client_data,
    label_histograms,
    pinned_data,
)

__all__ = [
    "DISTRIBUTIONS",
    "ClientPartition",
    "Dataset",
    "DatasetError",
    "PartitionError",
    "clear_cache",
    "client_data",
    "label_histograms",
    "load_dataset",
    "pinned_data",
    "moments",
    "prepare",
    "scaling",
    "shared_scaling",
    "standardized",
]
