"""The placement pipeline end to end: histograms → similarity/AP communities → logical
topology → strategy (locality: Louvain + capacity mapping) → routing matrix.

`plan_job` is what `fedpilot-scheduler plan` runs; `plan_placement` is the part the round
driver calls with histograms the clusters reported. Pure computation: no torch, ray or
libp2p is imported.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from proto.job import DECENTRALIZED_TOPOLOGIES, JobSpec, fixed_mixing_steps
from proto.routing import RoutingMatrix
from scheduler.errors import AssignmentFileError, CapacityError, PlanError
from scheduler.planning.clusters import ClusterSlot, as_slots
from scheduler.planning.pinned import client_clusters, fixed_assignment, pinned_holders
from scheduler.planning.placement.communities import Communities, find_communities
from scheduler.planning.placement.histograms import job_histograms
from scheduler.planning.placement.mapping import (
    assign_communities,
    check_capacity,
    contiguous_assignment,
    cut_traffic,
    place_aggregators,
)
from scheduler.planning.placement.refine import refine_assignment
from scheduler.planning.placement.strategies import load_precomputed, random_assignment, round_robin
from scheduler.planning.topology import (
    LogicalTopology,
    build_topology,
    fit_traffic_budget,
    inter_transfers,
    star_transfers,
)

# Topologies whose client↔client edges exist before placement (hybrid's depend on it).
_PRE_PLACEMENT = ("ring", "k_connected", "full", "custom")


@dataclass(frozen=True)
class PlacementResult:
    """Where every client goes. `client_cluster[i]` is a cluster id, `cluster_index[i]` its
    index in `clusters`, `client_community[i]` the client's data community."""

    strategy: str
    clusters: tuple[str, ...]
    cluster_index: np.ndarray
    client_community: np.ndarray
    communities: int
    #: pinned data: clients that sit out (their cluster is gone); listed on a survivor
    absent: tuple[int, ...] = ()

    @property
    def client_cluster(self) -> list[str]:
        return [self.clusters[k] for k in self.cluster_index.tolist()]

    def clients_per_cluster(self) -> dict[str, int]:
        """Clients each cluster hosts (clients that sit out are nobody's)."""
        hosted = np.delete(self.cluster_index, list(self.absent))
        counts = np.bincount(hosted, minlength=len(self.clusters))
        return {c: int(x) for c, x in zip(self.clusters, counts, strict=True)}

    def to_dict(self) -> dict[str, Any]:
        """placement.json: client → cluster and client → community."""
        return {
            "strategy": self.strategy,
            "communities": self.communities,
            "clients_per_cluster": self.clients_per_cluster(),
            "client_cluster": {f"c{i}": c for i, c in enumerate(self.client_cluster)},
            "client_community": {f"c{i}": int(k)
                                 for i, k in enumerate(self.client_community.tolist())},
            **({"sitting_out": [f"c{i}" for i in self.absent]} if self.absent else {}),
        }


@dataclass
class Plan:
    """A full plan: placement, the logical topology, the routing matrix, stage timings."""

    spec: JobSpec
    placement: PlacementResult
    topology: LogicalTopology
    routing: RoutingMatrix
    stage_seconds: dict[str, float] = field(default_factory=dict)
    compare: dict[str, int] = field(default_factory=dict)

    def inter_transfers(self) -> int:
        """Model transfers between clusters in one round with every client taking part."""
        t = self.topology
        if t.kind in DECENTRALIZED_TOPOLOGIES:
            return inter_transfers(t.edges, self.placement.cluster_index, max(1, t.mixing_steps),
                                   grouped=not self.spec.transfer.per_edge)
        return 2 * self.routing.edge_counts()[1]

    def summary(self) -> dict[str, Any]:
        intra, inter = self.routing.edge_counts()
        out: dict[str, Any] = {
            "job_id": self.spec.job_id,
            "strategy": self.placement.strategy,
            "topology": self.topology.kind,
            "clients": self.topology.num_clients,
            "nodes": self.topology.num_nodes,
            "communities": self.placement.communities,
            "clients_per_cluster": self.placement.clients_per_cluster(),
            "edges": {"intra": intra, "inter": inter},
            "mixing_steps": self.routing.mixing_steps,
            # model transfers between clusters per round (x the model's bytes), and star's
            # on the same placement, for comparison
            "inter_cluster_transfers_per_round": self.inter_transfers(),
            "star_inter_cluster_transfers_per_round": star_transfers(
                self.placement.cluster_index),
            "stage_seconds": {k: round(v, 4) for k, v in self.stage_seconds.items()},
        }
        if self.compare:
            out["compare"] = {"inter_edges": dict(self.compare)}
        return out


def plan_placement(
    spec: JobSpec,
    histograms: np.ndarray,
    clusters: Sequence[ClusterSlot] | Mapping[str, int],
    *,
    seed: int | None = None,
    strategy: str | None = None,
    communities: Communities | None = None,
    topology: LogicalTopology | None = None,
    pinned: Sequence[str] | None = None,
    overflow: bool = False,
) -> PlacementResult:
    """Place every client on a cluster by `strategy` (default: the job's), never over a
    cluster's capacity. `histograms` are the clients' label histograms `[n, C]`; the
    communities and pre-placement topology are computed unless given. Raises
    CapacityError when the clusters cannot hold the clients.

    A pinned job (data.placement = "pinned") places every client on the cluster that holds
    its data: `pinned[i]` is client i's cluster (default: the blocks `pinned_holders`
    gives these clusters); PinnedClientsLost if one of them is not among `clusters`.

    `overflow` (a re-plan after a lost cluster, `on_cluster_loss = "continue"`): when the
    clusters cannot hold every client, the ones that do not fit sit out instead of the
    job failing (`absent`: listed on a cluster as placeholders that never train) until a
    cluster returns or capacity frees."""
    slots = as_slots(clusters)
    ids = tuple(s.cluster_id for s in slots)
    caps = [s.capacity for s in slots]
    n = spec.data.number_of_clients
    seed = spec.seed if seed is None else seed
    strategy = strategy or spec.placement.strategy
    if spec.data.placement == "pinned":
        fixed, absent = fixed_assignment(
            pinned if pinned is not None else client_clusters(pinned_holders(n, ids)), ids,
            caps)
        _check_histograms(histograms, n)
        if communities is None:
            communities = job_communities(spec, histograms, seed=seed)
        return PlacementResult("pinned", ids, np.asarray(fixed, dtype=np.int64),
                               communities.labels, communities.count, tuple(absent))
    short = n - int(sum(caps))
    if overflow and short > 0 and caps and all(c >= 0 for c in caps):
        # the largest cluster is given room for the clients that do not fit; the
        # placement runs as usual, and what it puts on that cluster past its real
        # capacity sits out (the highest ids: a deterministic choice)
        k = int(np.argmax(caps))
        roomy = [c + short if i == k else c for i, c in enumerate(caps)]
        full = plan_placement(spec, histograms, [ClusterSlot(c, r) for c, r in zip(ids, roomy,
                                                                                     strict=True)],
                              seed=seed, strategy=strategy, communities=communities,
                              topology=topology)
        on_k = np.flatnonzero(full.cluster_index == k)
        sit_out = tuple(sorted(int(i) for i in on_k[len(on_k) - short:]))
        return PlacementResult(full.strategy, ids, full.cluster_index, full.client_community,
                               full.communities, sit_out)
    check_capacity(n, caps)
    _check_histograms(histograms, n)
    if communities is None:
        communities = job_communities(spec, histograms, seed=seed)
    if strategy == "round_robin":
        index = round_robin(n, caps)
    elif strategy == "random":
        index = random_assignment(n, caps, seed)
    elif strategy in ("locality", "precomputed"):
        if topology is None:
            topology = pre_placement_topology(spec, histograms, seed=seed)
        groups = communities
        if strategy == "precomputed":
            if not spec.placement.precomputed_file:
                raise AssignmentFileError("strategy 'precomputed' needs "
                                          "placement.precomputed_file in the job file")
            kind, values = load_precomputed(spec.placement.precomputed_file, n, ids)
            if kind == "clusters":
                _check_loads(values, caps, ids, spec.placement.precomputed_file)
                return PlacementResult(strategy, ids, values, communities.labels,
                                       communities.count)
            groups = communities = _groups_as_communities(values, histograms)
        index = assign_communities(
            groups, topology, caps, similarity_weight=spec.placement.similarity_weight,
            resolution=spec.placement.louvain_resolution, seed=seed)
        if strategy == "locality" and topology.num_edges:
            # Traffic that follows ids rather than data (ring, trees, random graphs) is cut
            # less by partitioning the graph itself; keep whichever cuts less.
            alt = contiguous_assignment(topology, caps)
            if cut_traffic(topology, alt) < cut_traffic(topology, index):
                index = alt
            index = refine_assignment(topology, index, caps)
    else:
        raise ValueError(f"unknown placement strategy {strategy!r}")
    return PlacementResult(strategy, ids, index, communities.labels, communities.count)


def job_communities(spec: JobSpec, histograms: np.ndarray, *, seed: int) -> Communities:
    p = spec.placement
    return find_communities(histograms, damping=p.ap_damping, preference=p.ap_preference,
                            seed=seed, max_candidates=p.ap_max_exemplar_candidates)


def pre_placement_topology(spec: JobSpec, histograms: np.ndarray | None, *,
                           seed: int) -> LogicalTopology:
    """The client↔client traffic placement can act on: the job's edges for decentralized
    topologies; a path through each level-1 sibling group for hierarchical; none for star
    and hybrid (their aggregators follow the clients)."""
    n = spec.data.number_of_clients
    if spec.topology.kind in _PRE_PLACEMENT:
        topology = replace(spec.topology, mixing_steps=fixed_mixing_steps(spec) or 0)
        return build_topology(topology, n, histograms=histograms, seed=seed)
    if spec.topology.kind == "hierarchical":
        # Siblings under one level-1 aggregator share its traffic: a path through them
        # makes placement keep them together.
        b = spec.topology.hierarchy_branching
        i = np.arange(n - 1)
        same = (i // b) == ((i + 1) // b)
        edges = np.stack([i[same], i[same] + 1], axis=1)
        return LogicalTopology("hierarchical", n, n, edges, np.ones(len(edges)))
    return LogicalTopology(spec.topology.kind, n, n, np.zeros((0, 2), np.int64), np.zeros(0))


def final_topology(spec: JobSpec, placement: PlacementResult, pre: LogicalTopology,
                   *, seed: int) -> LogicalTopology:
    """The full logical topology once clients are placed (hybrid groups = clusters)."""
    n = spec.data.number_of_clients
    if spec.topology.kind == "k_connected":
        return fit_traffic_budget(pre, placement.cluster_index, spec.topology.traffic_budget,
                                  fixed_steps=bool(fixed_mixing_steps(spec)), seed=seed,
                                  grouped=not spec.transfer.per_edge)
    if spec.topology.kind in _PRE_PLACEMENT:
        return pre
    return build_topology(spec.topology, n, groups=placement.cluster_index,
                          group_names=placement.clusters, seed=seed)


def routing_matrix(spec: JobSpec, placement: PlacementResult, topology: LogicalTopology,
                   slots: Sequence[ClusterSlot], *, epoch: int = 0) -> RoutingMatrix:
    """The routing matrix of a placement (aggregators placed with most of their edges;
    clients that sit out have no say)."""
    voters = placement.cluster_index.copy()
    voters[list(placement.absent)] = -1
    node_cluster = place_aggregators(topology, voters, len(slots))
    node_cluster[:topology.num_clients] = placement.cluster_index
    return RoutingMatrix.from_edges(
        job_id=spec.job_id, clusters=[s.cluster_id for s in slots], node_cluster=node_cluster,
        edges=topology.edges, num_clients=topology.num_clients,
        aggregators=topology.aggregator_names, peers=[s.peer_id for s in slots], epoch=epoch,
        communities=placement.client_community, kind=topology.kind, parent=topology.parent,
        exchange_period=topology.exchange_period, mixing_steps=topology.mixing_steps)


def plan_job(
    spec: JobSpec,
    clusters: Sequence[ClusterSlot] | Mapping[str, int],
    *,
    strategy: str | None = None,
    histograms: np.ndarray | None = None,
    compare: Sequence[str] = (),
    epoch: int = 0,
    pinned: Sequence[str] | None = None,
    overflow: bool = False,
) -> Plan:
    """Run the whole pipeline for `spec` (histograms from the job's own partition unless
    given) and time each stage. `compare` names other strategies whose inter-cluster
    edge counts are reported alongside (same histograms, communities and topology); a
    pinned job has no other assignment to compare. `pinned`, `overflow`: see
    `plan_placement`."""
    slots = as_slots(clusters)
    if spec.data.placement == "pinned":
        compare = ()
    elif not overflow:
        check_capacity(spec.data.number_of_clients, [s.capacity for s in slots])
    seconds: dict[str, float] = {}
    t = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        seconds[name] = now - t
        t = now

    if histograms is None:
        if spec.data.placement == "pinned":
            raise PlanError(f"data.dataset {spec.data.dataset!r} is pinned: the clients' label "
                            "histograms come from the clusters' own files, which never leave "
                            "them; plan with --synthetic-histograms, or submit the job")
        histograms = job_histograms(spec)
    _check_histograms(histograms, spec.data.number_of_clients)
    lap("histograms")
    communities = job_communities(spec, histograms, seed=spec.seed)
    lap("communities")
    pre = pre_placement_topology(spec, histograms, seed=spec.seed)
    lap("topology")
    placement = plan_placement(spec, histograms, slots, strategy=strategy,
                               communities=communities, topology=pre, pinned=pinned,
                               overflow=overflow)
    lap("placement")
    topology = final_topology(spec, placement, pre, seed=spec.seed)
    routing = routing_matrix(spec, placement, topology, slots, epoch=epoch)
    lap("routing")
    counts: dict[str, int] = {}
    for other in compare:
        if other == placement.strategy:
            counts[other] = routing.edge_counts()[1]
            continue
        alt = plan_placement(spec, histograms, slots, strategy=other,
                             communities=communities, topology=pre)
        alt_topology = final_topology(spec, alt, pre, seed=spec.seed)
        counts[other] = routing_matrix(spec, alt, alt_topology, slots).edge_counts()[1]
    if compare:
        counts.setdefault(placement.strategy, routing.edge_counts()[1])
    return Plan(spec, placement, topology, routing, seconds, counts)


def _check_histograms(histograms: np.ndarray, n: int) -> None:
    shape = np.shape(histograms)
    if len(shape) != 2 or shape[0] != n or shape[1] < 1:
        raise PlanError(f"label histograms have shape {shape}, expected ({n}, num_classes) "
                        "for data.number_of_clients clients")
    if np.issubdtype(np.asarray(histograms).dtype, np.number) and np.any(
            np.asarray(histograms) < 0):
        raise PlanError("label histograms must be non-negative counts")


def _check_loads(index: np.ndarray, caps: Sequence[int], ids: Sequence[str], path: str) -> None:
    loads = np.bincount(index, minlength=len(caps))
    for cid, load, cap in zip(ids, loads, caps, strict=True):
        if load > cap:
            raise CapacityError(f"{path}: puts {load} clients on cluster {cid}, whose "
                                f"capacity is {cap}")


def _groups_as_communities(groups: np.ndarray, histograms: np.ndarray) -> Communities:
    count = int(groups.max()) + 1
    sums = np.zeros((count, histograms.shape[1]))
    np.add.at(sums, groups, histograms)
    totals = sums.sum(axis=1, keepdims=True)
    return Communities(groups, sums / np.where(totals > 0, totals, 1.0), "precomputed", count)
