"""placement.json's routing: the readable form for small jobs, the array form above
READABLE_ROUTING_MAX_NODES, and `routing_nodes` reading both into the same per-node view."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proto.job import JobSpec
from scheduler.planning.clusters import ClusterSlot
from scheduler.planning.placement.histograms import synthetic_histograms
from scheduler.planning.plan import Plan, plan_job
from scheduler.rundir.placement import (
    ARRAYS_FORM,
    READABLE_ROUTING_MAX_NODES,
    placement_json,
    results_routing,
    routing_json,
    routing_nodes,
)
from scheduler.rundir.results import JobSummary, write_results

KINDS = ("hybrid", "star", "hierarchical", "ring", "k_connected")


def plan(kind: str, n: int = 40) -> Plan:
    spec = JobSpec.from_dict({"job": {"id": f"pj-{kind}"},
                              "data": {"number_of_clients": n, "dirichlet_beta": 0.1},
                              "topology": {"kind": kind}})
    return plan_job(spec, [ClusterSlot(c, n // 3 + 2) for c in "abc"],
                    histograms=synthetic_histograms(n, beta=0.1, seed=3))


def result_placement(p: Plan, *, max_readable_nodes: int) -> dict[str, object]:
    """What the driver hands write_results."""
    placement = p.placement.to_dict()
    placement["routing"] = results_routing(p.routing, max_readable_nodes=max_readable_nodes)
    return placement


@pytest.mark.parametrize("kind", KINDS)
def test_array_form_reads_back_as_the_readable_form(kind: str) -> None:
    p = plan(kind)
    readable = p.routing.to_dict(readable=True)
    arrays = json.loads(placement_json(result_placement(p, max_readable_nodes=0)))["routing"]
    assert arrays["form"] == ARRAYS_FORM and "nodes" not in arrays
    assert routing_nodes(arrays) == readable["nodes"]
    assert list(routing_nodes(arrays)) == list(readable["nodes"])
    for key in ("v", "type", "job_id", "epoch", "kind", "exchange_period", "mixing_steps",
                "clusters", "edges"):
        assert arrays[key] == readable[key], key
    assert routing_nodes(json.loads(json.dumps(readable))) == readable["nodes"]


@pytest.mark.parametrize("kind", ("hybrid", "k_connected"))
def test_small_job_file_is_byte_for_byte_the_old_one(tmp_path: Path, kind: str) -> None:
    p = plan(kind)
    assert p.routing.num_nodes <= READABLE_ROUTING_MAX_NODES
    placement = result_placement(p, max_readable_nodes=READABLE_ROUTING_MAX_NODES)
    old = dict(p.placement.to_dict(), routing=p.routing.to_dict(readable=True))
    summary = JobSummary(job_id="pj", backend="inprocess", placement_strategy="locality",
                         topology=kind, aggregation="fedavg", compression="none", communities=1)
    write_results(tmp_path, summary, placement=placement)
    assert (tmp_path / "placement.json").read_bytes() == (json.dumps(old, indent=2) + "\n").encode()


def test_large_job_file_holds_the_same_placement(tmp_path: Path) -> None:
    p = plan("hybrid")
    summary = JobSummary(job_id="pj", backend="inprocess", placement_strategy="locality",
                         topology="hybrid", aggregation="fedavg", compression="none",
                         communities=1)
    write_results(tmp_path, summary, placement=result_placement(p, max_readable_nodes=0))
    text = (tmp_path / "placement.json").read_text()
    written = json.loads(text)
    old = p.placement.to_dict()
    for key, value in old.items():
        assert written[key] == value, key
    assert routing_nodes(written["routing"]) == p.routing.to_dict(readable=True)["nodes"]
    # one top-level key a line, one routing key a line: the file stays greppable
    assert '\n  "client_cluster": {"c0": ' in text and '\n    "node_cluster": [' in text
    assert json.loads(routing_json(written["routing"])) == written["routing"]


def test_truncated_array_form_is_refused_naming_the_key() -> None:
    routing = results_routing(plan("star").routing, max_readable_nodes=0)
    routing["parent"] = routing["parent"][:-1]
    with pytest.raises(ValueError, match="routing.parent has 40 entries, expected 41"):
        routing_nodes(routing)
