"""Local refinement of a placement: move or swap single clients between clusters when that
cuts topology traffic, never exceeding a capacity (a Kernighan–Lin-style greedy pass)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import scipy.sparse as sp

if TYPE_CHECKING:
    from scheduler.planning.topology import LogicalTopology


def refine_assignment(topology: LogicalTopology, client_cluster: np.ndarray,
                      capacities: Sequence[int], *, passes: int = 3) -> np.ndarray:
    """A copy of `client_cluster` improved by greedy moves (to a cluster with room) and
    pairwise swaps (between two full clusters), each strictly reducing the weight of
    client↔client edges cut. Loads never exceed `capacities`; deterministic."""
    n = topology.num_clients
    cluster = np.asarray(client_cluster, dtype=np.int64).copy()
    k = len(capacities)
    e = topology.edges
    both = (e[:, 0] < n) & (e[:, 1] < n)
    if not both.any() or k < 2:
        return cluster
    u, v, w = e[both, 0], e[both, 1], topology.weights[both]
    adj = sp.coo_matrix((np.concatenate([w, w]), (np.concatenate([u, v]),
                                                  np.concatenate([v, u]))), shape=(n, n)).tocsr()
    room = np.asarray(capacities, dtype=np.int64) - np.bincount(cluster, minlength=k)
    for _ in range(passes):
        moved = 0
        # pull[i, c]: edge weight from client i to clients on cluster c.
        pull = np.asarray(adj @ sp.csr_matrix((np.ones(n), (np.arange(n), cluster)),
                                              shape=(n, k)).toarray())
        own = pull[np.arange(n), cluster]
        best = np.argmax(pull, axis=1)
        gain = pull[np.arange(n), best] - own
        movers = np.nonzero(gain > 0)[0]
        movers = movers[np.argsort(-gain[movers], kind="stable")]
        waiting: dict[tuple[int, int], list[int]] = {}
        touched = np.zeros(n, dtype=bool)
        for i in movers.tolist():
            src, dst = int(cluster[i]), int(best[i])
            if touched[adj.indices[adj.indptr[i]:adj.indptr[i + 1]]].any():
                continue  # a neighbour moved this pass: its gain is stale
            if room[dst] > 0:
                cluster[i] = dst
                room[dst] -= 1
                room[src] += 1
                touched[i] = True
                moved += 1
                continue
            partners = waiting.get((dst, src))
            while partners:
                j = partners.pop()
                if touched[j] or adj[i, j] != 0 or touched[
                        adj.indices[adj.indptr[j]:adj.indptr[j + 1]]].any():
                    continue
                cluster[i], cluster[j] = dst, src
                touched[i] = touched[j] = True
                moved += 2
                break
            else:
                waiting.setdefault((src, dst), []).append(i)
        if moved == 0:
            break
    return cluster
