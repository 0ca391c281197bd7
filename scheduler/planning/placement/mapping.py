"""Stage 4: map data communities onto physical clusters within capacity.

Louvain (networkx, seeded) groups the communities on a graph whose weights are the traffic
the topology puts between them plus their data similarity; communities are then placed
group by group on the cluster they have most affinity with that still has room. A
community that fits nowhere whole is split along its weakest edges (a bandwidth-reducing
order of its internal edges, cut into contiguous pieces). No cluster ever exceeds its
capacity; aggregator nodes do not count against capacity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import networkx as nx
import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import reverse_cuthill_mckee

from scheduler.errors import CapacityError
from scheduler.planning.placement.communities import Communities
from scheduler.planning.placement.similarity import unit_rows

if TYPE_CHECKING:  # scheduler.planning.topology imports this package; avoid the cycle at run time
    from scheduler.planning.topology import LogicalTopology


LOUVAIN_DENSE_LIMIT = 64    # above this many communities, Louvain sees a sparsified graph
LOUVAIN_NEIGHBOURS = 16


def check_capacity(num_clients: int, capacities: Sequence[int]) -> None:
    """Raise CapacityError unless the clusters can hold `num_clients` clients."""
    total = int(sum(capacities))
    if any(c < 0 for c in capacities):
        raise CapacityError(f"cluster capacities must be >= 0, got {list(capacities)}")
    if total < num_clients:
        raise CapacityError(
            f"total cluster capacity {total} is less than data.number_of_clients "
            f"{num_clients}; add clusters or raise their capacity")


def community_graph(
    communities: Communities, topology: LogicalTopology, *, similarity_weight: float = 1.0
) -> np.ndarray:
    """Symmetric `[K, K]` weights between communities: client↔client traffic of the
    topology plus `similarity_weight` × centroid cosine × sizes, scaled so that both parts
    carry equal total weight (at similarity_weight = 1) when the topology has any."""
    k = communities.count
    labels = communities.labels
    n = topology.num_clients
    e = topology.edges
    both = (e[:, 0] < n) & (e[:, 1] < n)
    cu, cv = labels[e[both, 0]], labels[e[both, 1]]
    w = topology.weights[both]
    traffic = np.bincount(cu * k + cv, weights=w, minlength=k * k).reshape(k, k)
    traffic = traffic + traffic.T
    sizes = communities.sizes().astype(np.float64)
    c = unit_rows(communities.centroids).astype(np.float64)
    sim = np.clip(c @ c.T, 0.0, 1.0) * np.outer(sizes, sizes)
    if traffic.sum() > 0 and sim.sum() > 0:
        sim *= traffic.sum() / sim.sum()
    return traffic + similarity_weight * sim


def louvain_groups(weights: np.ndarray, *, resolution: float = 1.0, seed: int = 0) -> np.ndarray:
    """Louvain group of every community (networkx, deterministic for `seed`)."""
    k = weights.shape[0]
    g = nx.Graph()
    g.add_nodes_from(range(k))
    if k > LOUVAIN_DENSE_LIMIT:
        # Keep each community's strongest links: the similarity part makes the graph
        # complete, and Louvain's cost follows the edge count.
        keep = np.zeros_like(weights, dtype=bool)
        strongest = np.argpartition(-weights, LOUVAIN_NEIGHBOURS, axis=1)[:, :LOUVAIN_NEIGHBOURS]
        keep[np.repeat(np.arange(k), LOUVAIN_NEIGHBOURS), strongest.ravel()] = True
        weights = np.where(keep | keep.T, weights, 0.0)
    iu, iv = np.nonzero(np.triu(weights))
    g.add_weighted_edges_from(zip(iu.tolist(), iv.tolist(), weights[iu, iv].tolist(),
                                  strict=True))
    groups = np.zeros(k, dtype=np.int64)
    parts = nx.community.louvain_communities(g, weight="weight", resolution=resolution,
                                             seed=seed)
    for gid, members in enumerate(sorted(parts, key=lambda s: (-len(s), min(s)))):
        groups[list(members)] = gid
    return groups


def assign_communities(
    communities: Communities,
    topology: LogicalTopology,
    capacities: Sequence[int],
    *,
    similarity_weight: float = 1.0,
    resolution: float = 1.0,
    seed: int = 0,
) -> np.ndarray:
    """Cluster index of every client: communities grouped by Louvain, each placed whole
    on the feasible cluster it has most affinity with (ties: most free room), split only
    when no cluster can take it whole. Never exceeds a capacity."""
    n = topology.num_clients
    check_capacity(n, capacities)
    weights = community_graph(communities, topology, similarity_weight=similarity_weight)
    groups = louvain_groups(weights, resolution=resolution, seed=seed)
    sizes = communities.sizes()
    group_size = np.bincount(groups, weights=sizes)
    order = sorted(range(communities.count),
                   key=lambda c: (-group_size[groups[c]], groups[c], -sizes[c], c))
    room = np.array(capacities, dtype=np.int64)
    affinity = np.zeros((communities.count, len(room)))  # community → weight on cluster
    cluster = np.full(n, -1, dtype=np.int64)
    members_of = _members(communities.labels, communities.count)
    adjacency: sp.csr_matrix | None = None
    for c in order:
        members = members_of[c]
        fits = np.nonzero(room >= len(members))[0]
        if len(fits):
            best = fits[np.lexsort((-room[fits], -affinity[c, fits]))[0]]
            pieces = [(int(best), members)]
        else:
            if adjacency is None:
                adjacency = _client_adjacency(topology)
            pieces = _split(members, room, affinity[c], adjacency,
                            communities.centroids[c], communities)
        for k, piece in pieces:
            cluster[piece] = k
            room[k] -= len(piece)
            affinity[:, k] += weights[:, c] * len(piece) / max(len(members), 1)
    return cluster


def contiguous_assignment(topology: LogicalTopology, capacities: Sequence[int]) -> np.ndarray:
    """Clients in a bandwidth-reducing order of the topology's client↔client edges (reverse
    Cuthill–McKee), cut into consecutive runs that fill the clusters in turn: few cut edges
    for rings, trees and other id-structured graphs that carry no data signal."""
    n = topology.num_clients
    check_capacity(n, capacities)
    order = reverse_cuthill_mckee(_client_adjacency(topology), symmetric_mode=True)
    caps = np.asarray(capacities, dtype=np.int64)
    # Spread clients proportionally to capacity so no cluster is left empty needlessly.
    quota = np.floor(caps * n / caps.sum()).astype(np.int64)
    for k in np.argsort(-(caps * n / caps.sum() - quota), kind="stable"):
        if quota.sum() >= n:
            break
        if quota[k] < caps[k]:
            quota[k] += 1
    out = np.empty(n, dtype=np.int64)
    out[order] = np.repeat(np.arange(len(caps)), quota)[:n]
    return out


def cut_traffic(topology: LogicalTopology, client_cluster: np.ndarray) -> float:
    """Weight of client↔client edges whose ends are on different clusters."""
    n = topology.num_clients
    e = topology.edges
    both = (e[:, 0] < n) & (e[:, 1] < n)
    cut = client_cluster[e[both, 0]] != client_cluster[e[both, 1]]
    return float(topology.weights[both][cut].sum())


def _members(labels: np.ndarray, count: int) -> list[np.ndarray]:
    order = np.argsort(labels, kind="stable")
    bounds = np.searchsorted(labels[order], np.arange(count + 1))
    return [order[bounds[i]:bounds[i + 1]] for i in range(count)]


def _client_adjacency(topology: LogicalTopology) -> sp.csr_matrix:
    n = topology.num_clients
    e = topology.edges
    both = (e[:, 0] < n) & (e[:, 1] < n)
    u, v = e[both, 0], e[both, 1]
    w = topology.weights[both]
    a = sp.coo_matrix((w, (u, v)), shape=(n, n))
    return (a + a.T).tocsr()


def _split(members: np.ndarray, room: np.ndarray, affinity: np.ndarray,
           adjacency: sp.csr_matrix, centroid: np.ndarray,
           communities: Communities) -> list[tuple[int, np.ndarray]]:
    """Contiguous pieces of a bandwidth-reducing order of the community's internal edges
    (most typical member first when it has none), biggest free clusters first."""
    sub = adjacency[members][:, members]
    if sub.nnz:
        ordered = members[reverse_cuthill_mckee(sub.tocsr(), symmetric_mode=True)]
    else:
        ordered = members  # no internal edges: any cut is free
    pieces = []
    start = 0
    for k in np.lexsort((-affinity, -room)):
        if start >= len(ordered):
            break
        take = int(min(room[k], len(ordered) - start))
        if take > 0:
            pieces.append((int(k), ordered[start:start + take]))
            start += take
    return pieces


def place_aggregators(topology: LogicalTopology, client_cluster: np.ndarray,
                      num_clusters: int) -> np.ndarray:
    """Cluster of every node: clients as given; each aggregator node (in id order, so
    lower tree levels first) on the cluster holding most of its already-placed
    neighbours' edge weight (ties → lowest index)."""
    n, total = topology.num_clients, topology.num_nodes
    node_cluster = np.concatenate([client_cluster, np.full(total - n, -1, dtype=np.int64)])
    if total == n:
        return node_cluster
    e, w = topology.edges, topology.weights
    # Edges touching aggregators, seen from the aggregator's side.
    agg_side = np.concatenate([e[e[:, 1] >= n], e[e[:, 0] >= n][:, ::-1]])
    agg_w = np.concatenate([w[e[:, 1] >= n], w[e[:, 0] >= n]])
    order = np.argsort(agg_side[:, 1], kind="stable")
    agg_side, agg_w = agg_side[order], agg_w[order]
    bounds = np.searchsorted(agg_side[:, 1], np.arange(n, total + 1))
    for a in range(n, total):
        lo, hi = bounds[a - n], bounds[a - n + 1]
        nbr = agg_side[lo:hi, 0]
        placed = node_cluster[nbr]
        ok = placed >= 0
        votes = np.bincount(placed[ok], weights=agg_w[lo:hi][ok], minlength=num_clusters)
        node_cluster[a] = int(np.argmax(votes)) if votes.sum() > 0 else 0
    return node_cluster
