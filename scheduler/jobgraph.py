"""From a plan to what executors run: client placement plus where aggregators live.

`place_job` runs the job's placement strategy over the clusters' capacities;
`build_round_graph` turns the job's topology into the executor's round graph (hybrid
groups are the physical clusters the placement chose); `Placement.node_cluster` places
every node, aggregators included (each on the cluster holding most of its children).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from proto.job import JobSpec
from worker.executor import graph as rg


@dataclass(frozen=True)
class Placement:
    client_cluster: tuple[str, ...]
    client_community: tuple[int, ...]
    communities: int

    def node_cluster(self, graph: rg.RoundGraph) -> dict[str, str]:
        nodes = {rg.client_id(i): c for i, c in enumerate(self.client_cluster)}
        if graph.kind == "hybrid":
            for agg in graph.aggregators:
                nodes[agg] = agg.removeprefix("g:")
            return nodes
        # bottom-up: an aggregator sits where most of its children are (ties: first cluster)
        pending = list(graph.aggregators)
        while pending:
            progressed = False
            for agg in list(pending):
                children = graph.children(agg)
                if all(c in nodes for c in children):
                    votes = Counter(nodes[c] for c in children)
                    best = max(votes.values())
                    nodes[agg] = min(c for c, v in votes.items() if v == best)
                    pending.remove(agg)
                    progressed = True
            if not progressed:
                raise rg.GraphError(f"aggregators {pending} have unplaced children")
        return nodes

    def to_dict(self) -> dict[str, Any]:
        return {
            "communities": self.communities,
            "client_cluster": {rg.client_id(i): c for i, c in enumerate(self.client_cluster)},
            "client_community": {rg.client_id(i): int(k)
                                 for i, k in enumerate(self.client_community)},
        }


def place_job(spec: JobSpec, histograms: np.ndarray, capacities: Mapping[str, int], *,
              epoch: int = 0) -> Placement:
    """Run the job's placement strategy; `epoch` reseeds strategies that use randomness."""
    from scheduler.plan import plan_placement

    result = plan_placement(spec, histograms, dict(capacities), seed=spec.seed + epoch)
    return Placement(tuple(result.client_cluster), tuple(int(x) for x in result.client_community),
                     int(result.communities))


def build_round_graph(spec: JobSpec, placement: Placement,
                      histograms: np.ndarray | None) -> rg.RoundGraph:
    topo = spec.topology
    n = spec.data.number_of_clients
    if topo.kind == "star":
        return rg.star(n)
    if topo.kind == "hierarchical":
        return rg.hierarchical(n, topo.hierarchy_branching, topo.hierarchy_levels)
    if topo.kind == "hybrid":
        groups: dict[str, list[str]] = {}
        for i, cluster in enumerate(placement.client_cluster):
            groups.setdefault(cluster, []).append(rg.client_id(i))
        return rg.hybrid(groups, topo.inter_cluster_period)
    from scheduler.topology import logical_edges

    edges = logical_edges(spec, histograms)
    return rg.decentralized(topo.kind, n, [(int(a), int(b)) for a, b in edges])
