"""Who sends what to whom in one round, for every topology, as pure data.

A round is a small dataflow program over the job's nodes. Clients train and send their
update to their parent (tree topologies) or their model to their peers (decentralized
topologies); aggregators wait for all children, aggregate, and either pass the result up
or, at the root, send the new model down. Hybrid groups aggregate every round and
exchange group models with the other groups every `inter_cluster_period` rounds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

TREE_KINDS = ("star", "hierarchical")
DECENTRALIZED_KINDS = ("ring", "k_connected", "full", "custom")
KINDS = (*TREE_KINDS, "hybrid", *DECENTRALIZED_KINDS)

# Message kinds on the wire (UpdateHeader.source/target carry node ids; the kind rides in
# the message id so one stream protocol serves them all).
UP = "up"          # child -> parent: (weights, samples)
DOWN = "down"      # parent -> child: model
PEER = "peer"      # decentralized neighbour exchange, and hybrid group <-> group


class GraphError(ValueError):
    """The round graph cannot be built from what the plan says."""


@dataclass(frozen=True)
class RoundGraph:
    """The logical topology of a job, as the executor runs it."""

    kind: str
    clients: tuple[str, ...]
    parent: Mapping[str, str] = field(default_factory=dict)
    peers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    inter_cluster_period: int = 1

    @property
    def aggregators(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.parent.values()), key=_natural))

    @property
    def nodes(self) -> tuple[str, ...]:
        return (*self.clients, *self.aggregators)

    def children(self, node: str) -> tuple[str, ...]:
        return tuple(sorted((c for c, p in self.parent.items() if p == node), key=_natural))

    def root(self, node: str) -> bool:
        return self.is_aggregator(node) and node not in self.parent

    def is_aggregator(self, node: str) -> bool:
        return node in set(self.parent.values())

    def exchanges(self, round_index: int) -> bool:
        """Whether hybrid groups exchange their models at the end of this round (1-based)."""
        return self.kind == "hybrid" and round_index % max(1, self.inter_cluster_period) == 0

    def edges(self) -> list[tuple[str, str]]:
        """Every undirected edge once, (a, b) with a < b in node order."""
        seen: set[tuple[str, str]] = set()
        for child, parent in self.parent.items():
            seen.add(_ordered(child, parent))
        for node, neighbours in self.peers.items():
            for other in neighbours:
                seen.add(_ordered(node, other))
        return sorted(seen, key=lambda e: (_natural(e[0]), _natural(e[1])))


def _natural(node: str) -> tuple[str, int, str]:
    head = node.rstrip("0123456789")
    tail = node[len(head):]
    return (head, int(tail) if tail else -1, node)


def _ordered(a: str, b: str) -> tuple[str, str]:
    return (a, b) if _natural(a) <= _natural(b) else (b, a)


def client_id(index: int) -> str:
    return f"c{index}"


def client_index(node: str) -> int:
    if not node.startswith("c") or not node[1:].isdigit():
        raise GraphError(f"{node!r} is not a client node id (expected c<index>)")
    return int(node[1:])


def star(num_clients: int) -> RoundGraph:
    clients = tuple(client_id(i) for i in range(num_clients))
    return RoundGraph("star", clients, parent={c: "server" for c in clients})


def hierarchical(num_clients: int, branching: int, levels: int) -> RoundGraph:
    """`levels` levels of aggregators above the clients; each groups up to `branching` children."""
    if branching < 2 or levels < 1:
        raise GraphError("hierarchical needs hierarchy_branching >= 2 and hierarchy_levels >= 1")
    clients = tuple(client_id(i) for i in range(num_clients))
    parent: dict[str, str] = {}
    current: list[str] = list(clients)
    for level in range(1, levels + 1):
        if level == levels:
            parent.update({node: "server" for node in current})
            break
        groups = [current[i:i + branching] for i in range(0, len(current), branching)]
        names = [f"agg{level}_{i}" for i in range(len(groups))]
        for name, members in zip(names, groups, strict=True):
            parent.update({node: name for node in members})
        current = names
    return RoundGraph("hierarchical", clients, parent=parent)


def hybrid(groups: Mapping[str, Iterable[str]], inter_cluster_period: int) -> RoundGraph:
    """Clients aggregate inside their group (one aggregator `g:<group>` each); groups peer."""
    parent: dict[str, str] = {}
    for group, members in groups.items():
        for client in members:
            parent[client] = f"g:{group}"
    aggregators = sorted(set(parent.values()))
    peers = {a: tuple(b for b in aggregators if b != a) for a in aggregators}
    clients = tuple(sorted(parent, key=_natural))
    return RoundGraph("hybrid", clients, parent=parent, peers=peers,
                      inter_cluster_period=inter_cluster_period)


def to_dict(graph: RoundGraph) -> dict[str, object]:
    """Plain data for the control channel (msgpack-safe)."""
    return {
        "kind": graph.kind,
        "clients": list(graph.clients),
        "parent": dict(graph.parent),
        "peers": {k: list(v) for k, v in graph.peers.items()},
        "inter_cluster_period": graph.inter_cluster_period,
    }


def from_dict(data: Mapping[str, object]) -> RoundGraph:
    """Inverse of `to_dict`, checking shapes (the input came over the wire)."""
    try:
        kind = str(data["kind"])
        clients = tuple(str(c) for c in data["clients"])  # type: ignore[attr-defined]
        parent = {str(k): str(v) for k, v in data["parent"].items()}  # type: ignore[attr-defined]
        peers = {str(k): tuple(str(x) for x in v)
                 for k, v in data["peers"].items()}  # type: ignore[attr-defined]
        period = int(data["inter_cluster_period"])  # type: ignore[call-overload]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise GraphError(f"malformed round graph: {exc}") from exc
    if kind not in KINDS:
        raise GraphError(f"unknown topology kind {kind!r}; allowed: {', '.join(KINDS)}")
    known = set(clients) | set(parent.values())
    for node, others in peers.items():
        unknown = [o for o in (node, *others) if o not in known]
        if unknown:
            raise GraphError(f"round graph names unknown node(s) {unknown}")
    return RoundGraph(kind, clients, parent=parent, peers=peers,
                      inter_cluster_period=max(1, period))


def decentralized(kind: str, num_clients: int, edges: Iterable[tuple[int, int]]) -> RoundGraph:
    clients = tuple(client_id(i) for i in range(num_clients))
    neighbours: dict[str, set[str]] = {c: set() for c in clients}
    for a, b in edges:
        if a == b:
            continue
        neighbours[client_id(a)].add(client_id(b))
        neighbours[client_id(b)].add(client_id(a))
    peers = {c: tuple(sorted(n, key=_natural)) for c, n in neighbours.items()}
    return RoundGraph(kind, clients, peers=peers)
