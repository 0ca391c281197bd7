"""Per-site `.npz` files for pinned-data jobs: digits samples with a different label skew
on every site (most samples from the site's own three classes), all declaring 10 classes."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def site_classes(site: int) -> list[int]:
    return [(3 * site + j) % 10 for j in range(3)]


def write_site_npz(path: Path, site: int, *, train: int = 150, test: int = 40,
                   own_share: float = 0.85, scale: float = 1 / 16) -> np.ndarray:
    """Write site `site`'s file (pixels 0-16 times `scale`: [0, 1] by default); returns its
    y_train (what only this site holds)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (np.asarray(bunch.data, dtype=np.float32) * scale).reshape(-1, 1, 8, 8)
    y = np.asarray(bunch.target, dtype=np.int64)
    rng = np.random.default_rng(100 + site)
    own = np.isin(y, site_classes(site))
    picks = []
    for size in (train, test):
        k = int(round(own_share * size))
        picks.append(np.concatenate([rng.choice(np.flatnonzero(own), k, replace=False),
                                     rng.choice(np.flatnonzero(~own), size - k, replace=False)]))
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, x_train=x[picks[0]], y_train=y[picks[0]], x_test=x[picks[1]],
             y_test=y[picks[1]], num_classes=np.int64(10))
    return y[picks[0]]
