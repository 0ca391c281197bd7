"""Datasets as plain numpy arrays: scikit-learn's bundled `digits` and user files
(`npz:PATH`, `imagefolder:PATH`, `csv:PATH`, `parquet:PATH`; see docs/job.md).

Imports only numpy (`digits` is read from scikit-learn's data file, sklearn is not imported),
so the scheduler can use it without pulling torch or ray. Loaded datasets are cached per
process and their arrays are read-only, because every client of a job shares the same copy.
"""

from __future__ import annotations

import gzip
import importlib.util
import logging
import os
import threading
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from . import sources
from .errors import DatasetError

__all__ = ["Dataset", "DatasetError", "clear_cache", "load_dataset", "stratified_split"]

log = logging.getLogger(__name__)

DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0
NPZ_ARRAYS = ("x_train", "y_train", "x_test", "y_test")
BUILTIN_DATASETS = ("digits",)
FILE_KINDS = ("npz", "imagefolder", "csv", "parquet")
# single-file tables and image trees without train/ and test/ are split like digits
FILE_TEST_FRACTION = 0.2
FILE_SPLIT_SEED = 0


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
    """Return the dataset called `name`: "digits" or "KIND:PATH[#options]" with KIND one of
    npz, imagefolder, csv, parquet (cached per process).

    Raises `DatasetError` naming the dataset, file or array that is wrong.
    """
    key = _cache_key(name)
    with _cache_lock:
        cached = _cache.get(key)
    if cached is not None:
        return cached
    if name == "digits":
        dataset = _load_digits()
    else:  # _cache_key already rejected anything else
        dataset = _load_file(name)
    with _cache_lock:
        _cache.setdefault(key, dataset)
        dataset = _cache[key]
    log.info(
        "event=dataset_loaded name=%s train=%d test=%d classes=%d shape=%s",
        name, len(dataset.y_train), len(dataset.y_test), dataset.num_classes,
        "x".join(map(str, dataset.input_shape)),
    )
    return dataset


#: data.standardize = "auto": data whose mean or sd (a table's per feature, an image's per
#: channel) lies beyond this is standardized. Raw data fails with every optimizer default,
#: centralized and federated: sklearn's wine table (proline up to 1,680; 20 clients, beta
#: 0.3) sat at its largest class (0.389) centralized, in the reference FedAvg loop and in
#: every job, standardized 0.972 in all of them; iris (sepal lengths around 5.8) 0.667 in
#: the reference loop and star FedAvg (centralized 0.967), standardized 0.933 in all three;
#: MNIST saved as bytes (0-255), SmallCNN: chance everywhere, clients' training to NaN.
#: Data a user already scaled (standardized, or into [0, 1]) stays as it is.
UNIT_SCALE = 1.5


def _groups(dataset: Dataset) -> tuple[int, ...]:
    """The axes a statistic is taken over: a table's rows (one per feature), an image's
    rows and pixels (one per channel: (channels, H, W) samples), else everything."""
    ndim = len(dataset.input_shape)
    return (0,) if ndim == 1 else (0, 2, 3) if ndim == 3 else tuple(range(ndim + 1))


def _statistic_shape(dataset: Dataset) -> list[int]:
    """The shape of one statistic per group (`_groups`), broadcast over the samples."""
    axes = _groups(dataset)
    return [1 if a in axes else n for a, n in enumerate((0, *dataset.input_shape))]


def scaling(dataset: Dataset, data: object) -> dict[str, Any]:
    """What `prepare` does to `dataset` under data spec `data`: {"standardize": the
    setting, "applied": whether it standardizes, "groups": the features or channels a
    mean and sd are taken over, "largest": the largest of their means' and sds' sizes};
    "mean" and "sd" (one per group) where applied."""
    how = str(getattr(data, "standardize", "auto"))
    out: dict[str, Any] = {"standardize": how, "applied": False, "groups": 0,
                           "largest": 0.0}
    if how == "none" or not len(dataset.y_train):
        return out
    own = moments(dataset)
    out.update(groups=len(own["mean"]),
               largest=_largest(np.asarray(own["mean"]), np.sqrt(own["var"])))
    if getattr(data, "placement", "simulated") == "pinned":
        return out  # the statistics every site shares come with the plan (shared_scaling)
    found = shared_scaling({"here": own}, how)  # one site: its own mean and sd
    if found is not None:
        out.update(applied=True, mean=found[0], sd=found[1])
    return out


def _largest(mean: np.ndarray, sd: np.ndarray) -> float:
    """The largest of the means' and sds' sizes (off a unit scale above UNIT_SCALE)."""
    return float(np.max(np.maximum(np.abs(mean), sd)))


def moments(dataset: Dataset) -> dict[str, Any]:
    """A pinned site's training samples as `shared_scaling` combines them: their count,
    and per feature or channel their mean and variance."""
    axes = _groups(dataset)
    x = dataset.x_train
    if not len(x):
        groups = int(np.prod(_statistic_shape(dataset)))
        return {"count": 0, "mean": [0.0] * groups, "var": [0.0] * groups}
    return {"count": int(len(x)),
            "mean": [float(v) for v in x.mean(axis=axes, dtype=np.float64).ravel()],
            "var": [float(v) for v in x.var(axis=axes, dtype=np.float64).ravel()]}


def shared_scaling(sites: Mapping[str, Any], how: str
                   ) -> tuple[list[float], list[float]] | None:
    """The mean and sd (per feature or channel) every site of a pinned job standardizes
    its samples by, from each site's `moments` (keyed by site); None where data.standardize
    is "none", or "auto" and they lie on a unit scale (UNIT_SCALE). Per feature, the median
    of the sites' means, and the root of the median of each site's second moment about it
    (its variance plus its mean's distance squared): the spread between sites counts, as
    the union's variance does, and one site of three or more that lies cannot move either
    beyond the honest sites' own values. ValueError naming the site whose moments are not
    a count and two equal-length lists of finite numbers (variances >= 0)."""
    if how == "none":
        return None
    means, seconds = [], []
    size: int | None = None
    for site, m in sorted(sites.items()):
        try:
            count = m["count"]
            mean = np.asarray(m["mean"], dtype=np.float64)
            var = np.asarray(m["var"], dtype=np.float64)
            ok = (isinstance(count, int) and not isinstance(count, bool) and count >= 0
                  and mean.ndim == var.ndim == 1 and len(mean) == len(var) > 0
                  and bool(np.isfinite(mean).all() and np.isfinite(var).all())
                  and bool((var >= 0).all()) and size in (None, len(mean)))
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            many = "" if size is None else f" ({size} of them, as the other sites sent)"
            raise ValueError(f"site {site}: data moments must be a count and per-feature "
                             f"'mean' and 'var' lists of finite numbers{many}, variances >= 0")
        size = len(mean)
        if count:
            means.append(mean)
            seconds.append(var)
    if not means:
        return None
    shared = np.median(np.stack(means), axis=0)
    spread = np.stack([v + (m - shared) ** 2 for m, v in zip(means, seconds, strict=True)])
    sd = np.sqrt(np.median(spread, axis=0))
    if how == "auto" and _largest(shared, sd) <= UNIT_SCALE:
        return None
    return [float(v) for v in shared], [float(v) if v > 0 else 1.0 for v in sd]


def standardized(dataset: Dataset, mean: Sequence[float], sd: Sequence[float]) -> Dataset:
    """`dataset` standardized by the given mean and sd per feature or channel (a pinned
    job's shared ones). DatasetError if their count is not the data's."""
    shape = _statistic_shape(dataset)
    groups = int(np.prod(shape))
    if len(mean) != groups or len(sd) != groups:
        raise DatasetError(f"dataset {dataset.name}: {len(mean)} shared means and {len(sd)} "
                           f"sds for data of {groups} features or channels")
    m = np.asarray(mean, dtype=np.float64).reshape(shape)
    d = np.asarray(sd, dtype=np.float64).reshape(shape)

    def scaled(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(((x - m) / d).astype(np.float32))

    return replace(dataset, x_train=scaled(dataset.x_train), x_test=scaled(dataset.x_test))


def prepare(dataset: Dataset, data: object) -> Dataset:
    """`dataset` as a job with data spec `data` trains on it: standardized by the training
    samples' mean and sd (a table's per feature, an image's per channel; a constant one
    only shifted), train and test alike, under data.standardize = "features", and under
    "auto" when they lie off a unit scale (UNIT_SCALE), in a simulated job. A pinned job's
    sites each hold their own samples, whose statistics differ where their labels do:
    they standardize by statistics they share, which come with the plan
    (`shared_scaling`, `standardized`). Else as it is (`scaling` says which)."""
    plan = scaling(dataset, data)
    if not plan["applied"]:
        return dataset
    log.info("event=features_standardized dataset=%s groups=%d largest=%.4g",
             dataset.name, plan["groups"], plan["largest"])
    return standardized(dataset, plan["mean"], plan["sd"])


def clear_cache() -> None:
    """Forget every cached dataset (tests use this after rewriting an npz file)."""
    with _cache_lock:
        _cache.clear()


def _cache_key(name: str) -> object:
    if name in BUILTIN_DATASETS:
        return name
    kind, sep, rest = name.partition(":")
    if sep and kind in FILE_KINDS:
        path_text, options = sources.split_options(name, kind, rest)
        path = os.path.abspath(os.path.expanduser(path_text))
        try:
            st = os.stat(path)
            if kind == "imagefolder":
                # Adding or removing images changes their folders' mtimes (contents
                # rewritten in place are not noticed: use a new folder for new data).
                return (kind, path, tuple(sorted(options.items())), _tree_mtimes(path))
        except OSError as exc:
            what = "folder" if kind == "imagefolder" else "file"
            raise DatasetError(
                f"dataset {name!r}: cannot read {what} {path}: {exc.strerror}; "
                f"give an existing {_KIND_HELP[kind]}"
            ) from None
        # A rewritten file gets a new key, so edits between jobs are picked up.
        return (kind, path, tuple(sorted(options.items())), st.st_mtime_ns, st.st_size)
    raise DatasetError(
        f"unknown dataset {name!r}; use one of {', '.join(BUILTIN_DATASETS)} "
        "or 'npz:PATH' (an .npz file with x_train, y_train, x_test, y_test), "
        "'imagefolder:PATH', 'csv:PATH' or 'parquet:PATH'"
    )


_KIND_HELP = {
    "npz": ".npz with x_train, y_train, x_test, y_test",
    "imagefolder": "folder with one subfolder of images per class",
    "csv": "CSV file with a header row and a label column",
    "parquet": "Parquet file with a label column",
}


def _tree_mtimes(root: str) -> tuple[tuple[str, int], ...]:
    out = [(root, os.stat(root).st_mtime_ns)]
    for top in (root, os.path.join(root, "train"), os.path.join(root, "test")):
        if os.path.isdir(top):
            with os.scandir(top) as entries:
                out += [(e.path, e.stat().st_mtime_ns) for e in entries if e.is_dir()]
    return tuple(sorted(out))


def _load_file(name: str) -> Dataset:
    kind, _, rest = name.partition(":")
    path_text, options = sources.split_options(name, kind, rest)
    path = os.path.abspath(os.path.expanduser(path_text))
    names = sources.class_names(name, options)  # #classes=NAME,...; else a count, or none
    declared = sources.int_option(name, options, "classes") if names is None else None
    if names is not None and kind not in ("csv", "parquet"):
        raise DatasetError(f"dataset {name!r}: #classes lists names, which only a csv: or "
                           f"parquet: label column of names takes; {kind}: takes #classes=C")
    if kind == "npz":
        return _load_npz(path, name, declared)
    if kind == "imagefolder":
        train_dir, test_dir = sources.image_tree(path)
        classes = sources.class_folders(train_dir)
        size = sources.parse_size(name, options.get("size"))
        x, y, mode = sources.read_images(train_dir, classes, size, None)
        if test_dir is not None:
            x_test, y_test, _ = sources.read_images(test_dir, classes, size or _wh(x), mode)
            if x_test.shape[1:] != x.shape[1:]:
                raise DatasetError(f"dataset folder {path}: test images have shape "
                                   f"{x_test.shape[1:]}, training images {x.shape[1:]}")
            return _finish(path, "folder", x, y, x_test, y_test, name, len(classes),
                           label_name="class folder")
        return _split_and_finish(path, "folder", x, y, name, len(classes), "class folder")
    label = options.get("label", sources.DEFAULT_LABEL_COLUMN)
    x, y = sources.read_table(path, kind, label, names)
    return _split_and_finish(path, "file", x, y, name,
                             len(names) if names is not None else declared, f"column {label!r}")


def _wh(x: np.ndarray) -> tuple[int, int]:
    return int(x.shape[3]), int(x.shape[2])


def _split_and_finish(path: str, what: str, x: np.ndarray, y: np.ndarray, name: str,
                      declared: int | None, label_name: str) -> Dataset:
    if y.size and y.min() < 0:
        raise DatasetError(f"dataset {what} {path}: {label_name} has negative label {int(y.min())}; "
                           "labels must be class ids 0..C-1")
    train_idx, test_idx = stratified_split(y, FILE_TEST_FRACTION, FILE_SPLIT_SEED)
    if len(test_idx) == 0 or len(train_idx) == 0:
        raise DatasetError(f"dataset {what} {path}: {len(y)} samples are too few to split "
                           f"{FILE_TEST_FRACTION:.0%} off for testing; add samples")
    return _finish(path, what, x[train_idx], y[train_idx], x[test_idx], y[test_idx], name,
                   declared, label_name=label_name)


def _finish(path: str, what: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray,
            y_test: np.ndarray, name: str, declared: int | None, label_name: str) -> Dataset:
    """Check the labels against the class count and freeze the arrays into a Dataset.

    With a declared count C every label must be in 0..C-1. Without one, C is the largest
    label + 1 and every class 0..C-1 must occur: a stray label (255 among 0..9) would
    otherwise silently make a 256-class model.
    """
    where = f"dataset {what} {path}"
    top = int(max(y_train.max(), y_test.max()))
    if declared is not None:
        if top >= declared:
            split = "y_train" if y_train.max() == top else "y_test"
            raise DatasetError(f"{where}: {label_name} has label {top} (in {split}) outside "
                               f"0..{declared - 1} for {declared} classes; fix the label or the "
                               "declared class count")
        num_classes = declared
    else:
        num_classes = top + 1
        seen = np.zeros(num_classes, dtype=bool)
        seen[y_train] = True
        seen[y_test] = True
        missing = np.flatnonzero(~seen)
        if len(missing):
            shown = ", ".join(map(str, missing[:5])) + (" ..." if len(missing) > 5 else "")
            count = int((y_train == top).sum() + (y_test == top).sum())
            raise DatasetError(
                f"{where}: {label_name} has label {top} ({count} sample(s)), which makes "
                f"{num_classes} classes, but {len(missing)} of them never occur ({shown}); labels "
                "must be class ids 0..C-1: relabel, or declare the class count "
                "(#classes=C; in an npz a num_classes array)")
    x_train = np.ascontiguousarray(x_train, dtype=np.float32)
    x_test = np.ascontiguousarray(x_test, dtype=np.float32)
    y_train = np.ascontiguousarray(y_train, dtype=np.int64)
    y_test = np.ascontiguousarray(y_test, dtype=np.int64)
    _readonly(x_train, y_train, x_test, y_test)
    return Dataset(
        x_train, y_train, x_test, y_test,
        num_classes=num_classes, input_shape=tuple(int(d) for d in x_train.shape[1:]), name=name,
    )


def _readonly(*arrays: np.ndarray) -> None:
    for a in arrays:
        a.flags.writeable = False


def _load_digits() -> Dataset:
    # scikit-learn's copy, read as its load_digits reads it but without importing sklearn
    # (~2 s of CPU in every executor and pre-start check that loads digits)
    sklearn = importlib.util.find_spec("sklearn")
    assert sklearn is not None and sklearn.origin is not None  # a dependency of the project
    with gzip.open(Path(sklearn.origin).parent / "datasets/data/digits.csv.gz", "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    x = (data[:, :-1].astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = data[:, -1].astype(np.int64)
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


def _load_npz(path: str, name: str, declared: int | None) -> Dataset:
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
            if declared is None and "num_classes" in npz.files:
                declared = _declared_classes(_read_array(npz, "num_classes", path), path)
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
    return _finish(path, "file", raw["x_train"], raw["y_train"].astype(np.int64), raw["x_test"],
                   raw["y_test"].astype(np.int64), name, declared, label_name="y_train/y_test")


def _declared_classes(value: np.ndarray, path: str) -> int:
    if value.shape != () or not np.issubdtype(value.dtype, np.integer) or int(value) < 1:
        raise DatasetError(f"dataset file {path}: array num_classes must be one positive integer "
                           f"(np.savez(..., num_classes=10)), got shape {value.shape} dtype {value.dtype}")
    return int(value)


def _read_array(npz: np.lib.npyio.NpzFile, key: str, path: str) -> np.ndarray:
    try:
        return np.asarray(npz[key])
    except ValueError as exc:  # object arrays need pickle, which we refuse
        raise DatasetError(
            f"dataset file {path}: array {key} cannot be loaded without pickle ({exc}); "
            "store plain numeric arrays"
        ) from None
