"""From a plan to what executors run: the round graph that matches the routing matrix.

The planner (`scheduler.plan.plan_job`) places clients and aggregators and builds the
routing matrix; this module adds the direction of each edge (which node aggregates for
which) as the executors' `RoundGraph`, with the same node names (`c<i>`, `server`,
`agg<level>_<i>`, `g:<cluster>`), and checks that every edge it uses is in the matrix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from proto.job import JobSpec
from proto.routing import RoutingMatrix
from scheduler.clusters import ClusterSlot
from scheduler.plan import Plan, plan_job
from worker.executor import graph as rg


def plan_epoch(spec: JobSpec, histograms: np.ndarray, slots: Sequence[ClusterSlot], *,
               epoch: int) -> tuple[Plan, rg.RoundGraph]:
    """Plan placement epoch `epoch`. Deterministic strategies give the same answer every
    epoch (nothing moves unless the clusters changed); `random` draws anew each epoch."""
    planned_spec = spec
    if spec.placement.strategy == "random" and epoch:
        planned_spec = replace(spec, seed=spec.seed + epoch)
    plan = plan_job(planned_spec, list(slots), histograms=histograms, epoch=epoch)
    graph = round_graph(spec, plan)
    check_graph(graph, plan.routing)
    return plan, graph


def round_graph(spec: JobSpec, plan: Plan) -> rg.RoundGraph:
    topo = spec.topology
    n = spec.data.number_of_clients
    if topo.kind == "star":
        return rg.star(n)
    if topo.kind == "hierarchical":
        return rg.hierarchical(n, topo.hierarchy_branching, topo.hierarchy_levels)
    if topo.kind == "hybrid":
        groups: dict[str, list[str]] = {}
        for i, cluster in enumerate(plan.placement.client_cluster):
            groups.setdefault(cluster, []).append(rg.client_id(i))
        return rg.hybrid(groups, topo.inter_cluster_period)
    edges = plan.topology.edges
    clients = edges[(edges[:, 0] < n) & (edges[:, 1] < n)]
    return rg.decentralized(topo.kind, n, [(int(a), int(b)) for a, b in clients])


def check_graph(graph: rg.RoundGraph, routing: RoutingMatrix) -> None:
    """Every edge the executors will use must be an edge of the routing matrix."""
    missing = [(a, b) for a, b in graph.edges() if not routing.is_edge(a, b)]
    if missing:
        raise rg.GraphError(f"round graph edges {missing[:5]} are not in the routing matrix "
                            f"({len(missing)} in all)")


def node_clusters(graph: rg.RoundGraph, routing: RoutingMatrix) -> dict[str, str]:
    return {node: routing.cluster_of(node) for node in graph.nodes}
