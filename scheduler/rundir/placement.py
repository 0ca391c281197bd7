"""placement.json and routing.json: what a run directory says about where every node went.

The routing matrix is written readable (`nodes`: every node's cluster, intra-cluster
neighbours, inter-cluster neighbours with their cluster, parent) up to
READABLE_ROUTING_MAX_NODES nodes. Above that, building and encoding a dict per node costs
seconds per million nodes and hundreds of MB nobody reads by eye, so the routing is
written in array form (`"form": "arrays"`: the matrix's CSR arrays as JSON lists) and the
file is laid out one top-level key per line instead of indented. `routing_nodes` reads
either form into the same per-node view.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from proto.routing import ROUTING_TYPE, ROUTING_VERSION, RoutingMatrix

READABLE_ROUTING_MAX_NODES = 100_000
ARRAYS_FORM = "arrays"


def results_routing(routing: RoutingMatrix, *,
                    max_readable_nodes: int = READABLE_ROUTING_MAX_NODES) -> dict[str, Any]:
    """The routing matrix as placement.json holds it: `to_dict(readable=True)` up to
    `max_readable_nodes` nodes, the array form above (same header keys, plus `form`,
    `num_clients`, `aggregators`, `cluster_ids` and the arrays `node_cluster` (an index
    into `cluster_ids`), `indptr`, `indices`, `parent`)."""
    if routing.num_nodes <= max_readable_nodes:
        return routing.to_dict(readable=True)
    intra, inter = routing.edge_counts()
    return {"v": ROUTING_VERSION, "type": ROUTING_TYPE, "job_id": routing.job_id,
            "epoch": routing.epoch, "kind": routing.kind,
            "exchange_period": routing.exchange_period, "mixing_steps": routing.mixing_steps,
            "clusters": dict(zip(routing.clusters, routing.peers, strict=True)),
            "edges": {"intra": intra, "inter": inter},
            "form": ARRAYS_FORM, "num_clients": routing.num_clients,
            "aggregators": list(routing.aggregators), "cluster_ids": list(routing.clusters),
            "node_cluster": routing.node_cluster.tolist(), "indptr": routing.indptr.tolist(),
            "indices": routing.indices.tolist(), "parent": routing.parent.tolist()}


def routing_nodes(routing: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Every node's readable entry (`cluster`, `intra`, `inter`, and `parent` when it has
    one) from either form of placement.json's `routing`. ValueError naming the key if the
    array form is inconsistent."""
    if routing.get("form") != ARRAYS_FORM:
        return dict(routing["nodes"])
    clusters = list(routing["cluster_ids"])
    num_clients = int(routing["num_clients"])
    names = [f"c{i}" for i in range(num_clients)] + list(routing["aggregators"])
    node_cluster = np.asarray(routing["node_cluster"], dtype=np.int64)
    indptr = np.asarray(routing["indptr"], dtype=np.int64)
    indices = np.asarray(routing["indices"], dtype=np.int64)
    parent = np.asarray(routing["parent"], dtype=np.int64)
    n = len(names)
    for key, got, want in (("node_cluster", len(node_cluster), n), ("indptr", len(indptr), n + 1),
                           ("parent", len(parent), n),
                           ("indices", len(indices), int(indptr[-1]) if len(indptr) else 0)):
        if got != want:
            raise ValueError(f"placement.json routing.{key} has {got} entries, expected {want} "
                             f"({num_clients} clients + {n - num_clients} aggregators); "
                             "the file is truncated or was edited")
    node_names = [clusters[k] for k in node_cluster.tolist()]
    same = (node_cluster[np.repeat(np.arange(n), np.diff(indptr))] == node_cluster[indices])
    nbrs, same_list, ptr = indices.tolist(), same.tolist(), indptr.tolist()
    nodes: dict[str, dict[str, Any]] = {}
    for i in range(n):
        intra: list[str] = []
        inter: dict[str, str] = {}
        for e in range(ptr[i], ptr[i + 1]):
            j = nbrs[e]
            if same_list[e]:
                intra.append(names[j])
            else:
                inter[names[j]] = node_names[j]
        nodes[names[i]] = {"cluster": node_names[i], "intra": intra, "inter": inter}
    for i, p in enumerate(parent.tolist()):
        if p >= 0:
            nodes[names[i]]["parent"] = names[p]
    return nodes


def placement_json(placement: Mapping[str, Any]) -> bytes:
    """placement.json's bytes: indented when its routing is readable, one top-level key
    (and one routing key) per line when the routing is in array form, where an indented
    dump would take the pure-Python JSON encoder through millions of values."""
    routing = placement.get("routing")
    if not (isinstance(routing, Mapping) and routing.get("form") == ARRAYS_FORM):
        return (json.dumps(placement, indent=2) + "\n").encode()
    top = {key: _one_key_per_line(value, level=1) if key == "routing" else json.dumps(value)
           for key, value in placement.items()}
    return (_lines(top, level=0) + "\n").encode()


def routing_json(routing: Mapping[str, Any]) -> bytes:
    """routing.json's bytes (`fedpilot-scheduler plan --out`) for `results_routing`'s dict:
    indented when readable, one key per line in array form."""
    if routing.get("form") != ARRAYS_FORM:
        return (json.dumps(routing, indent=1) + "\n").encode()
    return (_one_key_per_line(routing, level=0) + "\n").encode()


def _one_key_per_line(obj: Mapping[str, Any], *, level: int) -> str:
    return _lines({key: json.dumps(value) for key, value in obj.items()}, level=level)


def _lines(encoded: Mapping[str, str], *, level: int) -> str:
    pad = "  " * (level + 1)
    body = ",\n".join(f"{pad}{json.dumps(key)}: {text}" for key, text in encoded.items())
    return "{\n" + body + "\n" + "  " * level + "}"
