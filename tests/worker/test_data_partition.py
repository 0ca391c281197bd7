"""Partitioners: disjoint, deterministic, the promised skew, clear errors; client splits."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fedcore.data.partition as partition_module
from fedcore.data import PartitionError, client_data, label_histograms, load_dataset
from fedcore.data.partition import DISTRIBUTIONS, partition
from proto.job import DataSpec

Y = np.repeat(np.arange(10), 100)  # 1,000 samples, 10 balanced classes


def _spec(kind: str, **kw: object) -> DataSpec:
    return replace(DataSpec(), data_distribution_kind=kind, **kw)  # type: ignore[arg-type]


def _check_disjoint(parts: list[np.ndarray], n: int, num_clients: int) -> np.ndarray:
    assert len(parts) == num_clients
    assert all(len(p) > 0 for p in parts)
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat), "a sample went to two clients"
    assert flat.min() >= 0 and flat.max() < n
    assert all(np.all(np.diff(p) > 0) for p in parts)
    return flat


@pytest.mark.parametrize("kind", DISTRIBUTIONS)
def test_every_kind_is_disjoint_and_deterministic(kind: str) -> None:
    spec = _spec(kind)
    a = partition(Y, 20, spec, seed=3)
    _check_disjoint(a, len(Y), 20)
    b = partition(Y, 20, spec, seed=3)
    assert all(np.array_equal(x, z) for x, z in zip(a, b, strict=True))
    c = partition(Y, 20, spec, seed=4)
    assert not all(np.array_equal(x, z) for x, z in zip(a, c, strict=True))


def test_the_same_request_is_drawn_once_and_its_arrays_are_read_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    draws: list[int] = []
    real = partition_module._draw

    def counting(*args: object) -> list[np.ndarray]:
        draws.append(1)
        time.sleep(0.05)  # a slow draw, so that callers at once overlap
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(partition_module, "_draw", counting)
    y = np.repeat(np.arange(10), 57)  # labels no other test partitions
    spec = _spec("dirichlet", dirichlet_beta=0.2)
    a = partition(y, 13, spec, seed=5)
    b = partition(y, 13, spec, seed=5)
    assert len(draws) == 1 and a is not b
    assert all(np.array_equal(x, z) for x, z in zip(a, b, strict=True))
    with pytest.raises(ValueError, match="read-only"):
        a[0][0] = 1
    other = y.copy()
    other[:2] = other[:2][::-1] + 1  # other labels, same size: drawn again
    partition(other, 13, spec, seed=5)
    partition(y, 13, replace(spec, dirichlet_beta=0.3), seed=5)
    assert len(draws) == 3
    # the clusters' runtimes ask at once: still one draw
    with ThreadPoolExecutor(4) as pool:
        splits = list(pool.map(lambda _: partition(y, 17, spec, seed=5), range(4)))
    assert len(draws) == 4
    assert all(np.array_equal(x, z) for s in splits for x, z in zip(s, splits[0], strict=True))


def test_iid_uses_all_samples_with_equal_sizes() -> None:
    parts = partition(Y, 7, _spec("iid"), seed=0)
    flat = _check_disjoint(parts, len(Y), 7)
    assert len(flat) == len(Y)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


def _mean_top_label_share(parts: list[np.ndarray]) -> float:
    h = label_histograms(Y, parts, 10)
    return float((h.max(axis=1) / h.sum(axis=1)).mean())


def test_dirichlet_minimum_size_and_smaller_beta_means_more_skew() -> None:
    skews = []
    for beta in (0.1, 1.0, 100.0):
        parts = partition(Y, 30, _spec("dirichlet", dirichlet_beta=beta), seed=1)
        flat = _check_disjoint(parts, len(Y), 30)
        assert len(flat) == len(Y)
        assert min(len(p) for p in parts) >= 10
        skews.append(_mean_top_label_share(parts))
    assert skews[0] > skews[1] > skews[2]
    assert skews[0] > 0.5 and skews[2] < 0.3


def test_dirichlet_repairs_small_clients_when_resampling_gives_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(partition_module, "MAX_DIRICHLET_ATTEMPTS", 3)
    y = np.repeat(np.arange(10), 300)
    parts = partition(y, 150, _spec("dirichlet", dirichlet_beta=0.05), seed=0)
    _check_disjoint(parts, len(y), 150)
    assert min(len(p) for p in parts) == 10  # 3000 // (2 * 150) = 10


def test_labels_gives_each_client_exactly_k_labels() -> None:
    for k in (1, 2, 5):
        parts = partition(Y, 20, _spec("labels", labels_per_client=k), seed=2)
        _check_disjoint(parts, len(Y), 20)
        h = label_histograms(Y, parts, 10)
        assert np.all((h > 0).sum(axis=1) == k)


def test_shards_have_equal_sizes_and_few_labels() -> None:
    parts = partition(Y, 25, _spec("shards", shards_per_client=2), seed=0)
    flat = _check_disjoint(parts, len(Y), 25)
    assert len(flat) == len(Y)
    assert {len(p) for p in parts} == {40}  # 50 shards of 20 samples
    h = label_histograms(Y, parts, 10)
    # a shard of 20 sorted samples never spans a class of 100, so <= 2 labels per client
    assert np.all((h > 0).sum(axis=1) <= 2)


def test_quantity_skews_sizes_but_not_labels() -> None:
    parts = partition(Y, 20, _spec("quantity", quantity_beta=0.3), seed=0)
    flat = _check_disjoint(parts, len(Y), 20)
    assert len(flat) == len(Y)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 10 and sizes.max() > 3 * sizes.min()
    big = parts[int(sizes.argmax())]
    assert (np.bincount(Y[big], minlength=10) > 0).all()


@pytest.mark.parametrize(
    ("num_clients", "spec", "pattern"),
    [
        (1001, _spec("iid"), "1001 clients but only 1000 training samples"),
        (5, _spec("labels", labels_per_client=11), "labels_per_client=11.*10 classes"),
        (5, _spec("labels", labels_per_client=0), "labels_per_client=0"),
        (600, _spec("shards", shards_per_client=2), "1200 shards but only 1000"),
        (5, _spec("dirichlet", dirichlet_beta=0.0), "dirichlet_beta must be a positive"),
        (5, _spec("quantity", quantity_beta=-1.0), "quantity_beta must be a positive"),
        (5, _spec("pathological"), "'pathological' is unknown; use one of iid, dirichlet"),
        (0, _spec("iid"), "number_of_clients must be a positive integer"),
    ],
)
def test_impossible_requests_fail_clearly(num_clients: int, spec: DataSpec, pattern: str) -> None:
    with pytest.raises(PartitionError, match=pattern):
        partition(Y, num_clients, spec, seed=0)


def test_labels_with_too_many_clients_for_a_class_fails_clearly() -> None:
    y = np.array([0] * 3 + [1] * 100)
    with pytest.raises(PartitionError, match="got no samples"):
        partition(y, 10, _spec("labels", labels_per_client=1), seed=0)


def test_bad_label_arrays_fail_clearly() -> None:
    with pytest.raises(PartitionError, match="integer"):
        partition(np.array([0.5, 1.0]), 1, _spec("iid"), seed=0)
    with pytest.raises(PartitionError, match="1-D"):
        partition(np.zeros((2, 2), dtype=int), 1, _spec("iid"), seed=0)


def test_label_histograms_by_hand() -> None:
    y = np.array([0, 1, 1, 2, 2, 2])
    h = label_histograms(y, [np.array([0, 1]), np.array([2, 3, 4, 5]), np.array([], dtype=int)], 4)
    np.testing.assert_array_equal(h, [[1, 1, 0, 0], [0, 1, 3, 0], [0, 0, 0, 0]])
    with pytest.raises(PartitionError, match=r"\[0, 2\)"):
        label_histograms(y, [np.array([5])], 2)


def test_client_data_splits_each_client_and_counts_labels() -> None:
    d = load_dataset("digits")
    spec = replace(DataSpec(), number_of_clients=30, dirichlet_beta=0.5, client_test_fraction=0.25)
    cp = client_data(d, spec, seed=7)
    assert cp.num_clients == 30
    parts = partition(d.y_train, 30, spec, seed=7)
    for part, tr, te in zip(parts, cp.train_indices, cp.test_indices, strict=True):
        assert len(np.intersect1d(tr, te)) == 0
        np.testing.assert_array_equal(np.sort(np.concatenate([tr, te])), part)
        assert len(te) == int(np.floor(len(part) * 0.25 + 0.5))
    np.testing.assert_array_equal(cp.histograms, label_histograms(d.y_train, cp.train_indices, 10))
    np.testing.assert_array_equal(
        cp.test_histograms, label_histograms(d.y_train, cp.test_indices, 10)
    )
    again = client_data(d, spec, seed=7)
    assert all(np.array_equal(a, b) for a, b in zip(cp.test_indices, again.test_indices, strict=True))


def test_client_data_keeps_a_training_sample_and_rejects_bad_fraction() -> None:
    d = load_dataset("digits")
    spec = replace(DataSpec(), data_distribution_kind="iid", number_of_clients=1438,
                   client_test_fraction=0.9)
    cp = client_data(d, spec, seed=0)
    assert all(len(t) == 1 for t in cp.train_indices)
    with pytest.raises(PartitionError, match="client_test_fraction"):
        client_data(d, replace(spec, client_test_fraction=1.0), seed=0)


@settings(max_examples=80, deadline=None)
@given(
    labels=st.lists(st.integers(0, 6), min_size=1, max_size=200),
    num_clients=st.integers(1, 40),
    kind=st.sampled_from(DISTRIBUTIONS),
    per_client=st.integers(1, 4),
    beta=st.floats(0.01, 10.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_request_either_fails_clearly_or_partitions_validly(
    labels: list[int], num_clients: int, kind: str, per_client: int, beta: float, seed: int
) -> None:
    y = np.array(labels)
    spec = _spec(kind, labels_per_client=per_client, shards_per_client=per_client,
                 dirichlet_beta=beta, quantity_beta=beta)
    try:
        parts = partition(y, num_clients, spec, seed=seed)
    except PartitionError:
        return
    _check_disjoint(parts, len(y), num_clients)


def test_pinned_data_partitions_only_this_clusters_clients() -> None:
    from fedcore.data import load_dataset, pinned_data
    from proto.job import DataSpec

    dataset = load_dataset("digits")
    spec = DataSpec(number_of_clients=9, data_distribution_kind="iid", dataset="site",
                    placement="pinned")
    part = pinned_data(dataset, spec, 0, [3, 4, 5])
    assert part.num_clients == 9
    mine = [3, 4, 5]
    # every training sample of this file goes to one of this cluster's clients
    assert sum(len(part.train_indices[c]) + len(part.test_indices[c]) for c in mine) == \
        len(dataset.y_train)
    assert all(len(part.train_indices[c]) == 0 and part.histograms[c].sum() == 0
               for c in range(9) if c not in mine)
    with pytest.raises(PartitionError, match="distinct ids in 0..8"):
        pinned_data(dataset, spec, 0, [3, 3])
    with pytest.raises(PartitionError, match="distinct ids in 0..8"):
        pinned_data(dataset, spec, 0, [9])
