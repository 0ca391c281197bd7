"""Stage 3: Affinity Propagation finds the data communities without a preset count.

Up to `max_candidates` clients, AP runs on the full cosine-similarity matrix. Above that
(AP is O(n²) in time and memory), it runs on candidate histograms — the distinct label
proportions at 1/QUANTISE_LEVELS resolution, or a count-weighted sample of them when there
are still too many — each weighted by how many clients it stands for, with the preference
estimated from client pairs; every client then joins its most similar exemplar.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import numpy as np
from sklearn.cluster import AffinityPropagation
from sklearn.exceptions import ConvergenceWarning

from scheduler.planning.placement.similarity import (
    cosine_similarity,
    nearest_rows,
    quantise,
    unit_rows,
)

log = logging.getLogger(__name__)

QUANTISE_LEVELS = 10


@dataclass(frozen=True)
class Communities:
    """`labels[i]` is client i's community (0..count-1); `centroids[c]` is community c's
    exemplar histogram (proportions); `method` is "full", "distinct" or "sampled";
    `candidates` is how many histograms AP saw."""

    labels: np.ndarray
    centroids: np.ndarray
    method: str
    candidates: int

    @property
    def count(self) -> int:
        return int(self.centroids.shape[0])

    def sizes(self) -> np.ndarray:
        return np.bincount(self.labels, minlength=self.count)


def affinity_propagation(
    similarity: np.ndarray, *, damping: float, preference: float | None, seed: int,
    weights: np.ndarray | None = None,
) -> np.ndarray:
    """Exemplar index of every row of a precomputed similarity matrix (sklearn AP,
    deterministic for `seed`). `weights[i]` (>= 1) makes row i stand for that many
    identical points: its similarities count that many times and, as an exemplar, it
    already serves its own copies. If AP does not converge it retries with heavier damping;
    if that fails too, all rows join the row with the highest total similarity."""
    n = similarity.shape[0]
    if n == 1:
        return np.zeros(1, dtype=np.int64)
    s = np.asarray(similarity, dtype=np.float64)
    base = float(np.median(s)) if preference is None else preference
    pref: float | np.ndarray = base
    if weights is not None:
        w = np.maximum(np.asarray(weights, dtype=np.float64), 1.0)
        s = s * w[:, None]
        pref = base + (w - 1.0) * np.diag(similarity)
    for d, iters in ((damping, 200), (max(damping, 0.9), 1000)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            # Identical histograms are a legitimate input: one community is the answer.
            warnings.filterwarnings("ignore", message="All samples have mutually equal")
            ap = AffinityPropagation(
                affinity="precomputed", damping=d, preference=pref, max_iter=iters,
                random_state=seed,
            ).fit(s)
        centers = ap.cluster_centers_indices_
        if centers is not None and len(centers) > 0 and (ap.labels_ >= 0).all():
            return np.asarray(centers, dtype=np.int64)[ap.labels_]
        log.warning("event=ap_not_converged n=%d damping=%.2f iterations=%d", n, d, iters)
    return np.full(n, int(np.argmax(s.sum(axis=1))), dtype=np.int64)


def distinct_rows(codes: np.ndarray, base: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of small non-negative integer codes (< base) and their counts, in
    lexicographic order. Packs rows into one int64 when they fit (a 1-D sort is ~10x
    faster than `np.unique(axis=0)` at 100k rows)."""
    width = codes.shape[1]
    if width * np.log2(base) >= 62:
        return np.unique(codes, axis=0, return_counts=True)
    weights = base ** np.arange(width - 1, -1, -1, dtype=np.int64)
    keys = np.sort(codes.astype(np.int64) @ weights)
    starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
    counts = np.diff(np.append(starts, len(keys)))
    uniq = keys[starts]
    rows = (uniq[:, None] // weights[None, :]) % base
    return rows.astype(codes.dtype), counts


def population_median_similarity(histograms: np.ndarray, *, seed: int,
                                 pairs: int = 200_000) -> float:
    """Median cosine similarity over random client pairs (self-pairs included, as in the
    full matrix), estimated from `pairs` seeded samples."""
    rng = np.random.default_rng(seed)
    n = histograms.shape[0]
    a, b = rng.integers(0, n, size=pairs), rng.integers(0, n, size=pairs)
    u = unit_rows(histograms)
    return float(np.median(np.einsum("ij,ij->i", u[a], u[b])))


def find_communities(
    histograms: np.ndarray,
    *,
    damping: float = 0.7,
    preference: float | None = None,
    seed: int = 0,
    max_candidates: int = 1000,
) -> Communities:
    """Data communities of the clients' label histograms `[n, C]`. Deterministic for the
    inputs and `seed`; memory is O(max_candidates² + n·C)."""
    hist = np.asarray(histograms)
    n = hist.shape[0]
    if n == 0:
        raise ValueError("no clients: cannot find communities of zero histograms")
    totals = hist.sum(axis=1, keepdims=True).astype(np.float64)
    props = hist / np.where(totals > 0, totals, 1.0)
    if n <= max_candidates:
        exemplar_of = affinity_propagation(
            cosine_similarity(hist), damping=damping, preference=preference, seed=seed)
        exemplars, labels = np.unique(exemplar_of, return_inverse=True)
        return Communities(labels.astype(np.int64), props[exemplars], "full", n)
    codes = quantise(hist, QUANTISE_LEVELS)
    distinct, counts = distinct_rows(codes, QUANTISE_LEVELS + 1)
    method = "distinct"
    if len(distinct) > max_candidates:
        rng = np.random.default_rng(seed)
        pick = np.sort(rng.choice(len(distinct), size=max_candidates, replace=False,
                                  p=counts / counts.sum()))
        distinct, counts = distinct[pick], counts[pick]
        method = "sampled"
    candidates = distinct.astype(np.float64) / QUANTISE_LEVELS
    weights = counts * (n / counts.sum())  # clients each candidate stands for
    if preference is None:
        # Full AP's default is the median similarity over all client pairs; distinct
        # candidates are more spread out than the clients, so estimate it from the clients.
        preference = population_median_similarity(hist, seed=seed)
    exemplar_of = affinity_propagation(
        cosine_similarity(candidates), damping=damping, preference=preference, seed=seed,
        weights=weights)
    centroids = candidates[np.unique(exemplar_of)]
    labels = nearest_rows(hist, centroids)
    # Drop exemplars no client chose, keeping labels dense.
    used, labels = np.unique(labels, return_inverse=True)
    return Communities(labels.astype(np.int64), centroids[used], method, len(candidates))
