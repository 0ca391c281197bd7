"""Split a training set among federated clients: iid, dirichlet, labels, shards, quantity.

Pure numpy and vectorized over clients, so planning 100,000 clients is quick. Every
function is deterministic for a given seed, and every training sample goes to at most one
client. Impossible requests (more clients than samples, more labels per client than classes,
...) raise `PartitionError` saying what was asked and what to change.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from fedcore.data.errors import DatasetError

if TYPE_CHECKING:  # proto.job is only needed for type hints; keep imports numpy-only
    from proto.job import DataSpec

    from .datasets import Dataset

log = logging.getLogger(__name__)

DISTRIBUTIONS = ("iid", "dirichlet", "labels", "shards", "quantity")
# dirichlet and quantity: every client holds at least this many samples (lowered to
# n // (2 * clients), at least 1, for small datasets). dirichlet resamples like NIID-Bench
# while that is cheap (at most MAX_DIRICHLET_ATTEMPTS draws, fewer for huge problems) and
# then tops up the remaining small clients from the largest ones, so it never loops forever.
MIN_SAMPLES_PER_CLIENT = 10
MAX_DIRICHLET_ATTEMPTS = 1000
DIRICHLET_WORK_BUDGET = 10_000_000  # ~ (clients x classes + samples) x attempts
# A job partitions the same labels in every cluster's runtime, in placement and in the
# bench's scoring; a Dirichlet draw with resampling takes up to ~2 s (digits, 50 clients,
# beta 0.1), so the last few draws are kept (read-only index arrays, keyed by the labels'
# digest and every argument that changes the draw).
PARTITION_CACHE_SIZE = 8
_cache: OrderedDict[tuple[object, ...], tuple[np.ndarray, ...]] = OrderedDict()
_cache_lock = threading.Lock()


class PartitionError(DatasetError):
    """A partition request is impossible or malformed; the message says what to change."""


@dataclass(frozen=True, eq=False)
class ClientPartition:
    """Per-client data of one job: index arrays into the dataset's training set.

    `train_indices[i]` and `test_indices[i]` are disjoint parts of client i's partition
    (`test_indices` is the client's own split for personalized accuracy). `histograms[i]`
    counts the labels of `train_indices[i]`; `test_histograms[i]` those of `test_indices[i]`.
    """

    train_indices: list[np.ndarray]
    test_indices: list[np.ndarray]
    histograms: np.ndarray
    test_histograms: np.ndarray

    @property
    def num_clients(self) -> int:
        return len(self.train_indices)


def partition(y: np.ndarray, num_clients: int, spec: DataSpec, seed: int) -> list[np.ndarray]:
    """Split the indices of labels `y` among `num_clients` clients as `spec` says.

    Returns one sorted, read-only int64 index array per client; no index appears twice;
    every client gets at least one sample. Deterministic for `seed` (the same arguments
    give the same arrays, from a small cache).
    """
    y = _check_labels(y)
    n = len(y)
    kind = spec.data_distribution_kind
    if kind not in DISTRIBUTIONS:
        raise PartitionError(
            f"data_distribution_kind {kind!r} is unknown; use one of {', '.join(DISTRIBUTIONS)}"
        )
    if isinstance(num_clients, bool) or not isinstance(num_clients, int | np.integer) \
            or num_clients < 1:
        raise PartitionError(f"number_of_clients must be a positive integer, got {num_clients!r}")
    num_clients = int(num_clients)
    if num_clients > n:
        raise PartitionError(
            f"{kind} partition: {num_clients} clients but only {n} training samples; "
            "every client needs at least one sample, so use at most "
            f"{n} clients or a larger dataset"
        )
    key = (hashlib.blake2b(y.tobytes(), digest_size=16).hexdigest(), y.dtype.str, n,
           num_clients, kind, spec.dirichlet_beta, spec.labels_per_client,
           spec.shards_per_client, spec.quantity_beta, seed, MAX_DIRICHLET_ATTEMPTS,
           DIRICHLET_WORK_BUDGET, MIN_SAMPLES_PER_CLIENT)
    return _cached(key, lambda: _draw(y, num_clients, spec, kind, seed))


def _draw(y: np.ndarray, num_clients: int, spec: DataSpec, kind: str,
          seed: int) -> list[np.ndarray]:
    n = len(y)
    rng = np.random.default_rng(seed)
    if kind == "iid":
        owner = _iid(n, num_clients, rng)
    elif kind == "dirichlet":
        owner = _dirichlet(y, num_clients, float(spec.dirichlet_beta), rng)
    elif kind == "labels":
        owner = _labels(y, num_clients, int(spec.labels_per_client), rng)
    elif kind == "shards":
        owner = _shards(y, num_clients, int(spec.shards_per_client), rng)
    else:
        owner = _quantity(n, num_clients, float(spec.quantity_beta), rng)
    parts = _group(owner, num_clients)
    log.debug("event=partitioned kind=%s clients=%d samples=%d seed=%d", kind, num_clients, n, seed)
    return parts


def _cached(key: tuple[object, ...], draw: Callable[[], list[np.ndarray]]) -> list[np.ndarray]:
    # One lock over lookup and draw: the clusters' runtimes start together and would
    # otherwise all miss and draw the same split at once (a draw holds the GIL anyway).
    with _cache_lock:
        hit = _cache.get(key)
        if hit is None:
            parts = draw()
            for part in parts:
                part.setflags(write=False)
            hit = _cache[key] = tuple(parts)
            while len(_cache) > PARTITION_CACHE_SIZE:
                _cache.popitem(last=False)
        _cache.move_to_end(key)
        return list(hit)


def label_histograms(
    y: np.ndarray, parts: Sequence[np.ndarray], num_classes: int
) -> np.ndarray:
    """Return an int64 array [len(parts), num_classes]: row i counts the labels y[parts[i]]."""
    y = np.asarray(y)
    lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
    if lengths.sum() == 0:
        return np.zeros((len(parts), num_classes), dtype=np.int64)
    idx = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    labels = y[idx].astype(np.int64)
    if labels.min() < 0 or labels.max() >= num_classes:
        raise PartitionError(
            f"label_histograms: labels must lie in [0, {num_classes}), found "
            f"{int(labels.min())}..{int(labels.max())}"
        )
    client = np.repeat(np.arange(len(parts), dtype=np.int64), lengths)
    flat = np.bincount(client * num_classes + labels, minlength=len(parts) * num_classes)
    return flat.reshape(len(parts), num_classes).astype(np.int64)


def client_data(dataset: Dataset, spec: DataSpec, seed: int) -> ClientPartition:
    """Partition `dataset.y_train` among `spec.number_of_clients` clients and split each
    client's share into its own train and test parts (`spec.client_test_fraction`).

    A client with at least two samples keeps at least one for training; the test part
    rounds `fraction * size` to the nearest integer. Deterministic for `seed`.
    """
    fraction = float(spec.client_test_fraction)
    if not 0.0 <= fraction < 1.0:
        raise PartitionError(
            f"client_test_fraction must be in [0, 1), got {spec.client_test_fraction!r}"
        )
    parts = partition(dataset.y_train, spec.number_of_clients, spec, seed)
    train, test = _split_parts(parts, fraction, np.random.default_rng([seed, 1]))
    return ClientPartition(
        train_indices=train,
        test_indices=test,
        histograms=label_histograms(dataset.y_train, train, dataset.num_classes),
        test_histograms=label_histograms(dataset.y_train, test, dataset.num_classes),
    )


def pinned_data(dataset: Dataset, spec: DataSpec, seed: int, clients: Sequence[int]
                ) -> ClientPartition:
    """A cluster's share of a pinned job (data.placement = "pinned"): its own `dataset`
    partitioned among `clients` only (global client ids, in order) as `spec` says, in a
    partition of all `spec.number_of_clients` clients whose other entries are empty.

    The clients of other clusters are built by those clusters from their own files; here
    they hold no sample, so nothing of this cluster's data can train them."""
    n = int(spec.number_of_clients)
    ids = [int(c) for c in clients]
    if not ids:
        raise PartitionError("a pinned partition needs at least one client of this cluster")
    bad = [c for c in ids if not 0 <= c < n]
    if bad or len(set(ids)) != len(ids):
        raise PartitionError(f"pinned clients must be distinct ids in 0..{n - 1}, got {ids[:8]}")
    local = client_data(dataset, replace(spec, number_of_clients=len(ids)), seed)
    empty = np.zeros(0, dtype=np.int64)
    train = [empty] * n
    test = [empty] * n
    hist = np.zeros((n, dataset.num_classes), dtype=np.int64)
    test_hist = np.zeros((n, dataset.num_classes), dtype=np.int64)
    for j, c in enumerate(ids):
        train[c], test[c] = local.train_indices[j], local.test_indices[j]
        hist[c], test_hist[c] = local.histograms[j], local.test_histograms[j]
    return ClientPartition(train_indices=train, test_indices=test, histograms=hist,
                           test_histograms=test_hist)


# ---------------------------------------------------------------------------------------
# Each strategy returns `owner`: an int64 array, owner[j] = client of sample j, or -1 when
# sample j is left unused.


def _check_labels(y: np.ndarray) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1:
        raise PartitionError(f"labels must be a 1-D array, got shape {y.shape}")
    if len(y) == 0:
        raise PartitionError("cannot partition an empty training set")
    if not np.issubdtype(y.dtype, np.integer):
        raise PartitionError(f"labels must be integer class ids, got dtype {y.dtype}")
    if y.min() < 0:
        raise PartitionError(f"labels must be non-negative class ids, found {int(y.min())}")
    return y.astype(np.int64, copy=False)


def _iid(n: int, num_clients: int, rng: np.random.Generator) -> np.ndarray:
    owner = np.empty(n, dtype=np.int64)
    # Sizes differ by at most one; which samples go where is random.
    owner[rng.permutation(n)] = np.arange(n, dtype=np.int64) * num_clients // n
    return owner


def _min_samples(n: int, num_clients: int) -> int:
    return max(1, min(MIN_SAMPLES_PER_CLIENT, n // (2 * num_clients)))


def _dirichlet(
    y: np.ndarray, num_clients: int, beta: float, rng: np.random.Generator
) -> np.ndarray:
    if not beta > 0 or not np.isfinite(beta):
        raise PartitionError(f"dirichlet_beta must be a positive number, got {beta!r}")
    n = len(y)
    minimum = _min_samples(n, num_clients)
    num_classes = int(y.max()) + 1
    by_class = [np.flatnonzero(y == k) for k in range(num_classes)]
    cap = n / num_clients
    # Resample like NIID-Bench while it is cheap; for huge client counts, where a draw
    # with no small client is vanishingly rare, repair the best draw instead of looping.
    attempts = int(np.clip(DIRICHLET_WORK_BUDGET // (num_clients * num_classes + n),
                           3, MAX_DIRICHLET_ATTEMPTS))
    best: tuple[int, np.ndarray, np.ndarray] | None = None
    for attempt in range(1, attempts + 1):
        owner = np.empty(n, dtype=np.int64)
        sizes = np.zeros(num_clients, dtype=np.int64)
        for idx in by_class:
            if len(idx) == 0:
                continue
            idx = rng.permutation(idx)
            p = rng.dirichlet(np.full(num_clients, beta))
            # NIID-Bench's balancing: a client already above the mean size takes no more.
            p = p * (sizes < cap)
            total = p.sum()
            p = p / total if total > 0 else np.full(num_clients, 1.0 / num_clients)
            bounds = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
            who = np.searchsorted(bounds, np.arange(len(idx)), side="right")
            owner[idx] = who
            sizes += np.bincount(who, minlength=num_clients)
        deficit = int(np.maximum(minimum - sizes, 0).sum())
        if deficit == 0:
            if attempt > 1:
                log.debug("event=dirichlet_resampled attempts=%d beta=%s", attempt, beta)
            return owner
        if best is None or deficit < best[0]:
            best = (deficit, owner, sizes)
    assert best is not None
    log.debug("event=dirichlet_repaired attempts=%d moved=%d beta=%s", attempts, best[0], beta)
    return _top_up(best[1], best[2], minimum, rng)


def _top_up(
    owner: np.ndarray, sizes: np.ndarray, minimum: int, rng: np.random.Generator
) -> np.ndarray:
    """Move random samples from clients above `minimum` to clients below it.

    Feasible because `minimum * num_clients <= n`; no donor drops below `minimum`.
    """
    num_clients = len(sizes)
    deficits = np.maximum(minimum - sizes, 0)
    receivers = np.repeat(np.arange(num_clients, dtype=np.int64), deficits)
    # A sample may be given away if it ranks (in a random order) past its owner's minimum.
    order = np.argsort(owner + 0.5 * rng.random(len(owner)))  # by owner, random within
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    rank = np.arange(len(owner)) - np.repeat(starts, sizes)
    spare = order[rank >= np.repeat(np.full(num_clients, minimum), sizes)]
    donated = rng.choice(spare, size=len(receivers), replace=False)
    owner = owner.copy()
    owner[donated] = rng.permutation(receivers)
    return owner


def _labels(
    y: np.ndarray, num_clients: int, per_client: int, rng: np.random.Generator
) -> np.ndarray:
    present = np.flatnonzero(np.bincount(y))
    num_classes = len(present)
    if not 1 <= per_client <= num_classes:
        raise PartitionError(
            f"labels partition: labels_per_client={per_client} but the training set has "
            f"{num_classes} classes; use a value from 1 to {num_classes}"
        )
    # Client i always holds class i mod C (so every class is used when there are at least C
    # clients) plus per_client-1 other distinct classes drawn at random.
    keys = rng.random((num_clients, num_classes))
    keys[np.arange(num_clients), np.arange(num_clients) % num_classes] = -1.0
    chosen = np.argsort(keys, axis=1)[:, :per_client]
    holds = np.zeros((num_clients, num_classes), dtype=bool)
    holds[np.arange(num_clients)[:, None], chosen] = True
    owner = np.full(len(y), -1, dtype=np.int64)
    for col, label in enumerate(present):
        holders = np.flatnonzero(holds[:, col])
        if len(holders) == 0:
            continue
        idx = rng.permutation(np.flatnonzero(y == label))
        # Each holder of this class gets an equal share (sizes differ by at most one).
        owner[idx] = holders[np.arange(len(idx)) * len(holders) // len(idx)]
    _require_nonempty(owner, num_clients, "labels", "fewer clients or more labels_per_client")
    return owner


def _shards(
    y: np.ndarray, num_clients: int, per_client: int, rng: np.random.Generator
) -> np.ndarray:
    if per_client < 1:
        raise PartitionError(f"shards_per_client must be at least 1, got {per_client}")
    n = len(y)
    num_shards = num_clients * per_client
    if num_shards > n:
        raise PartitionError(
            f"shards partition: {num_clients} clients x {per_client} shards = {num_shards} "
            f"shards but only {n} training samples; use fewer clients or shards_per_client"
        )
    # Sort by label (random order within a label), cut into equal shards, deal shards out.
    order = rng.permutation(n)
    order = order[np.argsort(y[order], kind="stable")]
    shard_of_position = np.arange(n, dtype=np.int64) * num_shards // n
    client_of_shard = rng.permutation(num_shards) // per_client
    owner = np.empty(n, dtype=np.int64)
    owner[order] = client_of_shard[shard_of_position]
    return owner


def _quantity(n: int, num_clients: int, beta: float, rng: np.random.Generator) -> np.ndarray:
    if not beta > 0 or not np.isfinite(beta):
        raise PartitionError(f"quantity_beta must be a positive number, got {beta!r}")
    minimum = _min_samples(n, num_clients)
    # Every client first gets `minimum` samples; the rest is split by Dirichlet shares
    # (largest remainders), so no resampling is needed even for 100,000 clients.
    spare = n - minimum * num_clients
    shares = rng.dirichlet(np.full(num_clients, beta)) * spare
    extra = np.floor(shares).astype(np.int64)
    leftover = spare - int(extra.sum())
    if leftover > 0:
        extra[np.argsort(extra - shares, kind="stable")[:leftover]] += 1
    sizes = extra + minimum
    owner = np.empty(n, dtype=np.int64)
    owner[rng.permutation(n)] = np.repeat(np.arange(num_clients, dtype=np.int64), sizes)
    return owner


def _require_nonempty(owner: np.ndarray, num_clients: int, kind: str, advice: str) -> None:
    used = owner[owner >= 0]
    sizes = np.bincount(used, minlength=num_clients)
    empty = np.flatnonzero(sizes == 0)
    if len(empty):
        raise PartitionError(
            f"{kind} partition: {len(empty)} of {num_clients} clients got no samples "
            f"(first: client {int(empty[0])}); use {advice}"
        )


def _group(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Turn owner-per-sample into one sorted index array per client."""
    used = np.flatnonzero(owner >= 0)
    clients = owner[used]
    order = np.argsort(clients, kind="stable")  # stable: indices stay sorted within a client
    return _split_by_counts(used[order], np.bincount(clients, minlength=num_clients))


def _split_by_counts(flat: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    """Consecutive slices of `flat` with the given lengths (much faster than np.split
    for 100,000 pieces)."""
    bounds = np.concatenate(([0], np.cumsum(counts))).tolist()
    return [flat[bounds[i] : bounds[i + 1]] for i in range(len(counts))]


def _split_parts(
    parts: list[np.ndarray], fraction: float, rng: np.random.Generator
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
    idx = np.concatenate(parts)
    client = np.repeat(np.arange(len(parts), dtype=np.int64), lengths)
    n_test = np.minimum(np.floor(lengths * fraction + 0.5).astype(np.int64),
                        np.maximum(lengths - 1, 0))
    # A random order within each client (client id + a key in [0, 0.5) sorts by client
    # first); its first n_test[client] entries become the test split.
    order = np.argsort(client + 0.5 * rng.random(len(idx)))
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    rank = np.empty(len(idx), dtype=np.int64)
    rank[order] = np.arange(len(idx)) - np.repeat(starts, lengths)
    is_test = rank < np.repeat(n_test, lengths)
    # Masking keeps each client's indices sorted and the clients contiguous.
    return (_split_by_counts(idx[~is_test], lengths - n_test),
            _split_by_counts(idx[is_test], n_test))
