"""Stage 3: Affinity Propagation finds the data communities without a preset count.

Up to `max_candidates` clients, AP runs on the full cosine-similarity matrix. Above that
(AP is O(n²) in time and memory), clients are put in at most `max_candidates` groups (the
distinct label proportions at 1/QUANTISE_LEVELS resolution, or a count-weighted sample of
them that every other distinct proportion joins by similarity), and AP runs on the groups:
group j choosing group k as exemplar is worth the summed similarity of all j's clients to
k's representative (its most central client), computed exactly from summed unit vectors,
with the preference estimated from client pairs. Every client then joins its most similar
exemplar, and, as sklearn's AP ends, each community re-elects its most central client and
the clients join the nearest again.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import numpy as np

from scheduler.planning.placement.similarity import (
    cosine_similarity,
    nearest_rows,
    nearest_rows_grouped,
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
    similarity: np.ndarray, *, damping: float, preference: float | np.ndarray | None,
    seed: int,
) -> np.ndarray:
    """Exemplar index of every row of a precomputed similarity matrix (sklearn AP,
    deterministic for `seed`); `preference` is one value, one per row, or None for the
    median similarity. If AP does not converge (sklearn then still returns the exemplars
    of its last, oscillating iteration: on crisp populations, 141 of them where the
    converged answer has 10) it retries with heavier damping; if that does not converge
    either, its last exemplars are kept, and if it has none, all rows join the row with
    the highest total similarity."""
    n = similarity.shape[0]
    if n == 1:
        return np.zeros(1, dtype=np.int64)
    # imported here: every scheduler process would pay sklearn's ~2 s import (status, a
    # submit or plan refused before it plans)
    from sklearn.cluster import AffinityPropagation
    from sklearn.exceptions import ConvergenceWarning

    s = np.asarray(similarity, dtype=np.float64)
    pref = float(np.median(s)) if preference is None else preference
    attempts = ((damping, 200), (max(damping, 0.9), 1000))
    for attempt, (d, iters) in enumerate(attempts):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConvergenceWarning)
            # Identical histograms are a legitimate input: one community is the answer.
            warnings.filterwarnings("ignore", message="All samples have mutually equal")
            ap = AffinityPropagation(
                affinity="precomputed", damping=d, preference=pref, max_iter=iters,
                random_state=seed,
            ).fit(s)
        converged = not any(issubclass(w.category, ConvergenceWarning) for w in caught)
        centers = ap.cluster_centers_indices_
        found = centers is not None and len(centers) > 0 and bool((ap.labels_ >= 0).all())
        last = attempt == len(attempts) - 1
        if found and (converged or last):
            return np.asarray(centers, dtype=np.int64)[ap.labels_]
        log.warning("event=ap_not_converged n=%d damping=%.2f iterations=%d", n, d, iters)
    return np.full(n, int(np.argmax(s.sum(axis=1))), dtype=np.int64)


def distinct_rows(codes: np.ndarray, base: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct rows of small non-negative integer codes (< base), their counts and each
    input row's index among them, in lexicographic order. Packs rows into one int64 when
    they fit (a 1-D sort is ~10x faster than `np.unique(axis=0)` at 100k rows)."""
    width = codes.shape[1]
    if width * np.log2(base) >= 62:
        rows, inverse, counts = np.unique(codes, axis=0, return_inverse=True,
                                          return_counts=True)
        return rows, counts, inverse.reshape(-1)
    weights = base ** np.arange(width - 1, -1, -1, dtype=np.int64)
    packed = codes.astype(np.int64) @ weights
    order = np.argsort(packed)  # any order among equal keys: only the grouping matters
    keys = packed[order]
    first = np.concatenate(([True], keys[1:] != keys[:-1]))
    starts = np.flatnonzero(first)
    counts = np.diff(np.append(starts, len(keys)))
    inverse = np.empty(len(keys), dtype=np.int64)
    inverse[order] = np.cumsum(first) - 1
    uniq = keys[starts]
    rows = (uniq[:, None] // weights[None, :]) % base
    return rows.astype(codes.dtype), counts, inverse


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
    distinct, counts, row_of = distinct_rows(codes, QUANTISE_LEVELS + 1)
    method = "distinct"
    group_of_row = np.arange(len(distinct))
    if len(distinct) > max_candidates:
        rng = np.random.default_rng(seed)
        pick = np.sort(rng.choice(len(distinct), size=max_candidates, replace=False,
                                  p=counts / counts.sum()))
        group_of_row = nearest_rows(distinct, distinct[pick])
        method = "sampled"
    unit = unit_rows(hist)
    group = np.unique(group_of_row[row_of], return_inverse=True)[1].reshape(-1)
    if preference is None:
        # Full AP's default is the median similarity over all client pairs.
        preference = population_median_similarity(hist, seed=seed)
    representative, sums = _most_central(unit, group)
    similarity = sums @ unit[representative].T.astype(np.float64)
    # A group that is its own exemplar: its representative earns the preference, its
    # other clients their similarity to the representative.
    self_preference = preference + np.diag(similarity) - 1.0
    exemplar_of = affinity_propagation(similarity, damping=damping,
                                       preference=self_preference, seed=seed)
    # Each community re-elects its most central client among the clients AP gave it
    # (their groups'), as sklearn's AP ends; then every client joins the nearest exemplar.
    community = np.unique(exemplar_of, return_inverse=True)[1].reshape(-1)
    exemplars = _most_central(unit, community[group])[0]
    labels = _nearest_exemplar(hist, group, hist[exemplars])
    used, labels = np.unique(labels, return_inverse=True)
    return Communities(labels.reshape(-1).astype(np.int64), props[exemplars[used]], method,
                       len(representative))


def _nearest_exemplar(hist: np.ndarray, group: np.ndarray, exemplars: np.ndarray,
                      ) -> np.ndarray:
    """`nearest_rows(hist, exemplars)`: each client group checks only the exemplars an
    angle bound leaves possible (a third of them at 1M clients, same answer), once per
    distinct histogram when the counts pack into one int64 (clients with few samples
    repeat histograms often: 61% of a million 50-sample Dirichlet(0.1) histograms are
    distinct; equal histograms are in the same group, as groups are made of quantised
    proportions)."""
    if not np.issubdtype(hist.dtype, np.integer) or hist.min() < 0:
        return nearest_rows_grouped(hist, group, exemplars)
    base = int(hist.max()) + 1
    if hist.shape[1] * np.log2(base) >= 62:
        return nearest_rows_grouped(hist, group, exemplars)
    rows, _, row_of = distinct_rows(hist, base)
    group_of_row = np.empty(len(rows), dtype=np.int64)
    group_of_row[row_of] = group
    return nearest_rows_grouped(rows, group_of_row, exemplars)[row_of]


def _most_central(unit: np.ndarray, group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For groups 0..k-1 of unit rows (every group non-empty): the row of each group with
    the highest summed cosine similarity to its group (sklearn AP's exemplar re-election;
    ties to the lowest index), and each group's sum of unit rows. O(n·C): the summed
    similarity of row i to its group is `unit[i] · sum`."""
    k = int(group.max()) + 1
    sums = np.stack([np.bincount(group, weights=unit[:, c], minlength=k)
                     for c in range(unit.shape[1])], axis=1)
    direction = unit_rows(sums)
    cosine = np.einsum("ij,ij->i", unit, direction[group])
    # one sort key: the group, then the cosine to the group's direction, descending
    order = np.argsort(group + 0.5 * (1.0 - np.clip(cosine, 0.0, 1.0)), kind="stable")
    first = order[np.flatnonzero(np.diff(group[order], prepend=-1))]
    return first, sums
