"""Datasets: digits and npz loading, caching, clear errors; the import stays numpy-only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedcore.data import Dataset, DatasetError, clear_cache, load_dataset
from fedcore.data.datasets import DIGITS_SPLIT_SEED, DIGITS_TEST_FRACTION, stratified_split


def test_data_imports_pull_neither_torch_nor_ray() -> None:
    code = (
        "import sys\n"
        "import worker, fedcore.data, fedcore.data.partition, fedcore.data.datasets\n"
        "fedcore.data.load_dataset('digits')\n"
        "heavy = sorted(m for m in ('torch', 'ray', 'sklearn', 'libp2p') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_digits_shape_range_and_stratified_split() -> None:
    d = load_dataset("digits")
    assert isinstance(d, Dataset)
    assert d.input_shape == (1, 8, 8) and d.num_classes == 10
    assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int64
    assert d.x_train.shape[1:] == (1, 8, 8)
    assert len(d.y_train) + len(d.y_test) == 1797
    assert abs(len(d.y_test) - 0.2 * 1797) <= 10
    assert 0.0 <= d.x_train.min() and d.x_train.max() == 1.0
    # stratified: every class is about 20 % test
    test_share = np.bincount(d.y_test) / (np.bincount(d.y_test) + np.bincount(d.y_train))
    assert np.all(np.abs(test_share - 0.2) < 0.02)
    # scikit-learn's load_digits, split the same way (digits is read from its data file)
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    train, test = stratified_split(y, DIGITS_TEST_FRACTION, DIGITS_SPLIT_SEED)
    np.testing.assert_array_equal(d.x_train, (x[train] / 16.0).astype(np.float32).reshape(-1, 1, 8, 8))
    np.testing.assert_array_equal(d.x_test, (x[test] / 16.0).astype(np.float32).reshape(-1, 1, 8, 8))
    np.testing.assert_array_equal(d.y_train, y[train])
    np.testing.assert_array_equal(d.y_test, y[test])


def test_digits_is_cached_deterministic_and_read_only() -> None:
    a = load_dataset("digits")
    assert load_dataset("digits") is a
    clear_cache()
    b = load_dataset("digits")
    assert b is not a
    np.testing.assert_array_equal(a.y_train, b.y_train)
    np.testing.assert_array_equal(a.x_test, b.x_test)
    with pytest.raises(ValueError):
        b.x_train[0, 0, 0, 0] = 5.0


def _save(path: Path, **arrays: np.ndarray) -> str:
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return f"npz:{path}"


def _good(n_train: int = 20, n_test: int = 6) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x_train": rng.random((n_train, 4)),
        "y_train": rng.integers(0, 3, n_train),
        "x_test": rng.random((n_test, 4)),
        "y_test": np.arange(n_test) % 4,
    }


def test_npz_loads_and_infers_classes(tmp_path: Path) -> None:
    name = _save(tmp_path / "ok.npz", **_good())
    d = load_dataset(name)
    assert d.input_shape == (4,) and d.num_classes == 4
    assert d.x_train.dtype == np.float32 and d.y_test.dtype == np.int64
    assert len(d.y_train) == 20 and len(d.y_test) == 6


def test_npz_rewritten_file_is_reloaded(tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    name = _save(path, **_good(20))
    assert len(load_dataset(name).y_train) == 20
    _save(path, **_good(30))
    assert len(load_dataset(name).y_train) == 30


def test_npz_missing_array_names_file_and_array(tmp_path: Path) -> None:
    arrays = _good()
    del arrays["y_test"]
    name = _save(tmp_path / "missing.npz", **arrays)
    with pytest.raises(DatasetError, match=r"missing\.npz.*y_test"):
        load_dataset(name)


def test_npz_length_mismatch_names_arrays(tmp_path: Path) -> None:
    arrays = _good()
    arrays["y_train"] = arrays["y_train"][:-1]
    name = _save(tmp_path / "short.npz", **arrays)
    with pytest.raises(DatasetError, match=r"short\.npz.*x_train has 20.*y_train has 19"):
        load_dataset(name)


def test_npz_float_labels_rejected(tmp_path: Path) -> None:
    arrays = _good()
    arrays["y_test"] = arrays["y_test"].astype(np.float32)
    name = _save(tmp_path / "flt.npz", **arrays)
    with pytest.raises(DatasetError, match=r"flt\.npz.*y_test.*float32"):
        load_dataset(name)


def test_npz_object_arrays_are_never_unpickled(tmp_path: Path) -> None:
    arrays: dict[str, np.ndarray] = dict(_good())
    arrays["x_train"] = np.array([{"a": 1}] * 20, dtype=object)
    name = _save(tmp_path / "obj.npz", **arrays)
    with pytest.raises(DatasetError, match=r"obj\.npz.*x_train.*pickle"):
        load_dataset(name)


def test_npz_feature_shape_mismatch(tmp_path: Path) -> None:
    arrays = _good()
    arrays["x_test"] = np.zeros((6, 5))
    name = _save(tmp_path / "shape.npz", **arrays)
    with pytest.raises(DatasetError, match="x_test"):
        load_dataset(name)


def test_unknown_dataset_and_missing_file() -> None:
    with pytest.raises(DatasetError, match="unknown dataset 'mnist'.*digits.*npz:PATH"):
        load_dataset("mnist")
    with pytest.raises(DatasetError, match="nope.npz"):
        load_dataset("npz:/definitely/not/here/nope.npz")
