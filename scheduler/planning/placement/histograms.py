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



def population_histograms(
    num_clients: int,
    num_populations: int,
    num_classes: int = 10,
    *,
    prototype_beta: float = 0.5,
    concentration: float = 50.0,
    min_samples: int = 20,
    max_samples: int = 200,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Clients of `num_populations` latent populations, the setting clustered FL is for.
    Each population has a label-distribution prototype drawn from Dirichlet(prototype_beta);
    each client's proportions are drawn from Dirichlet(concentration * prototype) around
    its population's (larger `concentration`: clients closer to their prototype), and its
    histogram is a multinomial draw of a uniform 20..200 (`min_samples..max_samples`)
    samples from them. Clients are assigned to populations uniformly at random.

    Returns `(histograms [num_clients, num_classes] int64, population of each client)`.
    Deterministic for `seed`."""
    if num_populations < 1:
        raise ValueError(f"need at least one population, got {num_populations}")
    if not 1 <= min_samples <= max_samples:
        raise ValueError(f"need 1 <= min_samples <= max_samples, got {min_samples}, "
                         f"{max_samples}")
    rng = np.random.default_rng(seed)
    prototypes = rng.dirichlet(np.full(num_classes, prototype_beta), size=num_populations)
    population = rng.integers(0, num_populations, size=num_clients)
    # Dirichlet(concentration * prototype) via normalised gammas (a prototype entry can be
    # ~0, which numpy's dirichlet rejects; such a class then gets no samples).
    shape = concentration * prototypes[population]
    gammas = rng.standard_gamma(np.maximum(shape, 1e-300))
    totals = gammas.sum(axis=1, keepdims=True)
    proportions = np.where(totals > 0, gammas / np.where(totals > 0, totals, 1.0),
                           prototypes[population])
    samples = rng.integers(min_samples, max_samples + 1, size=num_clients)
    hist = rng.multinomial(samples, proportions / proportions.sum(axis=1, keepdims=True))
    return hist.astype(np.int64), population.astype(np.int64)
