"""Stage 1: one label histogram per client. No sample leaves the partitioner.

`job_histograms` asks the shared pure-numpy partitioner (`fedcore.data`, the same
deterministic split the clusters will build); the synthetic generator serves tests and
scale benchmarks.
"""

from __future__ import annotations

import numpy as np

from proto.job import JobSpec


def job_histograms(spec: JobSpec) -> np.ndarray:
    """Label histograms `[number_of_clients, num_classes]` (int64) of every client's training
    part, exactly as the clusters' executors will partition the job's dataset."""
    from fedcore.data import client_data, load_dataset  # numpy/sklearn only (see contracts)

    dataset = load_dataset(spec.data.dataset)
    return np.asarray(client_data(dataset, spec.data, spec.seed).histograms, dtype=np.int64)


def synthetic_histograms(
    num_clients: int,
    num_classes: int = 10,
    *,
    beta: float = 0.1,
    samples_per_client: int = 50,
    seed: int = 0,
) -> np.ndarray:
    """Dirichlet(beta) label-skewed histograms with `samples_per_client` samples each, as a
    stand-in for a dataset's partition at any scale. Deterministic for `seed`."""
    rng = np.random.default_rng(seed)
    proportions = rng.dirichlet(np.full(num_classes, beta), size=num_clients)
    # Multinomial per row, vectorised: draw labels by inverse CDF.
    cdf = np.cumsum(proportions, axis=1)
    cdf[:, -1] = 1.0
    draws = rng.random((num_clients, samples_per_client))
    labels = (draws[:, :, None] > cdf[:, None, :]).sum(axis=2)
    labels = np.minimum(labels, num_classes - 1)
    rows = np.repeat(np.arange(num_clients), samples_per_client)
    flat = np.bincount(rows * num_classes + labels.ravel(), minlength=num_clients * num_classes)
    return flat.reshape(num_clients, num_classes).astype(np.int64)

