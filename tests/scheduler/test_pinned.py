"""Pinned data on the scheduler's side: clients numbered per cluster, an assignment that
no plan or re-plan changes, and routing that still follows the histograms."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from proto.job import JobSpec, JobSpecError
from scheduler.errors import CapacityError, JobFailed, PlanError
from scheduler.planning.clusters import ClusterSlot
from scheduler.planning.pinned import (
    PinnedClientsLost,
    check_pinned_data,
    client_clusters,
    pinned_holders,
)
from scheduler.planning.plan import plan_job
from scheduler.run.driver import plan_epoch


def spec(**sections: Any) -> JobSpec:
    base: dict[str, Any] = {"job": {"id": "p", "seed": 1},
                            "data": {"dataset": "site", "placement": "pinned",
                                     "number_of_clients": 9}}
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return JobSpec.from_dict(base, source="job.toml")


def site_histograms(n_per: int = 3, sites: int = 3) -> np.ndarray:
    """Every site's clients hold mostly their site's three classes."""
    rows = []
    for s in range(sites):
        for j in range(n_per):
            row = np.full(10, 2)
            row[[(3 * s + k) % 10 for k in range(3)]] = 30 + j
            rows.append(row)
    return np.array(rows, dtype=np.int64)


SLOTS = [ClusterSlot("b", 4), ClusterSlot("a", 4), ClusterSlot("c", 4)]


def test_clients_are_numbered_in_blocks_whatever_order_the_clusters_come_in() -> None:
    assert pinned_holders(7, ["c", "a", "b"]) == {"a": [0, 1, 2], "b": [3, 4], "c": [5, 6]}
    assert client_clusters(pinned_holders(4, ["x", "y"])) == ["x", "x", "y", "y"]
    with pytest.raises(JobFailed, match="fewer than the 3 clusters"):
        pinned_holders(2, ["a", "b", "c"])


def test_no_plan_or_replan_moves_a_pinned_client() -> None:
    job = spec(placement={"clustering_period": 1}, topology={"kind": "hybrid"})
    pinned = client_clusters(pinned_holders(9, ["a", "b", "c"]))
    hist = site_histograms()
    plans = [plan_epoch(job, hist, SLOTS, epoch=e, pinned=pinned) for e in range(3)]
    for plan in plans:
        assert plan.placement.strategy == "pinned"
        assert plan.placement.client_cluster == pinned
        # each group (a cluster) aggregates on its own cluster: no client update crosses
        routing = plan.routing
        for i in range(9):
            parent = int(routing.parent[i])
            assert routing.node_cluster[parent] == routing.node_cluster[i]
    # communities still come from the histograms (three sites, three label skews)
    assert plans[0].placement.communities == 3


def test_histogram_routing_keeps_exchanges_on_site_where_random_does_not() -> None:
    pinned = client_clusters(pinned_holders(9, ["a", "b", "c"]))
    hist = site_histograms()
    # traffic_budget = 0: the graphs as the modes build them (a budget would add every
    # edge that costs nothing more to both)
    similar = plan_job(spec(topology={"kind": "k_connected", "client_k_neighbors": 2,
                                      "k_connected_mode": "similarity", "traffic_budget": 0}),
                       SLOTS, histograms=hist, pinned=pinned)
    random = plan_job(spec(topology={"kind": "k_connected", "client_k_neighbors": 2,
                                     "k_connected_mode": "random", "traffic_budget": 0}),
                      SLOTS, histograms=hist, pinned=pinned)
    assert similar.placement.client_cluster == random.placement.client_cluster == pinned
    assert similar.routing.edge_counts()[1] < random.routing.edge_counts()[1]


def test_a_lost_clusters_clients_sit_out_on_a_survivor_without_a_say() -> None:
    pinned = client_clusters(pinned_holders(9, ["a", "b", "c"]))
    survivors = [ClusterSlot("b", 4), ClusterSlot("c", 4)]  # a (c0..c2, 3 votes) is gone
    plan = plan_epoch(spec(), site_histograms(), survivors, epoch=1, pinned=pinned)
    placement = plan.placement
    assert placement.absent == (0, 1, 2)
    assert placement.to_dict()["sitting_out"] == ["c0", "c1", "c2"]
    assert placement.clients_per_cluster() == {"b": 3, "c": 3}  # placeholders are nobody's
    # listed on a survivor (the matrix needs a cluster for every node); the others stay put
    assert placement.client_cluster == ["b"] * 6 + ["c"] * 3
    # the star's server sits with most of the clients that take part: b and c hold three
    # each (the absent three would have tipped it to b); ties go to the first cluster
    routing = plan.routing
    server = routing.num_clients
    assert routing.clusters[int(routing.node_cluster[server])] == "b"
    with pytest.raises(PinnedClientsLost, match=r"every pinned client.*submit --resume"):
        plan_epoch(spec(), site_histograms(), [ClusterSlot("d", 9)], epoch=2, pinned=pinned)
    # a CapacityError: recovery reports it as "the survivors cannot hold the clients"
    assert issubclass(PinnedClientsLost, CapacityError)


def test_sitting_out_clients_do_not_decide_where_aggregators_sit() -> None:
    pinned = ["a"] * 5 + ["b"] + ["c"] * 3  # a (5 clients) is gone
    slots = [ClusterSlot("b", 9), ClusterSlot("c", 9)]
    plan = plan_epoch(spec(), site_histograms(), slots, epoch=1, pinned=pinned)
    assert plan.placement.absent == (0, 1, 2, 3, 4)
    assert plan.placement.client_cluster[:6] == ["b"] * 6  # 5 placeholders + b's own
    # b lists six clients, but only one of them trains: the server goes to c's three
    routing = plan.routing
    assert routing.clusters[int(routing.node_cluster[routing.num_clients])] == "c"


def test_a_cluster_too_small_for_its_own_clients_is_named() -> None:
    small = [ClusterSlot("a", 3), ClusterSlot("b", 2), ClusterSlot("c", 9)]
    with pytest.raises(CapacityError, match="cluster b holds the data of 3 pinned clients"):
        plan_job(spec(), small, histograms=site_histograms())


def test_plan_without_histograms_says_the_data_is_on_the_clusters() -> None:
    with pytest.raises(PlanError, match="pinned.*--synthetic-histograms"):
        plan_job(spec(), SLOTS)


def test_clusters_must_agree_on_classes_and_shape() -> None:
    same = {"num_classes": 10, "input_shape": [1, 8, 8]}
    check_pinned_data({"a": {"data": same}, "b": {"data": same}}, "site")
    with pytest.raises(JobFailed, match=r"disagree \(a: 10 classes.*; b: 10 classes, samples "
                                        r"of shape \[64\]"):
        check_pinned_data({"a": {"data": same},
                           "b": {"data": {"num_classes": 10, "input_shape": [64]}}}, "site")
    with pytest.raises(JobFailed, match="did not say"):
        check_pinned_data({"a": {}}, "site")


@pytest.mark.parametrize(("data", "placement", "needles"), [
    ({"dataset": "npz:/x.npz", "placement": "pinned"}, {},
     ["data.dataset = 'npz:/x.npz'", "NAME of a dataset every cluster declares"]),
    ({"dataset": "digits", "placement": "pinned"}, {}, ["data.dataset = 'digits'", "[datasets]"]),
    ({"dataset": "site"}, {}, ["data.dataset = 'site'", "set data.placement = 'pinned'"]),
    ({"dataset": "site", "placement": "pinned"}, {"strategy": "random"},
     ["placement.strategy = 'random'", "stays on the cluster that holds its data"]),
    ({"placement": "local"}, {}, ["data.placement = 'local'", "simulated, pinned"]),
])
def test_job_spec_rules(data: dict[str, Any], placement: dict[str, Any],
                        needles: list[str]) -> None:
    raw: dict[str, Any] = {"job": {"id": "p"}, "data": data}
    if placement:
        raw["placement"] = placement
    with pytest.raises(JobSpecError) as err:
        JobSpec.from_dict(raw, source="job.toml")
    for needle in needles:
        assert needle in str(err.value)


def test_pinned_spec_round_trips_and_defaults_to_simulated() -> None:
    job = spec()
    assert JobSpec.from_dict(job.to_dict()) == job
    assert JobSpec.from_dict({}).data.placement == "simulated"


def trial(rate: float, verdict: str = "trained") -> dict[str, Any]:
    return {"learning_rate": rate, "trial": [[0.05, 2.3], [rate, 0.5]], "uniform_loss": 2.3,
            "verdict": verdict, **({} if verdict == "trained" else {"message": f"{verdict} here"})}


def test_the_sites_trials_give_the_job_their_median_rate_the_smaller_of_two() -> None:
    """A pinned job's learning rate from its sites' trials (their job.start replies): the
    median in halvings of the job's rate; of two, the smaller (a rate too large kills the
    model, one too small only slows it); a site whose trial trained nothing is left out
    and named. No trial, or every site keeping the job's rate: the job's, unsaid."""
    from fedcore.data.preflight import shared_learning_rate

    job = spec(model={"name": "m:Net"})   # learning_rate 0.05
    assert shared_learning_rate(job, {"a": None, "b": None}) == (None, "")
    assert shared_learning_rate(job, {"a": trial(0.05), "b": trial(0.05)}) == (None, "")
    rate, line = shared_learning_rate(job, {"a": trial(0.025), "b": trial(0.00625)})
    assert rate == 0.00625
    assert ("training.learning_rate 0.05 did not train model.name 'm:Net'" in line
            and "a 0.025, b 0.00625" in line and "trains at 0.00625" in line
            and 'learning_rate_check = "off"' in line), line
    three = {"a": trial(0.025), "b": trial(0.05 / 256), "c": trial(0.0125)}
    assert shared_learning_rate(job, three)[0] == 0.0125   # the liar's is not the median
    rate, line = shared_learning_rate(job, {"a": trial(0.025), "b": trial(0.05, "exhausted")})
    assert rate == 0.025 and "no rate trained it at b" in line
    with pytest.raises(JobSpecError, match="no site's trial trained the model: diverged "
                       "here; exhausted here") as caught:
        shared_learning_rate(job, {"a": trial(0.05, "diverged"), "b": trial(0.05, "exhausted")})
    assert caught.value.key == "training.learning_rate"


@pytest.mark.parametrize(("report", "needle"), [
    ("fast", "learning_rate_trial': must be a map"),
    ({**trial(0.025), "verdict": "maybe"}, "learning_rate_trial.verdict'"),
    ({**trial(0.025), "learning_rate": 0.0123}, "learning_rate_trial.learning_rate'"),
    ({**trial(0.025), "learning_rate": 0.1}, "halved 0 to 8 times, got 0.1"),
    ({**trial(0.025), "learning_rate": 0.05 / 512}, "halved 0 to 8 times"),
    ({**trial(0.025), "learning_rate": True}, "got True"),
    ({**trial(0.025), "learning_rate": float("nan")}, "got nan"),
    ({**trial(0.025), "learning_rate": 1e400}, "got inf"),
    ({**trial(0.025), "learning_rate": None}, "got None"),
])
def test_a_malformed_trial_report_is_refused_naming_the_site_and_field(
        report: Any, needle: str) -> None:
    from fedcore.data.preflight import shared_learning_rate

    with pytest.raises(ValueError, match="cluster b: field") as caught:
        shared_learning_rate(spec(model={"name": "m:Net"}), {"a": trial(0.025), "b": report})
    assert needle in str(caught.value), caught.value
