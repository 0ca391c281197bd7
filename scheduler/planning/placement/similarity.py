"""Stage 2: cosine similarity between label histograms (and the helpers the scale path uses)."""

from __future__ import annotations

import numpy as np
from threadpoolctl import threadpool_limits  # scikit-learn's own dependency


def unit_rows(histograms: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (float32); an all-zero row stays zero."""
    h = np.asarray(histograms, dtype=np.float32)
    norms = np.linalg.norm(h, axis=1, keepdims=True)
    return h / np.where(norms > 0, norms, 1.0)


def cosine_similarity(histograms: np.ndarray) -> np.ndarray:
    """Dense `[n, n]` cosine similarity in [0, 1] for non-negative histograms; O(n²) memory,
    so callers use it only up to a few thousand rows."""
    u = unit_rows(histograms)
    return np.clip(u @ u.T, 0.0, 1.0)


def quantise(histograms: np.ndarray, levels: int) -> np.ndarray:
    """Label proportions rounded to multiples of 1/levels (int16 codes). Clients whose
    proportions agree to that resolution get identical rows."""
    h = np.asarray(histograms, dtype=np.float64)
    totals = h.sum(axis=1, keepdims=True)
    p = h / np.where(totals > 0, totals, 1.0)
    return np.rint(p * levels).astype(np.int16)


def nearest_rows(queries: np.ndarray, targets: np.ndarray, *, batch: int = 65536) -> np.ndarray:
    """For each query row, the index of the most cosine-similar target row (ties → lowest
    index). Memory is bounded by `batch * len(targets)`."""
    q = unit_rows(queries)
    t = unit_rows(targets)
    out = np.empty(len(q), dtype=np.int64)
    for start in range(0, len(q), batch):
        out[start:start + batch] = np.argmax(q[start:start + batch] @ t.T, axis=1)
    return out


# A target left out by `nearest_rows_grouped` is at least this much farther (in radians)
# from every query of the group than a kept one: far above float32 rounding of a cosine.
ANGLE_MARGIN = 1e-2


def nearest_rows_grouped(queries: np.ndarray, group: np.ndarray, targets: np.ndarray, *,
                         batch: int = 65536) -> np.ndarray:
    """`nearest_rows(queries, targets)` for queries that come in groups of similar rows
    (`group[i]` in 0..k-1, any grouping is correct; tight ones are fast). Each group
    compares its rows only with the targets that the angle triangle inequality leaves
    possible: within the group's radius r of its mean direction, a target more than 2r
    farther from that direction than the nearest target cannot win."""
    q = unit_rows(queries)
    t = unit_rows(targets)
    if len(q) == 0 or not t.any(axis=1).all():
        return nearest_rows(queries, targets)  # a zero target has no direction to bound
    k = int(group.max()) + 1
    live = q.any(axis=1)  # an all-zero query ties every target at 0: index 0, as nearest_rows
    sums = np.stack([np.bincount(group, weights=q[:, c], minlength=k)
                     for c in range(q.shape[1])], axis=1)
    direction = _unit64(sums)
    radius = np.zeros(k)
    np.maximum.at(radius, group[live],
                  _angle(np.einsum("ij,ij->i", _unit64(q[live]), direction[group[live]])))
    to_target = _angle(direction @ _unit64(t).T)
    allowed = to_target <= (to_target.min(axis=1, keepdims=True) + 2.0 * radius[:, None]
                            + ANGLE_MARGIN)
    order = np.argsort(group, kind="stable")
    bounds = np.searchsorted(group[order], np.arange(k + 1))
    out = np.empty(len(q), dtype=np.int64)
    # Hundreds of small products: BLAS threads only add start-up and, on a busy machine,
    # spinning (at 1M clients on 2 shared cores: 0.4-0.6 s of CPU with one thread, 1.7-2.3
    # s with the default).
    with threadpool_limits(limits=1, user_api="blas"):
        for g in range(k):
            cols = np.flatnonzero(allowed[g])
            kept = t[cols].T
            for start in range(bounds[g], bounds[g + 1], batch):
                rows = order[start:min(start + batch, bounds[g + 1])]
                out[rows] = cols[np.argmax(q[rows] @ kept, axis=1)]
    out[~live] = 0
    return out


def _unit64(rows: np.ndarray) -> np.ndarray:
    r = np.asarray(rows, dtype=np.float64)
    norms = np.linalg.norm(r, axis=-1, keepdims=True)
    return r / np.where(norms > 0, norms, 1.0)


def _angle(cosine: np.ndarray) -> np.ndarray:
    """Angle from the float64 cosine of unit rows, through the chord (arccos near 1 would
    lose half the digits)."""
    chord = np.sqrt(np.maximum(2.0 - 2.0 * cosine, 0.0))
    return 2.0 * np.arcsin(np.minimum(chord / 2.0, 1.0))
