"""The placement pipeline as pure functions, one stage per module:

1. `histograms`  — label histogram per client (fedcore.data partitioner or synthetic);
2. `similarity`  — cosine similarity (and the quantisation used at scale);
3. `communities` — Affinity Propagation (full, or over distinct/sampled histograms);
4. `mapping`     — Louvain over the community graph, capacity-respecting assignment;
   `refine`      — greedy moves/swaps that cut traffic within capacity;
   `strategies`  — round_robin, random, precomputed.
The routing matrix (stage 5) is `proto.routing.RoutingMatrix`; `scheduler.planning.plan` runs all.
"""
