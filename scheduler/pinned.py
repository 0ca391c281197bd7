"""Pinned data (`data.placement = "pinned"`): clients live where their data is.

Each cluster declares the files it holds in its `cluster.toml` (`[datasets] NAME =
"KIND:PATH"`); a pinned job names one of them. The scheduler numbers the clients globally
and gives each cluster a contiguous block of them (`data.number_of_clients` shared evenly,
in cluster-id order); each cluster partitions ITS OWN file among ITS
clients and reports their label histograms. No sample or file leaves a cluster.

Placement then has nothing to decide about where a client goes: the assignment is fixed
(`plan_placement(..., pinned=...)`). The histograms still shape the routing matrix: the
data communities it records, the similarity neighbours of `k_connected` (mode
`similarity`), and where each aggregator sits (with most of the clients it serves). A
re-plan never moves a pinned client; a cluster that is lost takes its clients with it
(see `PinnedClientsLost`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .errors import CapacityError, JobFailed


class PinnedClientsLost(CapacityError):
    """Pinned clients whose cluster is gone: their data cannot be rebuilt anywhere else."""


def pinned_holders(num_clients: int, cluster_ids: Sequence[str]) -> dict[str, list[int]]:
    """Global client ids per cluster: contiguous blocks in cluster-id order (the same
    whatever order the mesh lists them in, e.g. on resume), sizes differing by at most
    one (the first clusters take the remainder)."""
    cluster_ids = sorted(cluster_ids)
    if not cluster_ids:
        raise JobFailed("a pinned job needs at least one cluster")
    k = len(cluster_ids)
    if num_clients < k:
        raise JobFailed(f"data.number_of_clients = {num_clients} is fewer than the {k} clusters "
                        "of a pinned job; every cluster that holds data needs at least one client")
    base, extra = divmod(num_clients, k)
    out: dict[str, list[int]] = {}
    start = 0
    for i, cid in enumerate(cluster_ids):
        size = base + (1 if i < extra else 0)
        out[cid] = list(range(start, start + size))
        start += size
    return out


def client_clusters(holders: Mapping[str, Sequence[int]]) -> list[str]:
    """The cluster of every client (index = global client id)."""
    n = sum(len(v) for v in holders.values())
    out = [""] * n
    for cid, clients in holders.items():
        for c in clients:
            out[int(c)] = cid
    return out


def check_pinned_data(replies: Mapping[str, Mapping[str, Any]], dataset: str) -> None:
    """Every cluster's own file must give the same classes and sample shape (they train
    one model); JobFailed naming each cluster's figures otherwise."""
    seen: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for cid, reply in sorted(replies.items()):
        info = reply.get("data")
        if not isinstance(info, Mapping):
            raise JobFailed(f"cluster {cid} did not say what its dataset {dataset!r} holds "
                            "(an executor without pinned-data support?)")
        key = (int(info.get("num_classes", 0)), tuple(int(d) for d in info.get("input_shape", ())))
        seen.setdefault(key, []).append(cid)
    if len(seen) > 1:
        parts = "; ".join(f"{', '.join(cids)}: {c} classes, samples of shape {list(shape)}"
                          for (c, shape), cids in sorted(seen.items(), key=lambda kv: kv[1]))
        raise JobFailed(
            f"the clusters' files for pinned dataset {dataset!r} disagree ({parts}); they train "
            "one model, so every file needs the same sample shape and class count (declare it: "
            "a num_classes array in an npz, or #classes=C)")


def fixed_assignment(pinned: Sequence[str], cluster_ids: Sequence[str],
                     capacities: Sequence[int]) -> list[int]:
    """Cluster index of every pinned client among `cluster_ids`; PinnedClientsLost if a
    client's cluster is not among them, CapacityError if a cluster cannot hold its own."""
    index = {cid: k for k, cid in enumerate(cluster_ids)}
    gone: dict[str, int] = {}
    for cid in pinned:
        if cid not in index:
            gone[cid] = gone.get(cid, 0) + 1
    if gone:
        what = ", ".join(f"{cid} ({count} client{'s' if count != 1 else ''})"
                         for cid, count in sorted(gone.items()))
        raise PinnedClientsLost(
            f"pinned clients cannot move: their data lives on {what}, which is not among the "
            f"clusters {', '.join(cluster_ids)} (data.placement = 'pinned'); the job stops "
            "rather than go on without that data: resume it with `submit --resume RUN_DIR` "
            "once the cluster is back")
    out = [index[cid] for cid in pinned]
    for k, (cid, cap) in enumerate(zip(cluster_ids, capacities, strict=True)):
        load = out.count(k)
        if load > cap:
            raise CapacityError(f"cluster {cid} holds the data of {load} pinned clients but its "
                                f"capacity is {cap}; raise [cluster] capacity in its cluster.toml "
                                "or lower data.number_of_clients")
    return out
