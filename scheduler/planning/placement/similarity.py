"""Stage 2: cosine similarity between label histograms (and the helpers the scale path uses)."""

from __future__ import annotations

import numpy as np


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
