"""The logical topology as an edge list, built without torch or ray (planning imports it).

Node ids: clients are 0..num_clients-1; aggregator nodes (the star server, hierarchical
aggregators, hybrid group heads) follow from num_clients on. Each undirected edge appears
once with u < v and a traffic weight (messages per round). This is the only topology
builder; the routing matrix carries its result (with each node's parent) to the clusters:

- star: every client ↔ the node `server` (id `num_clients`).
- hierarchical: clients in id order are grouped `hierarchy_branching` per level-1
  aggregator `agg1_<i>`; each further level groups the previous one's aggregators the
  same way; level `hierarchy_levels` is the root `server`. `hierarchy_levels = 1` is a star.
- ring: client i ↔ client (i+1) mod n.
- k_connected: `random` is a random k-regular graph (networkx, seeded) when n·k is even,
  else each client picks k random others; `similarity` links each client to its k most
  cosine-similar clients by label histogram (union of both directions).
- full: every pair of clients.
- custom: the CSV adjacency (n×n, symmetric; a non-zero entry is an edge and its weight).
- hybrid: each group (the physical cluster a client is placed on) gets a head node
  `g:<cluster>` linked to its members; heads form a full mesh with weight
  1/inter_cluster_period. Built after placement, since the groups are its result.

Client node names are `c<i>`; aggregators are named in `LogicalTopology.aggregator_names`.
For star, hierarchical and hybrid the topology also says who aggregates for whom
(`parent`, one entry per node, -1 for roots and decentralized nodes). This module is the
only place a topology is built: the routing matrix carries its result to the executors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import networkx as nx
import numpy as np
from threadpoolctl import threadpool_limits

from proto.job import (
    DECENTRALIZED_TOPOLOGIES,
    MAX_MIXING_STEPS,
    JobSpec,
    TopologySpec,
    k_neighbors,
)
from scheduler.errors import PlanError
from scheduler.planning.placement.similarity import quantise, unit_rows

EXACT_KNN_LIMIT = 4096      # above this many clients, k-similar neighbours come from blocks
KNN_BLOCK = 384             # block size for the scalable neighbour search
FULL_EDGE_LIMIT = 20_000_000
#: auto mixing steps: enough steps that the nodes' disagreement after a round is at most
#: this share of what local training left (the graph's mixing factor to the power of steps)
MIXING_TARGET = 0.2
#: ... unless even MAX_MIXING_STEPS leave more than this share: then the graph mixes too
#: slowly (a ring, a sparse custom graph) for steps to pay their traffic, and one is used
MIXING_USEFUL = 0.5
#: k_connected under a budget gains the edges that cost no inter-cluster transfer while
#: every node keeps at most this many neighbours (a node averages all of them each step)
FREE_DEGREE = 128
DENSE_MIXING_LIMIT = 1000   # clients; above, power iteration (dense: 0.4 s at 1,000, 2 s at 1,500)


@dataclass(frozen=True)
class LogicalTopology:
    """Edges `[E, 2]` (int64, u < v, unique) with traffic `weights [E]` over `num_nodes`
    nodes, of which the first `num_clients` are clients."""

    kind: str
    num_clients: int
    num_nodes: int
    edges: np.ndarray
    weights: np.ndarray
    aggregator_names: tuple[str, ...] = ()
    parent: np.ndarray | None = None       # [num_nodes] aggregator of each node, -1 if none
    exchange_period: int = 1               # hybrid: groups exchange every this many rounds
    mixing_steps: int = 1                  # decentralized: neighbour averagings per round

    @property
    def num_edges(self) -> int:
        return int(self.edges.shape[0])


def build_topology(
    spec: TopologySpec,
    num_clients: int,
    *,
    histograms: np.ndarray | None = None,
    groups: np.ndarray | None = None,
    group_names: tuple[str, ...] = (),
    seed: int = 0,
) -> LogicalTopology:
    """The edge list of `spec.kind` over `num_clients` clients. `histograms` are needed for
    k_connected similarity; hybrid needs `groups` (a group index per client, e.g. its
    cluster index) and `group_names` (e.g. cluster ids). A decentralized topology with
    `mixing_steps = 0` gets `auto_mixing_steps` (histograms give the clients' sample
    counts, else all weigh the same). Deterministic."""
    n = num_clients
    kind = spec.kind
    names: tuple[str, ...] = ()
    if kind == "star":
        edges = np.stack([np.arange(n), np.full(n, n)], axis=1)
        weights, names = np.ones(n), ("server",)
    elif kind == "hierarchical":
        edges, names = hierarchical_edges(n, spec.hierarchy_levels, spec.hierarchy_branching)
        weights = np.ones(len(edges))
    elif kind == "ring":
        edges = ring_edges(n)
        weights = np.ones(len(edges))
    elif kind == "k_connected":
        k = k_neighbors(spec, n)
        if spec.k_connected_mode in ("similarity", "complementary"):
            if histograms is None:
                raise PlanError(f"k_connected {spec.k_connected_mode} topology needs label "
                                "histograms")
            edges = (similarity_edges(histograms, k) if spec.k_connected_mode == "similarity"
                     else complementary_edges(histograms, k, seed))
        else:
            edges = random_k_edges(n, k, seed)
        weights = np.ones(len(edges))
    elif kind == "full":
        if n * (n - 1) // 2 > FULL_EDGE_LIMIT:
            raise PlanError(f"topology.kind = 'full' with {n} clients has {n * (n - 1) // 2} "
                            f"edges (limit {FULL_EDGE_LIMIT}); use k_connected or hybrid")
        u, v = np.triu_indices(n, k=1)
        edges = np.stack([u, v], axis=1)
        weights = np.ones(len(edges))
    elif kind == "custom":
        edges, weights = custom_edges(spec.adjacency_file, n)
    elif kind == "hybrid":
        if groups is None:
            raise PlanError("hybrid topology needs a group (cluster) per client")
        edges, weights, used = hybrid_edges(np.asarray(groups), spec.inter_cluster_period)
        names = tuple(f"g:{group_names[g] if g < len(group_names) else g}" for g in used)
    else:
        raise PlanError(f"unknown topology kind {kind!r}")
    topology = _make(kind, n, n + len(names), edges, weights, names)
    if kind in ("star", "hierarchical", "hybrid"):
        parent = tree_parents(edges[:len(edges) if kind != "hybrid" else n], n + len(names))
        period = spec.inter_cluster_period if kind == "hybrid" else 1
        topology = replace(topology, parent=parent, exchange_period=period)
    if kind in DECENTRALIZED_TOPOLOGIES:
        steps = spec.mixing_steps
        if steps == 0:
            samples = (np.ones(n) if histograms is None
                       else np.asarray(histograms, dtype=np.float64).sum(axis=1))
            steps = auto_mixing_steps(topology.edges, samples)
        topology = replace(topology, mixing_steps=steps)
    return topology


def star_transfers(cluster_index: np.ndarray) -> int:
    """Inter-cluster model transfers of one star round over these clients: each client
    off the root's cluster (the root goes where most clients are) gets the model and
    sends its update."""
    counts = np.bincount(np.asarray(cluster_index, dtype=np.int64))
    return int(2 * (counts.sum() - counts.max())) if len(counts) else 0


def inter_transfers(edges: np.ndarray, cluster_index: np.ndarray, steps: int,
                    grouped: bool = True) -> int:
    """Inter-cluster model transfers of one decentralized round, once per mixing step: a
    node's model goes once to each other cluster where it has neighbours
    (HybridTransport.send_many); `grouped=False` (topk compression: a message per edge)
    both ways over every edge between clusters."""
    e = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    ci = np.asarray(cluster_index, dtype=np.int64)
    crossing = e[ci[e[:, 0]] != ci[e[:, 1]]]
    if not grouped:
        return int(2 * steps * len(crossing))
    return int(steps * len(_sends(crossing, ci)))


def _sends(crossing: np.ndarray, ci: np.ndarray) -> np.ndarray:
    """The (node, other cluster) pairs of edges between clusters, as node * C + cluster."""
    c = int(ci.max()) + 1 if len(ci) else 1
    u, v = crossing[:, 0], crossing[:, 1]
    return np.unique(np.concatenate([u * c + ci[v], v * c + ci[u]]))


def fit_traffic_budget(topology: LogicalTopology, cluster_index: np.ndarray, budget: float,
                       *, fixed_steps: bool = False, seed: int = 0,
                       grouped: bool = True) -> LogicalTopology:
    """A decentralized graph whose inter-cluster transfers per round are at most `budget`
    x star's on the same placement (`topology.traffic_budget`; 0: as it is).

    Edges inside a cluster cost no inter-cluster bytes (Ray references), and (`grouped`)
    neither does an edge between two nodes whose models go to each other's cluster anyway
    (`inter_transfers`). So the graph keeps every node's degree with edges inside its
    cluster and keeps only as many edges between clusters as the budget pays for: first
    one for every node that had one (seeded order), then more at random; then, up to
    FREE_DEGREE neighbours, it gains every edge that costs nothing (`_free_edges`): with a
    few clusters that is every pair, and one mixing step averages the whole federation.
    Of the step counts up to the plan's, the fewest that leave at most MIXING_TARGET of
    the disagreement after a round (mixing factor ^ steps), else the one that leaves the
    least, win (`fixed_steps`: the job fixed them). Measured (bench_learning's grid,
    k_connected at the defaults): see docs/job.md."""
    n = topology.num_clients
    ci = np.asarray(cluster_index, dtype=np.int64)[:n]
    limit = budget * star_transfers(ci)
    steps = max(1, topology.mixing_steps)
    adds_free = grouped and 2 <= n <= FREE_DEGREE + 1
    if budget <= 0 or (not adds_free and inter_transfers(topology.edges, ci, steps, grouped) <= limit):
        return topology
    samples = np.ones(n)
    best: tuple[float, LogicalTopology] | None = None
    for s in ([steps] if fixed_steps else range(1, steps + 1)):
        edges = topology.edges
        if inter_transfers(edges, ci, s, grouped) > limit:
            edges = _sparsify(edges, ci, int(limit // s), seed, grouped)
        if adds_free:
            edges = _free_edges(edges, ci, int(limit // s), seed)
        remaining = mixing_factor(edges, samples) ** s
        if best is None or remaining < best[0] - 1e-9:
            best = (remaining, replace(topology, edges=edges, weights=np.ones(len(edges)),
                                       mixing_steps=s))
        if remaining <= MIXING_TARGET:
            break
    assert best is not None
    return best[1]


def _free_edges(edges: np.ndarray, ci: np.ndarray, cap: int, seed: int) -> np.ndarray:
    """`edges` and every edge that adds no inter-cluster transfer: between two nodes of one
    cluster, or between u and v whose models go to each other's cluster already, once
    (node, cluster) sends were bought up to `cap` in all (seeded order). Every pair of
    nodes is looked at: only for at most FREE_DEGREE + 1 nodes (the caller's bound)."""
    n = len(ci)
    e = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    c = int(ci.max()) + 1
    sends = np.zeros(n * c, dtype=bool)
    sends[_sends(e[ci[e[:, 0]] != ci[e[:, 1]]], ci)] = True
    own = np.arange(n) * c + ci
    missing = np.setdiff1d(np.flatnonzero(~sends), own)
    missing = missing[np.isin(missing % c, ci)]  # clusters that hold nodes
    spare = max(0, cap - int(sends.sum()))
    sends[np.random.default_rng(seed).permutation(missing)[:spare]] = True
    u, v = np.triu_indices(n, k=1)
    free = (ci[u] == ci[v]) | (sends[u * c + ci[v]] & sends[v * c + ci[u]])
    return np.unique(np.concatenate([e, np.stack([u[free], v[free]], axis=1)]), axis=0)


def _sparsify(edges: np.ndarray, ci: np.ndarray, keep: int, seed: int,
              grouped: bool = True) -> np.ndarray:
    """`edges` with only as many of those between clusters as cost at most `keep`
    transfers a step (`inter_transfers`; one edge per node first), and every node's lost
    degree made up by edges to random nodes of its own cluster."""
    rng = np.random.default_rng(seed)
    e = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    crossing = ci[e[:, 0]] != ci[e[:, 1]]
    inter, intra = e[crossing][rng.permutation(int(crossing.sum()))], e[~crossing]
    n = len(ci)
    covered = np.zeros(n, dtype=bool)
    first: list[int] = []
    for i, (u, v) in enumerate(inter):
        if not (covered[u] and covered[v]):
            covered[u] = covered[v] = True
            first.append(i)
    chosen = set(first)
    sends: set[tuple[int, int]] = set()
    cost = 0
    kept = []
    for i in first + [i for i in range(len(inter)) if i not in chosen]:
        u, v = (int(x) for x in inter[i])
        new = {(u, int(ci[v])), (v, int(ci[u]))} - sends if grouped else {(u, v), (v, u)}
        if cost + len(new) > keep:
            continue
        cost += len(new)
        sends |= new
        kept.append(inter[i])
    kept_edges = np.array(kept, dtype=np.int64).reshape(-1, 2)
    degree = np.bincount(e.ravel(), minlength=n)
    have = {(int(u), int(v)) for u, v in np.concatenate([intra, kept_edges])}
    now = np.bincount(np.concatenate([intra, kept_edges]).ravel(), minlength=n) if have else \
        np.zeros(n, dtype=np.int64)
    members = {int(c): np.flatnonzero(ci == c) for c in np.unique(ci)}
    for u in rng.permutation(n):
        peers = members[int(ci[u])]
        for v in rng.permutation(peers):
            if now[u] >= degree[u]:
                break
            a, b = (int(u), int(v)) if u < v else (int(v), int(u))
            if a == b or (a, b) in have:
                continue
            have.add((a, b))
            now[a] += 1
            now[b] += 1
    return np.array(sorted(have), dtype=np.int64).reshape(-1, 2)


def topology_warnings(spec: JobSpec) -> list[str]:
    """What a decentralized job should know before it runs (`fedpilot-scheduler plan`
    prints it, the driver logs it): a ring learns far slower at `client_fraction` < 1
    (`partial_participation_warning`), and a robust aggregator may vote over too few
    models to outvote a liar (`robust_voters_warning`)."""
    return [w for w in (partial_participation_warning(spec.topology.kind,
                                                      spec.training.client_fraction),
                        robust_voters_warning(spec)) if w]


def robust_voters_warning(spec: JobSpec) -> str | None:
    """median / trimmed_mean in a decentralized job that votes over too few models to
    outvote one lying neighbour (krum is refused there): a round's node votes over its own
    model and its neighbours' (at `client_fraction` < 1 its drawn neighbours' only,
    worker.executor.engine.Draw: on average 1 + degree x fraction); a median outvotes one
    liar from 3 models, a trimmed mean (trim_ratio r) only from 1 / r (at the default 0.1,
    10: more than k_connected's nodes have up to 256 clients)."""
    topo, fraction, name = spec.topology, spec.training.client_fraction, spec.aggregation.name
    if topo.kind not in DECENTRALIZED_TOPOLOGIES or name not in ("median", "trimmed_mean"):
        return None
    n = spec.data.number_of_clients
    degree = {"ring": min(2, n - 1), "k_connected": k_neighbors(topo, n),
              "full": n - 1}.get(topo.kind)
    needs = 3 if name == "median" else math.ceil(1 / max(spec.aggregation.trim_ratio, 1e-9))
    where = f"aggregation.name = '{name}' on {topo.kind}"
    if fraction < 1.0:
        votes = (f"about {1 + degree * fraction:.1f} models a round (with every client "
                 f"{degree + 1})" if degree is not None else "fewer models than with every client")
        return (f"{where} with training.client_fraction = {fraction:g}: a node votes over "
                f"its own model and its drawn neighbours' only, {votes}, and {name} outvotes "
                f"one lying neighbour only from {needs}; for robust aggregation use "
                "client_fraction = 1, or star / hierarchical")
    if degree is None or degree + 1 >= needs:
        return None
    return (f"{where}: a node votes over its own model and its {degree} neighbours' "
            f"({degree + 1} models), and trimmed_mean at aggregation.trim_ratio = "
            f"{spec.aggregation.trim_ratio:g} trims none of them (it needs {needs}): set "
            f"trim_ratio >= 1 / {degree + 1}, or use median")


def partial_participation_warning(kind: str, client_fraction: float) -> str | None:
    """What a ring job with `client_fraction` < 1 should know before it runs (None for any
    other). A decentralized round now mixes every drawn node and its neighbours, each with
    its drawn neighbours' trained models (worker.executor.engine.Draw), which brought
    k_connected to star at 0.3 (bench_learning cells, fedavg, 15 rounds, star /
    k_connected before / now: digits SmallCNN beta 0.3, 20 clients 0.674 / 0.356 / 0.702,
    MNIST SmallCNN beta 0.3, 20 clients 0.935 / 0.825 / 0.929, digits SmallCNN beta 1.0,
    50 clients 0.922 / 0.635 / 0.919, digits BNCNN beta 0.3, 20 clients 0.922 / 0.869 /
    0.925); a ring's two neighbours carry a round's training one node further only
    (mixing factor ~0.99): digits SmallCNN beta 0.3, 20 clients 0.780 with every client,
    0.440 at 0.5, 0.323 at 0.3 (star 0.811 at 0.5, 0.674 at 0.3); MNIST 0.810 at 0.3
    (star 0.935)."""
    if kind != "ring" or client_fraction >= 1.0:
        return None
    return (f"topology.kind = 'ring' with training.client_fraction = {client_fraction:g}: a "
            "round's training reaches a ring's nodes one neighbour at a time, and at this "
            "fraction it learns far slower than star (measured at 0.3: 0.32 and 0.81 where "
            "star reached 0.67 and 0.94); use k_connected, star or hybrid, or "
            "client_fraction = 1")


def auto_mixing_steps(edges: np.ndarray, samples: np.ndarray) -> int:
    """Mixing steps for a decentralized graph: the fewest s (at most MAX_MIXING_STEPS) with
    mixing_factor^s <= MIXING_TARGET; 1 if even the most leave more than MIXING_USEFUL.

    Measured (bench_learning, MNIST, 40 clients, k_connected complementary, auto k = 7,
    fedavg, centralized 0.959 / 0.973 on seeds 0 / 1): the factor is 0.54 / 0.58, so
    3 steps; 1 step reaches 0.948 / 0.944 x centralized, 2 steps 0.948 / 0.953, 3 steps
    0.953 / 0.955, star 0.952 / 0.955; fedprox (seed 0) 0.946 with 1 step, 0.954 with 3. Log-degree graphs (auto k) keep the factor
    near 0.55-0.7 from 40 to 100,000 clients, i.e. 3-4 steps; a ring's is ~1, so 1 step.
    The whole graph's factor, whatever `client_fraction`: a round mixes its participants
    and their neighbours (worker.executor.engine.Draw), nearly every node at 0.3 (until
    stop 61 only the participants mixed, and the factor was that of the graph they
    induced: at small fractions almost no edges, so 1 step)."""
    samples = np.asarray(samples, dtype=np.float64)
    factor = mixing_factor(edges, samples, stop_above=MIXING_USEFUL ** (1 / MAX_MIXING_STEPS))
    if factor <= MIXING_TARGET:
        return 1
    if factor >= 1.0 - 1e-9:
        return 1  # disconnected: steps cannot join the parts
    steps = math.ceil(math.log(MIXING_TARGET) / math.log(factor) - 1e-9)
    if steps <= MAX_MIXING_STEPS:
        return steps
    return MAX_MIXING_STEPS if factor ** MAX_MIXING_STEPS <= MIXING_USEFUL else 1


def mixing_factor(edges: np.ndarray, samples: np.ndarray, iterations: int | None = None,
                  stop_above: float = 1.0) -> float:
    """How much one averaging step shrinks the nodes' disagreement: the second-largest
    eigenvalue modulus of the engine's mixing matrix, where a node averages itself and its
    neighbours weighted by their samples (a reversible walk with edge weights s_u s_v, so
    its symmetric form has the same spectrum). Exact up to DENSE_MIXING_LIMIT nodes; above,
    seeded power iteration on the edge list, which approaches the factor from below: 40
    iterations, 15 above 100,000 nodes (enough to tell the step counts apart, whose bounds
    lie 0.1-0.2 apart). Every iterate is a lower bound, so the iteration stops once one
    reaches `stop_above`: bench_plan's 1,000,000-client similarity graph stops after 3,
    in about 0.5 s."""
    s = np.maximum(np.asarray(samples, dtype=np.float64), 1e-12)
    n = len(s)
    if n < 2:
        return 0.0
    e = np.asarray(edges, dtype=np.int64).reshape(-1, 2)   # unique, u < v (_make)
    a, b = e[:, 0], e[:, 1]
    # node i's total weight: s_i (s_i + its neighbours' samples)
    root = np.sqrt(s * (s + np.bincount(a, s[b], n) + np.bincount(b, s[a], n)))
    top = root / np.linalg.norm(root)                # the eigenvector of eigenvalue 1
    # the symmetric form D^-1/2 W D^-1/2: on the diagonal and on each edge
    own, edge = (s / root) ** 2, s[a] * s[b] / (root[a] * root[b])
    if n <= DENSE_MIXING_LIMIT:
        dense = np.diag(own)
        dense[a, b] = dense[b, a] = edge
        return float(np.max(np.abs(np.linalg.eigvalsh(dense - np.outer(top, top)))))
    own, edge, top = own.astype(np.float32), edge.astype(np.float32), top.astype(np.float32)
    x = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    factor = 0.0
    for _ in range(iterations or (40 if n <= 100_000 else 15)):
        x -= top * (top @ x)
        norm = float(np.linalg.norm(x))
        if norm == 0.0:
            return 0.0
        x /= norm
        x = own * x + np.bincount(a, edge * x[b], n) + np.bincount(b, edge * x[a], n)
        factor = float(np.linalg.norm(x))
        if factor >= stop_above:
            break
    return factor


def tree_parents(child_parent: np.ndarray, num_nodes: int) -> np.ndarray:
    """Parent index of every node from (child, parent) edges; -1 for nodes without one."""
    parent = np.full(num_nodes, -1, dtype=np.int64)
    pairs = np.asarray(child_parent, dtype=np.int64).reshape(-1, 2)
    parent[pairs[:, 0]] = pairs[:, 1]
    return parent


def _make(kind: str, n: int, num_nodes: int, edges: np.ndarray,
          weights: np.ndarray, names: tuple[str, ...] = ()) -> LogicalTopology:
    edges = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    weights = np.asarray(weights, dtype=np.float64)
    lo, hi = np.minimum(edges[:, 0], edges[:, 1]), np.maximum(edges[:, 0], edges[:, 1])
    keep = lo != hi
    key = lo[keep] * num_nodes + hi[keep]
    order = np.argsort(key, kind="stable")  # sort-based: numpy 2's hashed unique is slower
    key = key[order]
    fresh = np.concatenate(([True], key[1:] != key[:-1])) if len(key) else np.zeros(0, bool)
    key, first = key[fresh], order[fresh]
    uniq = np.stack([key // num_nodes, key % num_nodes], axis=1)
    return LogicalTopology(kind, n, num_nodes, uniq, weights[keep][first], names)


def ring_edges(n: int) -> np.ndarray:
    """Client i ↔ client (i+1) mod n (one edge for n = 2, none for n = 1)."""
    if n < 2:
        return np.zeros((0, 2), dtype=np.int64)
    i = np.arange(n)
    return np.stack([i, (i + 1) % n], axis=1)


def hierarchical_edges(n: int, levels: int, branching: int) -> tuple[np.ndarray, tuple[str, ...]]:
    """Edges of the aggregation tree and the names of the aggregator nodes it adds
    (`agg<level>_<i>` ..., then `server`), numbered from n in that order."""
    parts: list[np.ndarray] = []
    names: list[str] = []
    current = np.arange(n)
    for level in range(1, levels + 1):
        if level == levels:
            parts.append(np.stack([current, np.full(len(current), n + len(names))], axis=1))
            names.append("server")
            break
        count = -(-len(current) // branching)
        parents = n + len(names) + np.arange(len(current)) // branching
        parts.append(np.stack([current, parents], axis=1))
        names.extend(f"agg{level}_{i}" for i in range(count))
        current = np.unique(parents)
    return np.concatenate(parts), tuple(names)


def random_k_edges(n: int, k: int, seed: int) -> np.ndarray:
    """A random k-regular graph when n·k is even (networkx, up to 20,000 clients), else each
    client's k random distinct partners (union)."""
    if k <= 0:
        return np.zeros((0, 2), dtype=np.int64)
    if (n * k) % 2 == 0 and n <= 20_000:
        g = nx.random_regular_graph(k, n, seed=seed)
        return np.array(list(g.edges()), dtype=np.int64).reshape(-1, 2)
    rng = np.random.default_rng(seed)
    if n <= 4096:  # distinct partners: the first k of a random order of the n-1 others
        offsets = np.argsort(rng.random((n, n - 1)), axis=1)[:, :k] + 1
    else:  # repeats are rare at this size; the edge list is deduplicated anyway
        offsets = rng.integers(1, n, size=(n, k))
    src = np.repeat(np.arange(n), k)
    return np.stack([src, (src + offsets.ravel()) % n], axis=1)


def similarity_edges(histograms: np.ndarray, k: int) -> np.ndarray:
    """Each client ↔ its k most cosine-similar clients (ties broken deterministically). Exact up to
    EXACT_KNN_LIMIT clients; above, exact within blocks of KNN_BLOCK clients ordered so that
    similar histograms are adjacent (memory O(n·k + KNN_BLOCK²))."""
    n = histograms.shape[0]
    if k <= 0 or n < 2:
        return np.zeros((0, 2), dtype=np.int64)
    u = unit_rows(histograms)
    if n <= EXACT_KNN_LIMIT:
        return _knn_block(u, np.arange(n), k)
    codes = quantise(histograms, 10)
    dominant = np.argmax(codes, axis=1)
    order = np.lexsort(tuple(codes.T[::-1]) + (dominant,))
    parts = []
    # Many tiny products: a multi-threaded BLAS only adds hand-off cost (3x on 2 busy cores).
    with threadpool_limits(1):
        for start in range(0, n, KNN_BLOCK):
            block = order[start:start + KNN_BLOCK]
            if len(block) <= k:  # a short tail joins the previous block
                block = order[max(0, start - KNN_BLOCK):start + KNN_BLOCK]
            parts.append(_knn_block(u, block, min(k, len(block) - 1)))
    return np.concatenate(parts)


def complementary_edges(histograms: np.ndarray, k: int, seed: int,
                        candidates: int = 2048, chunk: int = 512) -> np.ndarray:
    """Each client ↔ k clients that complete its label mix (union of both directions): the
    k most cosine-similar to its deficit, max(0, global share - own share), per class. A
    neighbourhood then holds every class, so gossip averaging mixes what each client lacks
    (the idea of D-Cliques, Bellet et al. 2022) - where `similarity` links clients that
    lack the same classes and the graph splits along the labels. Exact up to `candidates`
    clients; above, each chunk of clients chooses among a seeded random pool of them."""
    n = histograms.shape[0]
    if k <= 0 or n < 2:
        return np.zeros((0, 2), dtype=np.int64)
    h = np.asarray(histograms, dtype=np.float64)
    own = h / np.maximum(h.sum(axis=1, keepdims=True), 1.0)
    total = h.sum(axis=0)
    share = total / max(float(total.sum()), 1.0)
    deficit = unit_rows(np.maximum(share[None, :] - own, 0.0))
    u = unit_rows(h)
    rng = np.random.default_rng(seed)
    out = []
    for start in range(0, n, chunk):
        rows = np.arange(start, min(n, start + chunk))
        pool = np.arange(n) if n <= candidates else rng.choice(n, candidates, replace=False)
        sims = deficit[rows] @ u[pool].T
        sims[pool[None, :] == rows[:, None]] = -np.inf   # not itself
        kk = min(k, len(pool) - 1)
        top = np.argpartition(-sims, kk - 1, axis=1)[:, :kk]
        out.append(np.stack([np.repeat(rows, kk), pool[top.ravel()]], axis=1))
    return np.concatenate(out)


def _knn_block(u: np.ndarray, members: np.ndarray, k: int, chunk: int = 512) -> np.ndarray:
    sub = u[members]
    m = len(members)
    out = []
    for start in range(0, m, chunk):
        sims = sub[start:start + chunk] @ sub.T
        rows = np.arange(sims.shape[0])
        sims[rows, start + rows] = -np.inf
        top = np.argpartition(sims, m - k, axis=1)[:, m - k:]
        src = np.repeat(members[start:start + chunk], k)
        out.append(np.stack([src, members[top.ravel()]], axis=1))
    return np.concatenate(out)


def custom_edges(path: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Edges and weights of a CSV adjacency matrix; it must be n×n, numeric and symmetric."""
    try:
        adj = np.loadtxt(path, delimiter=",", dtype=np.float64, ndmin=2)
    except (OSError, ValueError) as exc:
        raise PlanError(f"{path}: cannot read the adjacency CSV ({exc}); "
                        "expected n rows of n comma-separated numbers") from None
    if adj.shape != (n, n):
        raise PlanError(f"{path}: adjacency is {adj.shape[0]}x{adj.shape[1]}, expected "
                        f"{n}x{n} (data.number_of_clients)")
    if not np.allclose(adj, adj.T):
        i, j = np.argwhere(~np.isclose(adj, adj.T))[0]
        raise PlanError(f"{path}: adjacency is not symmetric (row {i}, column {j}: "
                        f"{adj[i, j]} vs {adj[j, i]})")
    u, v = np.nonzero(np.triu(adj, k=1))
    return np.stack([u, v], axis=1), np.abs(adj[u, v])


def hybrid_edges(groups: np.ndarray, period: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group members ↔ their group head; heads in a full mesh (weight 1/period). Returns
    edges, weights and the (sorted) group ids that got a head, in head-node order."""
    n = len(groups)
    used, dense = np.unique(groups, return_inverse=True)
    g = len(used)
    member = np.stack([np.arange(n), n + dense], axis=1)
    hu, hv = np.triu_indices(g, k=1)
    heads = np.stack([n + hu, n + hv], axis=1)
    weights = np.concatenate([np.ones(n), np.full(len(heads), 1.0 / period)])
    return np.concatenate([member, heads]), weights, used
