"""Who sends what to whom in one round: a read-only view of the routing matrix.

The scheduler's topology builder is the only place a topology is built; the routing
matrix it publishes carries the kind, the edges, the parent of every node and the
exchange period. This view answers the engine's questions about it. A round is a small
dataflow program over the job's nodes: clients train and send their update to their
parent (star, hierarchical, hybrid) or their model to their peers (decentralized);
aggregators wait for their participating children, aggregate, and pass the result up or,
at the root, send it down. Hybrid groups exchange group models every `exchange_period`
rounds.

Participants: with `client_fraction < 1` a round trains a sample of the clients drawn
from (seed, round) alone, so every cluster computes the same set without a message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from proto.job import MAX_MIXING_STEPS
from proto.rounds import clients_per_round
from proto.routing import DECENTRALIZED_KINDS, TREE_KINDS, RoutingMatrix
from worker.errors import WorkerError

# Message kinds (they ride in the update payload's metadata).
UP = "up"          # child -> parent: (weights, samples)
DOWN = "down"      # parent -> child: model
PEER = "peer"      # decentralized neighbour exchange, and hybrid group <-> group
STATE = "state"    # a node's state moving to another cluster after a re-plan
FINAL = "final"    # a cluster's share of the job's final model
#: decentralized mixing steps after the first (topology.mixing_steps): "peer2", "peer3", ...
MIXING_KINDS = tuple(f"peer{step}" for step in range(2, MAX_MIXING_STEPS + 1))
ROUND_KINDS = (UP, DOWN, PEER, *MIXING_KINDS)  # what a round sends; dropped after it
KINDS = (*ROUND_KINDS, STATE, FINAL)

__all__ = ["DECENTRALIZED_KINDS", "DOWN", "FINAL", "KINDS", "MIXING_KINDS", "PEER", "ROUND_KINDS",
           "STATE", "TREE_KINDS", "UP", "RoundGraph", "client_index", "mixing_kind",
           "participants"]


def mixing_kind(step: int) -> str:
    """The message kind of decentralized mixing step `step` (1: the trained models)."""
    return PEER if step == 1 else MIXING_KINDS[step - 2]


class GraphError(WorkerError, ValueError):
    """A node name or round graph does not fit the plan."""


def client_index(node: str) -> int:
    if not node.startswith("c") or not node[1:].isdigit():
        raise GraphError(f"{node!r} is not a client node id (expected c<index>)")
    return int(node[1:])


def participants(num_clients: int, fraction: float, seed: int, round_index: int) -> list[int]:
    """Clients that train in `round_index` (all unless `fraction` < 1), sorted; the same on
    every cluster and backend for the job's seed."""
    k = clients_per_round(num_clients, fraction)
    if k == num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng([seed, round_index, 0x5EED])
    return sorted(int(c) for c in rng.choice(num_clients, size=k, replace=False))


@dataclass(frozen=True)
class RoundGraph:
    """The job's logical topology as the executor runs it (built from a routing matrix)."""

    kind: str
    clients: tuple[str, ...]
    parent: Mapping[str, str] = field(default_factory=dict)
    peers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    exchange_period: int = 1

    @classmethod
    def from_routing(cls, routing: RoutingMatrix) -> RoundGraph:
        n = routing.num_clients
        clients = tuple(f"c{i}" for i in range(n))
        parent = {routing.node_name(i): routing.node_name(int(p))
                  for i, p in enumerate(routing.parent.tolist()) if p >= 0}
        peers: dict[str, tuple[str, ...]] = {}
        if routing.kind in DECENTRALIZED_KINDS:
            for i in range(n):
                peers[clients[i]] = tuple(f"c{j}" for j in routing.neighbours(i).tolist())
        elif routing.kind == "hybrid":
            heads = set(parent.values())
            for head in sorted(heads):
                peers[head] = tuple(routing.node_name(j) for j in routing.neighbours(head).tolist()
                                    if routing.node_name(j) in heads)
        return cls(routing.kind, clients, parent, peers, routing.exchange_period)

    @cached_property
    def _client_set(self) -> frozenset[str]:
        return frozenset(self.clients)

    def is_client(self, node: str) -> bool:
        return node in self._client_set

    @property
    def decentralized(self) -> bool:
        return self.kind in DECENTRALIZED_KINDS

    @cached_property
    def aggregators(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.parent.values()), key=_natural))

    @property
    def nodes(self) -> tuple[str, ...]:
        return (*self.clients, *self.aggregators)

    @cached_property
    def _children(self) -> dict[str, tuple[str, ...]]:
        kids: dict[str, list[str]] = {}
        for child, parent in self.parent.items():
            kids.setdefault(parent, []).append(child)
        return {p: tuple(sorted(c, key=_natural)) for p, c in kids.items()}

    def children(self, node: str) -> tuple[str, ...]:
        return self._children.get(node, ())

    def root(self, node: str) -> bool:
        return node in self._children and node not in self.parent

    @property
    def roots(self) -> tuple[str, ...]:
        return tuple(a for a in self.aggregators if a not in self.parent)

    def exchanges(self, round_index: int) -> bool:
        """Whether hybrid groups exchange their models at the end of this round (1-based)."""
        return self.kind == "hybrid" and round_index % max(1, self.exchange_period) == 0

    def active(self, trained: set[str]) -> set[str]:
        """The nodes taking part in a round whose training clients are `trained`: those
        clients, every aggregator with an active child, and (hybrid) every group, since
        groups exchange even when none of their clients trained."""
        active = set(trained)
        frontier = set(trained)
        while frontier:
            frontier = {self.parent[n] for n in frontier if n in self.parent} - active
            active |= frontier
        if self.kind == "hybrid":
            active |= set(self.aggregators)
        active |= set(self.roots)
        return active


def _natural(node: str) -> tuple[str, int, str]:
    head = node.rstrip("0123456789")
    tail = node[len(head):]
    return (head, int(tail) if tail else -1, node)
