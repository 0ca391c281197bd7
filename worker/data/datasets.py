"""Datasets as plain numpy arrays: scikit-learn's bundled `digits` and user `npz:PATH` files.

Imports only numpy at module level (scikit-learn lazily, for `digits`), so the scheduler can
use it without pulling torch or ray. Loaded datasets are cached per process and their arrays
are read-only, because every client of a job shares the same copy.
"""

from __future__ import annotations

import logging
import os
import threading
import zipfile
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0
NPZ_PREFIX = "npz:"
NPZ_ARRAYS = ("x_train", "y_train", "x_test", "y_test")
BUILTIN_DATASETS = ("digits",)


class DatasetError(ValueError):
    """A dataset name, file or array is not usable; the message says which and why."""


@dataclass(frozen=True, eq=False)
class Dataset:
    """Train and test arrays of one dataset.

    `x_*` are float32 with shape (n, *input_shape); `y_*` are int64 class ids in
    [0, num_classes).
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]
    name: str = ""


_cache: dict[object, Dataset] = {}
_cache_lock = threading.Lock()


def load_dataset(name: str) -> Dataset:
    """Return the dataset called `name`: "digits" or "npz:PATH" (cached per process).

    Raises `DatasetError` naming the dataset, file or array that is wrong.
    """
    key = _cache_key(name)
    with _cache_lock:
        cached = _cache.get(key)
    if cached is not None:
        return cached
    if name == "digits":
        dataset = _load_digits()
    elif name.startswith(NPZ_PREFIX):
        dataset = _load_npz(name[len(NPZ_PREFIX):], name)
    else:  # _cache_key already rejected anything else
        raise AssertionError(name)
    with _cache_lock:
        _cache.setdefault(key, dataset)
        dataset = _cache[key]
    log.info(
        "event=dataset_loaded name=%s train=%d test=%d classes=%d shape=%s",
        name, len(dataset.y_train), len(dataset.y_test), dataset.num_classes,
        "x".join(map(str, dataset.input_shape)),
    )
    return dataset


def clear_cache() -> None:
    """Forget every cached dataset (tests use this after rewriting an npz file)."""
    with _cache_lock:
        _cache.clear()


def _cache_key(name: str) -> object:
    if name in BUILTIN_DATASETS:
        return name
    if name.startswith(NPZ_PREFIX):
        path = os.path.abspath(os.path.expanduser(name[len(NPZ_PREFIX):]))
        try:
            st = os.stat(path)
        except OSError as exc:
            raise DatasetError(
                f"dataset {name!r}: cannot read file {path}: {exc.strerror}; "
                "give an existing .npz with x_train, y_train, x_test, y_test"
            ) from None
        # A rewritten file gets a new key, so edits between jobs are picked up.
        return ("npz", path, st.st_mtime_ns, st.st_size)
    raise DatasetError(
        f"unknown dataset {name!r}; use one of {', '.join(BUILTIN_DATASETS)} "
        "or 'npz:PATH' (an .npz file with x_train, y_train, x_test, y_test)"
    )


def _readonly(*arrays: np.ndarray) -> None:
    for a in arrays:
        a.flags.writeable = False


def _load_digits() -> Dataset:
    from sklearn.datasets import load_digits  # lazy: keeps `import worker.data` numpy-only

    bunch = load_digits()
    x = (np.asarray(bunch.data, dtype=np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = np.asarray(bunch.target, dtype=np.int64)
    train_idx, test_idx = stratified_split(y, DIGITS_TEST_FRACTION, DIGITS_SPLIT_SEED)
    arrays = (
        np.ascontiguousarray(x[train_idx]), y[train_idx],
        np.ascontiguousarray(x[test_idx]), y[test_idx],
    )
    _readonly(*arrays)
    return Dataset(*arrays, num_classes=10, input_shape=(1, 8, 8), name="digits")


def stratified_split(
    y: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Split indices of `y` into (train, test), each class contributing `test_fraction`.

    Deterministic for a given seed; both outputs are sorted.
    """
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    # Stable sort by label keeps the random order within each class.
    by_label = order[np.argsort(y[order], kind="stable")]
    labels, counts = np.unique(y[by_label], return_counts=True)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    n_test = np.floor(counts * test_fraction + 0.5).astype(np.int64)
    rank = np.arange(len(y)) - np.repeat(starts, counts)
    is_test = rank < np.repeat(n_test, counts)
    return np.sort(by_label[~is_test]), np.sort(by_label[is_test])


def _load_npz(path_text: str, name: str) -> Dataset:
    path = os.path.abspath(os.path.expanduser(path_text))
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [a for a in NPZ_ARRAYS if a not in npz.files]
            if missing:
                raise DatasetError(
                    f"dataset file {path}: missing array(s) {', '.join(missing)}; "
                    f"it has {', '.join(npz.files) or 'none'}; save it with "
                    "np.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)"
                )
            raw = {a: _read_array(npz, a, path) for a in NPZ_ARRAYS}
    except DatasetError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise DatasetError(f"dataset file {path}: not a readable .npz file ({exc})") from None

    for split in ("train", "test"):
        x, y = raw[f"x_{split}"], raw[f"y_{split}"]
        if x.ndim < 2:
            raise DatasetError(
                f"dataset file {path}: array x_{split} has shape {x.shape}; "
                "need (samples, features...) with at least 2 dimensions"
            )
        if y.ndim != 1:
            raise DatasetError(
                f"dataset file {path}: array y_{split} has shape {y.shape}; need a 1-D label vector"
            )
        if len(x) != len(y):
            raise DatasetError(
                f"dataset file {path}: x_{split} has {len(x)} samples but y_{split} has "
                f"{len(y)}; they must have the same length"
            )
        if len(y) == 0:
            raise DatasetError(f"dataset file {path}: array y_{split} is empty")
        if not np.issubdtype(y.dtype, np.integer):
            raise DatasetError(
                f"dataset file {path}: array y_{split} has dtype {y.dtype}; labels must be "
                "integer class ids (0..C-1)"
            )
        if y.min() < 0:
            raise DatasetError(
                f"dataset file {path}: array y_{split} has negative label {int(y.min())}; "
                "labels must be class ids 0..C-1"
            )
        if not np.issubdtype(x.dtype, np.number) or np.issubdtype(x.dtype, np.complexfloating):
            raise DatasetError(
                f"dataset file {path}: array x_{split} has dtype {x.dtype}; need real numbers"
            )
    if raw["x_train"].shape[1:] != raw["x_test"].shape[1:]:
        raise DatasetError(
            f"dataset file {path}: x_train samples have shape {raw['x_train'].shape[1:]} but "
            f"x_test samples have {raw['x_test'].shape[1:]}; they must match"
        )
    x_train = np.ascontiguousarray(raw["x_train"], dtype=np.float32)
    x_test = np.ascontiguousarray(raw["x_test"], dtype=np.float32)
    y_train = raw["y_train"].astype(np.int64)
    y_test = raw["y_test"].astype(np.int64)
    num_classes = int(max(y_train.max(), y_test.max())) + 1
    _readonly(x_train, y_train, x_test, y_test)
    return Dataset(
        x_train, y_train, x_test, y_test,
        num_classes=num_classes, input_shape=tuple(int(d) for d in x_train.shape[1:]), name=name,
    )


def _read_array(npz: np.lib.npyio.NpzFile, key: str, path: str) -> np.ndarray:
    try:
        return np.asarray(npz[key])
    except ValueError as exc:  # object arrays need pickle, which we refuse
        raise DatasetError(
            f"dataset file {path}: array {key} cannot be loaded without pickle ({exc}); "
            "store plain numeric arrays"
        ) from None
