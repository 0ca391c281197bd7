"""The placement pipeline as pure functions, one stage per module:

1. `histograms`  — label histogram per client (fedcore.data partitioner or synthetic);
2. `similarity`  — cosine similarity (and the quantisation used at scale);
3. `communities` — Affinity Propagation (full, or over distinct/sampled histograms);
4. `mapping`     — Louvain over the community graph, capacity-respecting assignment;
   `refine`      — greedy moves/swaps that cut traffic within capacity;
   `strategies`  — round_robin, random, precomputed.
The routing matrix (stage 5) is `proto.routing.RoutingMatrix`; `scheduler.planning.plan` runs all.
"""

from scheduler.planning.placement.communities import (
    Communities,
    affinity_propagation,
    find_communities,
)
from scheduler.planning.placement.histograms import (
    job_histograms,
    planted_histograms,
    synthetic_histograms,
)
from scheduler.planning.placement.mapping import (
    assign_communities,
    check_capacity,
    community_graph,
    contiguous_assignment,
    cut_traffic,
    louvain_groups,
    place_aggregators,
)
from scheduler.planning.placement.refine import refine_assignment
from scheduler.planning.placement.similarity import (
    cosine_similarity,
    nearest_rows,
    quantise,
    unit_rows,
)
from scheduler.planning.placement.strategies import load_precomputed, random_assignment, round_robin

__all__ = [
    "Communities",
    "affinity_propagation",
    "assign_communities",
    "check_capacity",
    "community_graph",
    "contiguous_assignment",
    "cosine_similarity",
    "cut_traffic",
    "find_communities",
    "job_histograms",
    "load_precomputed",
    "louvain_groups",
    "nearest_rows",
    "place_aggregators",
    "planted_histograms",
    "quantise",
    "random_assignment",
    "refine_assignment",
    "round_robin",
    "synthetic_histograms",
    "unit_rows",
]
