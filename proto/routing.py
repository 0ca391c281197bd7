"""The routing matrix: for every edge of a job's logical topology, whether it stays inside
one cluster (INTRA_CLUSTER, Ray object references) or crosses clusters (INTER_CLUSTER,
a safetensors stream between daemons), with the neighbour's cluster ID and daemon peer ID.

Compact: neighbour lists in CSR form (`indptr`, `indices`) and one cluster index per node,
never a dense n×n. Nodes are numbered: clients 0..num_clients-1 (named `c<i>`), then the
aggregator nodes named in `aggregators` (e.g. `server`, `agg1_0`, `g:<cluster>`).

The matrix is the whole plan of a round (schema v2): besides the edges it carries the
topology `kind`, the `parent` of every node (its aggregator in star, hierarchical and
hybrid; -1 for roots and for every node of a decentralized topology), the
`exchange_period` (hybrid groups exchange their models every that many rounds) and the
`mixing_steps` (a decentralized node averages with its neighbours that many times a round;
left out of the wire form when 1).
Executors run rounds from this object alone.

Wire form (`to_bytes`/`from_bytes`): a msgpack map with `v` and `type` like every proto
message; arrays travel as little-endian raw bytes; decoding validates every field and never
unpickles. A peer ID the plan does not know is "".
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from proto.errors import (
    InvalidMessage,
    MalformedFrame,
    MessageTooLarge,
    UnknownMessageType,
    UnsupportedVersion,
)
from proto.job import DECENTRALIZED_TOPOLOGIES, MAX_MIXING_STEPS

INTRA_CLUSTER = "INTRA_CLUSTER"
INTER_CLUSTER = "INTER_CLUSTER"
ROUTING_TYPE = "routing_matrix"
ROUTING_VERSION = 2
TREE_KINDS = ("star", "hierarchical")
DECENTRALIZED_KINDS = DECENTRALIZED_TOPOLOGIES
TOPOLOGY_KINDS = (*TREE_KINDS, "hybrid", *DECENTRALIZED_KINDS)
MAX_ROUTING_BYTES = 256 * 1024 * 1024
MAX_CLUSTERS = 65535
_KEYS = frozenset({"v", "type", "job_id", "epoch", "clusters", "peers", "num_clients",
                   "aggregators", "node_cluster", "indptr", "indices", "communities",
                   "kind", "parent", "exchange_period", "mixing_steps"})
Node = int | str


@dataclass(frozen=True)
class Channel:
    """How a message from one node reaches a neighbour: `kind` is INTRA_CLUSTER or
    INTER_CLUSTER; `cluster_id`/`peer_id` name the neighbour's cluster and its daemon
    (`peer_id` is "" while unknown)."""

    kind: str
    cluster_id: str
    peer_id: str


class RoutingMatrix:
    """Immutable routing matrix of one job (one placement `epoch`)."""

    def __init__(
        self,
        *,
        job_id: str,
        clusters: Sequence[str],
        node_cluster: np.ndarray,
        indptr: np.ndarray,
        indices: np.ndarray,
        num_clients: int,
        aggregators: Sequence[str] = (),
        peers: Sequence[str] | None = None,
        epoch: int = 0,
        communities: np.ndarray | None = None,
        kind: str = "custom",
        parent: np.ndarray | None = None,
        exchange_period: int = 1,
        mixing_steps: int = 1,
        _symmetric: bool = False,
    ) -> None:
        self.job_id = job_id
        self.epoch = int(epoch)
        self.clusters: tuple[str, ...] = tuple(clusters)
        self.peers: tuple[str, ...] = tuple(peers) if peers is not None else ("",) * len(
            self.clusters)
        self.num_clients = int(num_clients)
        self.aggregators: tuple[str, ...] = tuple(aggregators)
        self.node_cluster = np.asarray(node_cluster, dtype=np.int64)
        self.indptr = np.asarray(indptr, dtype=np.int64)
        self.indices = np.asarray(indices, dtype=np.int64)
        self.communities = None if communities is None else np.asarray(communities, np.int64)
        self.kind = kind
        self.parent = (np.full(len(self.node_cluster), -1, dtype=np.int64) if parent is None
                       else np.asarray(parent, dtype=np.int64))
        self.exchange_period = int(exchange_period)
        self.mixing_steps = int(mixing_steps)
        _validate(self, check_symmetry=not _symmetric)
        self._agg_index = {name: self.num_clients + i for i, name in enumerate(self.aggregators)}

    # -- construction -----------------------------------------------------------------

    @classmethod
    def from_edges(
        cls,
        *,
        job_id: str,
        clusters: Sequence[str],
        node_cluster: np.ndarray,
        edges: np.ndarray,
        num_clients: int,
        aggregators: Sequence[str] = (),
        peers: Sequence[str] | None = None,
        epoch: int = 0,
        communities: np.ndarray | None = None,
        kind: str = "custom",
        parent: np.ndarray | None = None,
        exchange_period: int = 1,
        mixing_steps: int = 1,
    ) -> RoutingMatrix:
        """Build from undirected edges `[E, 2]` (each listed once, either direction)."""
        e = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
        num_nodes = len(node_cluster)
        src = np.concatenate([e[:, 0], e[:, 1]])
        dst = np.concatenate([e[:, 1], e[:, 0]])
        key = np.sort(src * num_nodes + dst)  # sort-based: numpy 2's hashed unique is slower
        key = key[np.concatenate(([True], key[1:] != key[:-1]))] if len(key) else key
        src, dst = key // num_nodes, key % num_nodes
        indptr = np.zeros(num_nodes + 1, dtype=np.int64)
        np.cumsum(np.bincount(src, minlength=num_nodes), out=indptr[1:])
        return cls(job_id=job_id, clusters=clusters, node_cluster=node_cluster, indptr=indptr,
                   indices=dst, num_clients=num_clients, aggregators=aggregators, peers=peers,
                   epoch=epoch, communities=communities, kind=kind, parent=parent,
                   exchange_period=exchange_period, mixing_steps=mixing_steps,
                   _symmetric=True)

    # -- lookups ----------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return len(self.node_cluster)

    def node_index(self, node: Node) -> int:
        """Index of a node given as index, `c<i>` or aggregator name; KeyError if unknown."""
        if isinstance(node, int | np.integer) and not isinstance(node, bool):
            if 0 <= int(node) < self.num_nodes:
                return int(node)
        elif isinstance(node, str):
            if node in self._agg_index:
                return self._agg_index[node]
            if node[:1] == "c" and node[1:].isdigit() and int(node[1:]) < self.num_clients:
                return int(node[1:])
        raise KeyError(f"node {node!r} is not in the routing matrix of job {self.job_id!r} "
                       f"({self.num_clients} clients c0..c{self.num_clients - 1}, "
                       f"aggregators {list(self.aggregators)[:5]})")

    def node_name(self, index: int) -> str:
        return f"c{index}" if index < self.num_clients else self.aggregators[index -
                                                                             self.num_clients]

    def cluster_of(self, node: Node) -> str:
        return self.clusters[self.node_cluster[self.node_index(node)]]

    def parent_of(self, node: Node) -> str | None:
        """The node's aggregator (the node it sends its update to), None for a root or a
        node of a decentralized topology."""
        p = int(self.parent[self.node_index(node)])
        return None if p < 0 else self.node_name(p)

    def neighbours(self, node: Node) -> np.ndarray:
        """Indices of the node's neighbours in the logical topology (sorted)."""
        i = self.node_index(node)
        return self.indices[self.indptr[i]:self.indptr[i + 1]]

    def is_edge(self, src: Node, dst: Node) -> bool:
        row = self.neighbours(src)
        j = self.node_index(dst)
        pos = int(np.searchsorted(row, j))
        return pos < len(row) and int(row[pos]) == j

    def channel(self, src: Node, dst: Node) -> Channel:
        """The channel from `src` to its neighbour `dst`. KeyError if either node is
        unknown or they are not neighbours in the logical topology."""
        if not self.is_edge(src, dst):
            raise KeyError(f"{src!r} -> {dst!r} is not an edge of job {self.job_id!r}'s "
                           "logical topology")
        a = self.node_cluster[self.node_index(src)]
        b = int(self.node_cluster[self.node_index(dst)])
        kind = INTRA_CLUSTER if a == b else INTER_CLUSTER
        return Channel(kind, self.clusters[b], self.peers[b])

    def edges(self) -> Iterator[tuple[int, int, str]]:
        """Every undirected edge once as `(u, v, kind)` with u < v."""
        src = np.repeat(np.arange(self.num_nodes), np.diff(self.indptr))
        keep = src < self.indices
        for u, v in zip(src[keep].tolist(), self.indices[keep].tolist(), strict=True):
            same = self.node_cluster[u] == self.node_cluster[v]
            yield u, v, INTRA_CLUSTER if same else INTER_CLUSTER

    def edge_counts(self) -> tuple[int, int]:
        """(intra-cluster, inter-cluster) undirected edge counts."""
        src = np.repeat(np.arange(self.num_nodes), np.diff(self.indptr))
        keep = src < self.indices
        inter = int(np.count_nonzero(self.node_cluster[src[keep]] !=
                                     self.node_cluster[self.indices[keep]]))
        return int(np.count_nonzero(keep)) - inter, inter

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutingMatrix):
            return NotImplemented
        return self.to_dict(readable=False) == other.to_dict(readable=False)

    __hash__ = None  # type: ignore[assignment]

    # -- serialisation ----------------------------------------------------------------

    def to_dict(self, *, readable: bool = False) -> dict[str, Any]:
        """Plain data. `readable=False` is the wire form (arrays as little-endian bytes);
        `readable=True` is JSON-safe: per-node neighbour lists by name and channel kind."""
        if not readable:
            out: dict[str, Any] = {
                "v": ROUTING_VERSION, "type": ROUTING_TYPE, "job_id": self.job_id,
                "epoch": self.epoch, "clusters": list(self.clusters), "peers": list(self.peers),
                "num_clients": self.num_clients, "aggregators": list(self.aggregators),
                "node_cluster": self.node_cluster.astype("<u2").tobytes(),
                "indptr": self.indptr.astype("<u8").tobytes(),
                "indices": self.indices.astype("<u4").tobytes(),
                "kind": self.kind, "parent": self.parent.astype("<i4").tobytes(),
                "exchange_period": self.exchange_period,
            }
            if self.mixing_steps != 1:
                out["mixing_steps"] = self.mixing_steps
            if self.communities is not None:
                out["communities"] = self.communities.astype("<i4").tobytes()
            return out
        intra, inter = self.edge_counts()
        nodes = {}
        for i in range(self.num_nodes):
            mine = self.node_cluster[i]
            nbrs = self.indices[self.indptr[i]:self.indptr[i + 1]]
            nodes[self.node_name(i)] = {
                "cluster": self.clusters[mine],
                "intra": [self.node_name(j) for j in nbrs if self.node_cluster[j] == mine],
                "inter": {self.node_name(j): self.clusters[self.node_cluster[j]]
                          for j in nbrs if self.node_cluster[j] != mine},
            }
        for i in range(self.num_nodes):
            p = int(self.parent[i])
            if p >= 0:
                nodes[self.node_name(i)]["parent"] = self.node_name(p)
        return {"v": ROUTING_VERSION, "type": ROUTING_TYPE, "job_id": self.job_id,
                "epoch": self.epoch, "kind": self.kind, "exchange_period": self.exchange_period,
                "mixing_steps": self.mixing_steps,
                "clusters": dict(zip(self.clusters, self.peers, strict=True)),
                "edges": {"intra": intra, "inter": inter}, "nodes": nodes}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(readable=True), indent=1, sort_keys=False)

    def to_bytes(self) -> bytes:
        data = msgpack.packb(self.to_dict(readable=False), use_bin_type=True)
        assert isinstance(data, bytes)
        return data

    @classmethod
    def from_bytes(cls, data: bytes, *, max_size: int = MAX_ROUTING_BYTES) -> RoutingMatrix:
        """Decode and validate; raises a `proto.errors.ProtocolError` subclass naming the
        field on any bad input."""
        if len(data) > max_size:
            raise MessageTooLarge(f"routing matrix is {len(data)} bytes, limit {max_size}")
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise MalformedFrame(f"routing matrix is not one msgpack map: {exc}") from None
        return cls.from_dict(obj)

    @classmethod
    def from_dict(cls, obj: Any) -> RoutingMatrix:
        """Inverse of `to_dict(readable=False)`, validating every field."""
        if not isinstance(obj, dict):
            raise InvalidMessage("routing matrix must be a map", field=None)
        if obj.get("type") != ROUTING_TYPE:
            raise UnknownMessageType(f"expected type {ROUTING_TYPE!r}, got {obj.get('type')!r}")
        if obj.get("v") != ROUTING_VERSION:
            raise UnsupportedVersion(f"routing matrix version {obj.get('v')!r} "
                                     f"(this side speaks {ROUTING_VERSION})")
        extra = sorted(set(obj) - _KEYS)
        if extra:
            raise InvalidMessage(f"routing matrix has unknown fields {extra}", field=extra[0])
        job_id = _field(obj, "job_id", str)
        epoch = _field(obj, "epoch", int)
        num_clients = _field(obj, "num_clients", int)
        clusters = _str_list(obj, "clusters")
        peers = _str_list(obj, "peers")
        aggregators = _str_list(obj, "aggregators")
        node_cluster = _array(obj, "node_cluster", "<u2")
        indptr = _array(obj, "indptr", "<u8")
        indices = _array(obj, "indices", "<u4")
        communities = _array(obj, "communities", "<i4") if "communities" in obj else None
        kind = _field(obj, "kind", str)
        parent = _array(obj, "parent", "<i4")
        exchange_period = _field(obj, "exchange_period", int)
        mixing_steps = _field(obj, "mixing_steps", int) if "mixing_steps" in obj else 1
        return cls(job_id=job_id, clusters=clusters, node_cluster=node_cluster, indptr=indptr,
                   indices=indices, num_clients=num_clients, aggregators=aggregators,
                   peers=peers, epoch=epoch, communities=communities, kind=kind, parent=parent,
                   exchange_period=exchange_period, mixing_steps=mixing_steps)


def _field(obj: dict[str, Any], name: str, kind: type) -> Any:
    value = obj.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InvalidMessage(f"routing matrix field {name!r} must be {kind.__name__}, "
                             f"got {type(value).__name__}", field=name)
    return value


def _str_list(obj: dict[str, Any], name: str) -> list[str]:
    value = obj.get(name)
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise InvalidMessage(f"routing matrix field {name!r} must be a list of strings",
                             field=name)
    return value


def _array(obj: dict[str, Any], name: str, dtype: str) -> np.ndarray:
    raw = obj.get(name)
    if not isinstance(raw, bytes):
        raise InvalidMessage(f"routing matrix field {name!r} must be bytes", field=name)
    size = np.dtype(dtype).itemsize
    if len(raw) % size:
        raise InvalidMessage(f"routing matrix field {name!r} is {len(raw)} bytes, not a "
                             f"multiple of {size}", field=name)
    return np.frombuffer(raw, dtype=dtype).astype(np.int64)


def _bad(name: str, why: str) -> InvalidMessage:
    return InvalidMessage(f"routing matrix field {name!r}: {why}", field=name)


def _validate(m: RoutingMatrix, *, check_symmetry: bool = True) -> None:
    """Every structural promise the lookups rely on (raises InvalidMessage). Symmetry (an
    O(E log E) check) is skipped only for matrices built here from undirected edges."""
    k, n = len(m.clusters), m.num_nodes
    if not m.job_id:
        raise _bad("job_id", "must not be empty")
    if m.epoch < 0:
        raise _bad("epoch", f"must be >= 0, got {m.epoch}")
    if not 1 <= k <= MAX_CLUSTERS or len(set(m.clusters)) != k:
        raise _bad("clusters", f"need 1..{MAX_CLUSTERS} distinct cluster ids, got {k}")
    if len(m.peers) != k:
        raise _bad("peers", f"need one per cluster ({k}), got {len(m.peers)}")
    if not 0 <= m.num_clients <= n or n != m.num_clients + len(m.aggregators):
        raise _bad("node_cluster", f"{n} nodes but {m.num_clients} clients + "
                                   f"{len(m.aggregators)} aggregators")
    if len(set(m.aggregators)) != len(m.aggregators):
        raise _bad("aggregators", "names must be distinct")
    if n and (m.node_cluster.min() < 0 or m.node_cluster.max() >= k):
        raise _bad("node_cluster", f"cluster indices must be in 0..{k - 1}")
    if len(m.indptr) != n + 1 or m.indptr[0] != 0 or m.indptr[-1] != len(m.indices):
        raise _bad("indptr", f"must have {n + 1} entries from 0 to {len(m.indices)}")
    if np.any(np.diff(m.indptr) < 0):
        raise _bad("indptr", "must be non-decreasing")
    if len(m.indices) and (m.indices.min() < 0 or m.indices.max() >= n):
        raise _bad("indices", f"neighbour indices must be in 0..{n - 1}")
    src = np.repeat(np.arange(n), np.diff(m.indptr))
    if np.any(src == m.indices):
        raise _bad("indices", "a node cannot be its own neighbour")
    forward = src * n + m.indices
    if len(forward) > 1 and np.any(np.diff(forward) <= 0):
        raise _bad("indices", "each neighbour list must be sorted without repeats")
    if check_symmetry and not np.array_equal(forward, np.sort(m.indices * n + src)):
        raise _bad("indices", "neighbour lists must be symmetric (u lists v iff v lists u)")
    if m.kind not in TOPOLOGY_KINDS:
        raise _bad("kind", f"unknown topology kind {m.kind!r}; allowed: {', '.join(TOPOLOGY_KINDS)}")
    if m.exchange_period < 1:
        raise _bad("exchange_period", f"must be >= 1, got {m.exchange_period}")
    if not 1 <= m.mixing_steps <= (MAX_MIXING_STEPS if m.kind in DECENTRALIZED_KINDS else 1):
        allowed = f"in 1..{MAX_MIXING_STEPS}" if m.kind in DECENTRALIZED_KINDS else f"1 on {m.kind}"
        raise _bad("mixing_steps", f"must be {allowed}, got {m.mixing_steps}")
    _validate_parent(m, src)
    if m.communities is not None and len(m.communities) != m.num_clients:
        raise _bad("communities", f"need one per client ({m.num_clients}), "
                                  f"got {len(m.communities)}")


def _validate_parent(m: RoutingMatrix, src: np.ndarray) -> None:
    """Tree kinds: every client has a parent, every parent is an aggregator it is linked
    to, and following parents ends at a root (no cycle). Decentralized: no parents."""
    n, parent = m.num_nodes, m.parent
    if len(parent) != n:
        raise _bad("parent", f"need one per node ({n}), got {len(parent)}")
    has = parent >= 0
    if m.kind in DECENTRALIZED_KINDS:
        if np.any(has):
            raise _bad("parent", f"a {m.kind} topology has no aggregators, yet parents are set")
        return
    if np.any(parent >= n) or np.any(parent < -1):
        raise _bad("parent", f"parent indices must be -1 or in 0..{n - 1}")
    if not np.all(has[:m.num_clients]):
        missing = int(np.argmin(has[:m.num_clients]))
        raise _bad("parent", f"client c{missing} has no parent in a {m.kind} topology")
    if np.any(parent[has] < m.num_clients):
        raise _bad("parent", "a parent must be an aggregator node, not a client")
    child = np.nonzero(has)[0]
    forward = src * n + m.indices
    pos = np.searchsorted(forward, child * n + parent[child])
    linked = (pos < len(forward)) & (forward[np.minimum(pos, len(forward) - 1)]
                                     == child * n + parent[child])
    if not np.all(linked):
        bad = int(child[np.argmin(linked)])
        raise _bad("parent", f"node {m.node_name(bad)} and its parent are not linked by an edge")
    # ancestor 2^k steps up, by doubling: still defined after 2^k > n steps = a cycle
    ancestor = parent.copy()
    for _ in range(max(1, int(n).bit_length()) + 1):
        ancestor = np.where(ancestor >= 0, ancestor[np.maximum(ancestor, 0)], -1)
    if np.any(ancestor >= 0):
        raise _bad("parent", "parent links form a cycle")
