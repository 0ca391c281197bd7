"""Topology builders: one function per kind, each returning a networkx graph.

Conventions shared by every builder:
- clients are the ints `0..n-1` with node attribute `role="client"`;
- aggregators are strings (`"server"`, `"agg<level>_<i>"`, `"group<g>"`) with
  `role="aggregator"` and `level` (1 = just above the clients);
- `graph.graph["kind"]` names the topology; tree kinds (star, hierarchical) store each
  node's parent in node attribute `parent`; decentralized kinds (ring, k_connected, full,
  custom) have clients only, and a client averages with its graph neighbours;
- hybrid links each client to its group's aggregator (`edge kind="intra"`) and the group
  aggregators to each other (`kind="inter"`), exchanging every `inter_cluster_period`.
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx
import numpy as np

from proto.job import TopologySpec

from .custom import load_adjacency

TREE_KINDS = ("star", "hierarchical")
DECENTRALIZED_KINDS = ("ring", "k_connected", "full", "custom")
KINDS = (*TREE_KINDS, *DECENTRALIZED_KINDS, "hybrid")
SERVER = "server"


class TopologyError(ValueError):
    """A topology cannot be built from what the job says; the message names the key."""


def _clients(graph: nx.Graph, num_clients: int) -> None:
    if num_clients < 1:
        raise TopologyError(f"a topology needs at least one client, got {num_clients}")
    graph.add_nodes_from(range(num_clients), role="client")


def star(num_clients: int) -> nx.Graph:
    """One server linked to every client (classical FedAvg)."""
    graph = nx.Graph(kind="star")
    _clients(graph, num_clients)
    graph.add_node(SERVER, role="aggregator", level=1)
    for client in range(num_clients):
        graph.add_edge(client, SERVER)
        graph.nodes[client]["parent"] = SERVER
    return graph


def hierarchical(num_clients: int, levels: int, branching: int) -> nx.Graph:
    """`levels` levels of aggregators above the clients; the top level is one `server`.

    Level 1 groups consecutive clients in chunks of `branching` (`agg1_0` has clients
    0..branching-1, ...); level l groups level l-1 aggregators the same way; the last
    level is the server over everything below it. `levels=1` is a star.
    """
    if levels < 1:
        raise TopologyError(f"topology.hierarchy_levels must be >= 1, got {levels}")
    if branching < 2:
        raise TopologyError(f"topology.hierarchy_branching must be >= 2, got {branching}")
    graph = nx.Graph(kind="hierarchical")
    _clients(graph, num_clients)
    below: list[int | str] = list(range(num_clients))
    for level in range(1, levels + 1):
        if level == levels:
            groups: list[list[int | str]] = [below]
            names: list[int | str] = [SERVER]
        else:
            groups = [below[i:i + branching] for i in range(0, len(below), branching)]
            names = [f"agg{level}_{i}" for i in range(len(groups))]
        for name, members in zip(names, groups, strict=True):
            graph.add_node(name, role="aggregator", level=level)
            for member in members:
                graph.add_edge(member, name)
                graph.nodes[member]["parent"] = name
        below = names
    return graph


def ring(num_clients: int) -> nx.Graph:
    """Client i is linked to i-1 and i+1 (mod n)."""
    graph = nx.Graph(kind="ring")
    _clients(graph, num_clients)
    if num_clients > 1:
        graph.add_edges_from((i, (i + 1) % num_clients) for i in range(num_clients))
    return graph


def full(num_clients: int) -> nx.Graph:
    """Every client linked to every other one."""
    graph = nx.Graph(kind="full")
    _clients(graph, num_clients)
    graph.add_edges_from((i, j) for i in range(num_clients) for j in range(i + 1, num_clients))
    return graph


def k_connected_random(num_clients: int, k: int, seed: int) -> nx.Graph:
    """A random k-regular graph (every client has exactly k neighbours), fixed by `seed`."""
    if not 0 < k < num_clients:
        raise TopologyError(
            f"topology.client_k_neighbors must be in 1..{num_clients - 1} for "
            f"{num_clients} clients, got {k}"
        )
    if (k * num_clients) % 2:
        raise TopologyError(
            f"a random {k}-regular graph on {num_clients} clients does not exist "
            "(k * number_of_clients must be even); change topology.client_k_neighbors"
        )
    regular = nx.random_regular_graph(k, num_clients, seed=seed)
    graph = nx.Graph(kind="k_connected", mode="random")
    _clients(graph, num_clients)
    graph.add_edges_from(regular.edges())
    return graph


def k_connected_similar(histograms: np.ndarray, k: int) -> nx.Graph:
    """Each client linked to its k most similar clients (cosine of label histograms).

    Edges are the union of every client's k nearest, so degrees are >= k. Ties go to the
    lower client id.
    """
    hist = np.asarray(histograms, dtype=np.float64)
    if hist.ndim != 2:
        raise TopologyError(f"label histograms must be a 2-D array, got shape {hist.shape}")
    n = hist.shape[0]
    if not 0 < k < n:
        raise TopologyError(
            f"topology.client_k_neighbors must be in 1..{n - 1} for {n} clients, got {k}"
        )
    norms = np.linalg.norm(hist, axis=1, keepdims=True)
    unit = hist / np.where(norms == 0, 1.0, norms)
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, -np.inf)
    graph = nx.Graph(kind="k_connected", mode="similarity")
    _clients(graph, n)
    for i in range(n):
        # stable sort on -similarity keeps the lower id first among equals
        nearest = np.argsort(-similarity[i], kind="stable")[:k]
        graph.add_edges_from((i, int(j)) for j in nearest)
    return graph


def custom(path: str, num_clients: int) -> nx.Graph:
    """The undirected graph of an adjacency CSV (see `load_adjacency`); weights kept on edges."""
    matrix = load_adjacency(path, num_nodes=num_clients, symmetric=True)
    graph = nx.Graph(kind="custom", source=path)
    _clients(graph, num_clients)
    rows, cols = np.nonzero(np.triu(matrix, k=1))
    for i, j in zip(rows.tolist(), cols.tolist(), strict=True):
        graph.add_edge(i, j, weight=float(matrix[i, j]))
    return graph


def hybrid(groups: Sequence[Sequence[int]], inter_cluster_period: int) -> nx.Graph:
    """Clients aggregate inside their group every round; groups exchange every period.

    Group g gets aggregator `group<g>` linked to its clients; group aggregators are all
    linked to each other.
    """
    if inter_cluster_period < 1:
        raise TopologyError(
            f"topology.inter_cluster_period must be >= 1, got {inter_cluster_period}"
        )
    members = [int(c) for group in groups for c in group]
    if not members:
        raise TopologyError("hybrid topology needs at least one non-empty group")
    if sorted(members) != list(range(len(members))):
        raise TopologyError(
            "hybrid groups must cover clients 0..n-1 exactly once; got "
            f"{sorted(members)[:10]}{'...' if len(members) > 10 else ''}"
        )
    graph = nx.Graph(kind="hybrid", inter_cluster_period=inter_cluster_period)
    _clients(graph, len(members))
    names = []
    for g, group in enumerate(groups):
        if not group:
            raise TopologyError(f"hybrid group {g} is empty")
        name = f"group{g}"
        names.append(name)
        graph.add_node(name, role="aggregator", level=1, group=g)
        for client in group:
            graph.add_edge(int(client), name, kind="intra")
            graph.nodes[int(client)]["parent"] = name
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            graph.add_edge(names[a], names[b], kind="inter")
    return graph


def chunk_groups(num_clients: int, size: int) -> list[list[int]]:
    """Consecutive clients in groups of `size` (the default hybrid grouping)."""
    if size < 1:
        raise TopologyError(f"group size must be >= 1, got {size}")
    return [list(range(i, min(i + size, num_clients))) for i in range(0, num_clients, size)]


def build_topology(
    spec: TopologySpec,
    num_clients: int,
    *,
    seed: int = 0,
    histograms: np.ndarray | None = None,
    groups: Sequence[Sequence[int]] | None = None,
) -> nx.Graph:
    """The graph `spec` describes for `num_clients` clients.

    `histograms` (clients x classes) is needed for k_connected in "similarity" mode;
    `groups` are the hybrid groups (default: chunks of `hierarchy_branching` clients).
    """
    kind = spec.kind
    if kind == "star":
        return star(num_clients)
    if kind == "hierarchical":
        return hierarchical(num_clients, spec.hierarchy_levels, spec.hierarchy_branching)
    if kind == "ring":
        return ring(num_clients)
    if kind == "full":
        return full(num_clients)
    if kind == "k_connected":
        if spec.k_connected_mode == "random":
            return k_connected_random(num_clients, spec.client_k_neighbors, seed)
        if spec.k_connected_mode == "similarity":
            if histograms is None:
                raise TopologyError("k_connected in similarity mode needs the label histograms")
            if len(histograms) != num_clients:
                raise TopologyError(
                    f"got {len(histograms)} label histograms for {num_clients} clients"
                )
            return k_connected_similar(histograms, spec.client_k_neighbors)
        raise TopologyError(
            f"topology.k_connected_mode must be 'random' or 'similarity', "
            f"got {spec.k_connected_mode!r}"
        )
    if kind == "custom":
        if not spec.adjacency_file:
            raise TopologyError("topology.kind = 'custom' needs topology.adjacency_file (a CSV)")
        return custom(spec.adjacency_file, num_clients)
    if kind == "hybrid":
        chosen = groups if groups is not None else chunk_groups(
            num_clients, spec.hierarchy_branching)
        return hybrid(chosen, spec.inter_cluster_period)
    raise TopologyError(f"unknown topology.kind {kind!r}; allowed: {', '.join(KINDS)}")


def clients_of(graph: nx.Graph) -> list[int]:
    """The client nodes of `graph`, in id order."""
    return sorted(n for n, role in graph.nodes(data="role") if role == "client")


def aggregators_by_level(graph: nx.Graph) -> list[list[str]]:
    """Aggregator nodes grouped by level, lowest level first, names in build order."""
    levels: dict[int, list[str]] = {}
    for node, data in graph.nodes(data=True):
        if data.get("role") == "aggregator":
            levels.setdefault(int(data["level"]), []).append(node)
    return [levels[k] for k in sorted(levels)]


def children(graph: nx.Graph, node: int | str) -> list[int | str]:
    """Nodes whose `parent` is `node` (clients first in id order, then aggregators)."""
    kids = [n for n in graph.neighbors(node) if graph.nodes[n].get("parent") == node]
    return sorted(kids, key=lambda n: (isinstance(n, str), str(n) if isinstance(n, str) else n))
