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
re-plan never moves a pinned client. The clients of a lost cluster (`on_cluster_loss =
"continue"`) sit out: the plan lists them, as `absent`, on a survivor where they never
train and weigh nothing (`fixed_assignment`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from scheduler.errors import CapacityError, JobFailed

if TYPE_CHECKING:
    from scheduler.planning.plan import Plan

log = logging.getLogger("fedpilot.scheduler")


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
                     capacities: Sequence[int]) -> tuple[list[int], list[int]]:
    """(cluster index of every pinned client among `cluster_ids`, the clients that sit
    out). A client whose cluster is not among them (lost, with `on_cluster_loss =
    "continue"`) cannot move: it sits out, listed on the first cluster as a placeholder
    that never trains, holds no data and weighs nothing. PinnedClientsLost if no client is
    left; CapacityError if a cluster cannot hold its own clients."""
    index = {cid: k for k, cid in enumerate(cluster_ids)}
    out = [index.get(cid, 0) for cid in pinned]
    absent = [i for i, cid in enumerate(pinned) if cid not in index]
    if len(absent) == len(pinned):
        raise PinnedClientsLost(
            f"every pinned client's data is on clusters that are gone "
            f"({', '.join(sorted(set(pinned)))}; data.placement = 'pinned'): no client is "
            f"left to train on {', '.join(cluster_ids) or 'no cluster'}; resume the job with "
            "`submit --resume RUN_DIR` once they are back")
    gone = set(absent)
    for k, (cid, cap) in enumerate(zip(cluster_ids, capacities, strict=True)):
        load = sum(1 for i, c in enumerate(out) if c == k and i not in gone)
        if load > cap:
            raise CapacityError(f"cluster {cid} holds the data of {load} pinned clients but its "
                                f"capacity is {cap}; raise [cluster] capacity in its cluster.toml "
                                "or lower data.number_of_clients")
    return out, absent


def pinned_plan_extra(plan: Plan, client_samples: Sequence[int],
                      pooled_labels: Sequence[int] = ()) -> dict[str, Any]:
    """What a pinned job's `job.plan` carries besides the matrix: every client's training
    samples as its own cluster reported them (another cluster cannot count them; they
    weigh its updates), zero for clients that sit out, those clients (`absent`), and the
    clients' label counts summed (`pooled_labels`, the label mix the model learns)."""
    absent = list(plan.placement.absent)
    samples = [int(k) for k in client_samples]
    for i in absent:
        samples[i] = 0
    if absent:
        log.warning("event=pinned_clients_sit_out job=%s epoch=%d clients=%s", plan.spec.job_id,
                    plan.routing.epoch, ",".join(f"c{i}" for i in absent))
    return {"client_samples": samples, "absent": absent,
            **({"pooled_labels": [int(k) for k in pooled_labels]} if len(pooled_labels) else {})}
