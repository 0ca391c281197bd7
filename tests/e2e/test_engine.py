"""The per-cluster round engine on two in-process clusters joined by a loopback link.

Checks the dataflow of each topology against a hand computation and that bytes are
accounted on the path each message really took.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np
import pytest

from proto.job import AggregationSpec, TopologySpec
from proto.routing import RoutingMatrix
from scheduler.planning.topology import build_topology, inter_transfers
from worker.aggregators import get_aggregator
from worker.executor import graph as g
from worker.executor.engine import ClusterEngine
from worker.executor.mailbox import Mailbox, MessageTimeout
from worker.executor.transport import (
    TARGETS_KEY,
    DeliveryRefused,
    HybridTransport,
    RemoteSendError,
)
from worker.payload import PayloadError, decode, encode


class PlainCodec:
    def compress(self, weights: dict[str, np.ndarray], edge: tuple[str, ...]
                 ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        return weights, {}

    def decompress(self, tensors: dict[str, np.ndarray], meta: Any, edge: tuple[str, ...]
                   ) -> dict[str, np.ndarray]:
        return {k: np.array(v) for k, v in tensors.items()}


def graph_of(kind: str, n: int, groups: list[int] | None = None,
             **topology: Any) -> tuple[g.RoundGraph, RoutingMatrix]:
    """The round graph the executors get: built by the scheduler, carried by the matrix."""
    spec = TopologySpec(kind=kind, **topology)
    topo = build_topology(spec, n, groups=np.array(groups) if groups else None,
                          group_names=("a", "b"), seed=0)
    routing = RoutingMatrix.from_edges(
        job_id="j", clusters=["a"], node_cluster=np.zeros(topo.num_nodes, dtype=np.int64),
        edges=topo.edges, num_clients=n, aggregators=topo.aggregator_names, kind=kind,
        parent=topo.parent, exchange_period=topo.exchange_period)
    return g.RoundGraph.from_routing(routing), routing


class FakePool:
    """'Training' adds the client's index to every weight; client i has i + 1 samples."""

    def __init__(self) -> None:
        self.trained: list[tuple[str, int]] = []
        self.started: dict[tuple[str, int], float] = {}  # the model each training began from
        self.lock = threading.Lock()

    def samples(self, node: str) -> int:
        return g.client_index(node) + 1

    def put(self, weights: dict[str, np.ndarray]) -> Any:
        return {k: v.copy() for k, v in weights.items()}

    def resolve(self, handle: Any) -> dict[str, np.ndarray]:
        return handle

    def train(self, node: str, model: Any, round_index: int) -> Any:
        with self.lock:
            self.trained.append((node, round_index))
            self.started[(node, round_index)] = float(model["w"][0, 0])
        return {k: v + g.client_index(node) for k, v in model.items()}

    def personal_score(self, trained: Any) -> tuple[int, int]:
        return 1, 2


class Links:
    """Loopback stand-in for fabricd: hands the payload to the other cluster's transport."""

    def __init__(self) -> None:
        self.transports: dict[str, HybridTransport] = {}
        self.sent_bytes = 0

    def send_update(self, *, target_cluster: str, job_id: str, round: int, source_node: str,
                    target_node: str, message_id: str, payload: bytes) -> None:
        self.sent_bytes += len(payload)
        source = next(c for c, t in self.transports.items() if t.is_local(source_node))
        self.transports[target_cluster].deliver_remote(
            job_id=job_id, round=round, source_node=source_node, target_node=target_node,
            source_cluster=source, payload=payload)


def Fedavg() -> Any:  # noqa: N802 - a factory standing where the class used to
    return get_aggregator(AggregationSpec(name="fedavg"))


def build(graph: g.RoundGraph, placement: dict[str, str], *, aggregator: Any = None,
          fraction: float = 1.0, mixing_steps: int = 1
          ) -> tuple[dict[str, ClusterEngine], Links]:
    links = Links()
    engines = {}
    init = {"w": np.zeros((2, 2), dtype=np.float32)}
    for cluster in sorted(set(placement.values())):
        transport = HybridTransport(job_id="j", local_cluster=cluster, locate=placement.__getitem__,
                                    mailbox=Mailbox(), resolve=lambda h: h, codec=PlainCodec(),
                                    link=links, template=init)
        links.transports[cluster] = transport
        engines[cluster] = ClusterEngine(
            cluster_id=cluster, graph=graph, transport=transport, pool=FakePool(),
            initial_weights=init, make_aggregator=lambda node: aggregator() if aggregator
            else Fedavg(), make_inner_aggregator=Fedavg,
            evaluate_global=lambda w: (float(w["w"][0, 0]), 0.0), client_fraction=fraction,
            timeout=10, mixing_steps=mixing_steps)
    return engines, links


def run_round(engines: dict[str, ClusterEngine], r: int) -> dict[str, Any]:
    reports: dict[str, Any] = {}
    errors: list[BaseException] = []

    def one(cluster: str) -> None:
        try:
            reports[cluster] = engines[cluster].run_round(r)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(c,)) for c in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return reports


def test_star_across_two_clusters_averages_by_samples_and_counts_bytes() -> None:
    graph, _ = graph_of("star", 4)
    placement = {"server": "a", "c0": "a", "c1": "a", "c2": "b", "c3": "b"}
    engines, links = build(graph, placement)
    reports = run_round(engines, 1)
    # clients add their index to a zero model; fedavg weights client i by i + 1 samples
    expected = sum(i * (i + 1) for i in range(4)) / sum(i + 1 for i in range(4))
    assert reports["a"].accuracy == pytest.approx(expected)
    assert reports["b"].eval_weight == 0  # the server is not there
    assert engines["a"].current_model("server")["w"][0, 0] == pytest.approx(expected)
    model_bytes = 2 * 2 * 4
    # a: c0, c1 up to the server and the server down to c0, c1 stay inside cluster a
    assert reports["a"].bytes_intra == 4 * model_bytes
    assert reports["a"].messages_inter == 2          # down to c2, c3
    assert reports["b"].messages_inter == 2          # up from c2, c3
    assert reports["b"].bytes_intra == 0
    assert reports["a"].bytes_inter + reports["b"].bytes_inter == links.sent_bytes > 0
    assert reports["a"].personal_total + reports["b"].personal_total == 8
    assert reports["a"].participants + reports["b"].participants == 4
    # the next round starts every client, wherever it is, from the server's new model
    run_round(engines, 2)
    started = {**engines["a"].pool.started, **engines["b"].pool.started}
    assert all(started[(c, 2)] == pytest.approx(expected) for c in ("c0", "c1", "c2", "c3"))


def test_hybrid_groups_exchange_only_every_period() -> None:
    graph, _ = graph_of("hybrid", 4, groups=[0, 0, 1, 1], inter_cluster_period=2)
    placement = {"g:a": "a", "c0": "a", "c1": "a", "g:b": "b", "c2": "b", "c3": "b"}
    engines, links = build(graph, placement)
    first = run_round(engines, 1)
    assert first["a"].bytes_inter == first["b"].bytes_inter == 0
    group_a = (0 * 1 + 1 * 2) / 3
    assert first["a"].accuracy == pytest.approx(group_a)
    second = run_round(engines, 2)
    assert second["a"].messages_inter == second["b"].messages_inter == 1
    # after the exchange both groups hold the sample-weighted mean of the two group models
    a_model = group_a + group_a  # round 2 starts from round 1's group model
    b1 = (2 * 3 + 3 * 4) / 7
    b_model = b1 + (2 * 3 + 3 * 4) / 7
    consensus = (a_model * 3 + b_model * 7) / 10
    assert second["a"].accuracy == pytest.approx(consensus, rel=1e-5)
    assert second["b"].accuracy == pytest.approx(consensus, rel=1e-5)


def test_ring_peers_mix_with_neighbours_through_the_jobs_aggregator() -> None:
    graph, _ = graph_of("ring", 4)
    placement = {"c0": "a", "c1": "a", "c2": "b", "c3": "b"}
    engines, _ = build(graph, placement)
    reports = run_round(engines, 1)
    # c0 averages itself (0, 1 sample) with c1 (1, 2 samples) and c3 (3, 4 samples)
    c0 = (0 * 1 + 1 * 2 + 3 * 4) / 7
    assert engines["a"].current_model("c0")["w"][0, 0] == pytest.approx(c0)
    assert reports["a"].messages_inter == 2  # c1 -> c2 and c0 -> c3
    # with median, c0 takes the coordinate-wise median of {0, 1, 3}: 1, not the mean
    median = lambda: get_aggregator(AggregationSpec(name="median"))  # noqa: E731
    engines, _ = build(graph, placement, aggregator=median)
    run_round(engines, 1)
    assert engines["a"].current_model("c0")["w"][0, 0] == pytest.approx(1.0)


def test_mixing_steps_average_with_neighbours_again_across_clusters() -> None:
    graph, _ = graph_of("ring", 4)
    placement = {"c0": "a", "c1": "a", "c2": "b", "c3": "b"}
    weights = np.array([1.0, 2.0, 3.0, 4.0])  # samples of c0..c3
    ring = np.zeros((4, 4))
    for i in range(4):
        for j in (i - 1, i, i + 1):
            ring[i, j % 4] = weights[j % 4]
    mix = ring / ring.sum(axis=1, keepdims=True)  # a row: the node's sample-weighted average
    trained = np.arange(4.0)  # from 0, client i's training adds i
    for steps in (1, 2, 3):
        engines, links = build(graph, placement, mixing_steps=steps)
        reports = run_round(engines, 1)
        want = np.linalg.matrix_power(mix, steps) @ trained
        got = [engines[placement[f"c{i}"]].current_model(f"c{i}")["w"][0, 0] for i in range(4)]
        assert got == pytest.approx(want)
        # every step crosses the two inter-cluster edges both ways; the round's accuracy
        # is the models' after the last step
        assert reports["a"].messages_inter == 2 * steps
        assert reports["a"].accuracy == pytest.approx(
            float(np.average(want[:2], weights=weights[:2])))
    # what a round took, of every mixing kind, is forgotten once it is two rounds old
    assert any(key[1] == "peer3" for t in links.transports.values() for key in t._mailbox._taken)
    run_round(engines, 2)
    run_round(engines, 3)
    assert not any(key[0] == 1 for t in links.transports.values() for key in t._mailbox._taken)


def test_nodes_not_drawn_take_their_neighbours_training() -> None:
    """client_fraction < 1 in a decentralized job (engine.Draw): only the drawn nodes
    train; every drawn node and every neighbour of one averages its own model (trained or
    not) with its drawn neighbours' trained models, by samples; a node with no drawn node
    around it keeps its model and nothing is sent to it. (k_connected at 0.3 sat near
    chance when only drawn neighbours mixed, and when every node averaged every
    neighbour: the training was diluted.)"""
    n, fraction = 8, 0.25
    graph, _ = graph_of("ring", n)
    placement = {f"c{i}": "a" if i < 4 else "b" for i in range(n)}
    samples = np.arange(1.0, n + 1)  # of c0..c7

    def near(i: int) -> tuple[int, int]:
        return (i - 1) % n, (i + 1) % n

    for steps in (1, 2):
        engines, _ = build(graph, placement, fraction=fraction, mixing_steps=steps)
        models = np.zeros(n)
        kept = 0
        for r in (1, 2, 3, 4):
            drawn = set(g.participants(n, fraction, 0, r))
            assert 0 < len(drawn) < n
            mixing = drawn | {j for i in drawn for j in near(i)}
            trained = models + np.arange(n)  # client i's training adds i
            new = models.copy()
            for i in sorted(mixing):
                pick = [j for j in near(i) if j in drawn]
                own = trained[i] if i in drawn else models[i]
                new[i] = np.average([own] + [trained[j] for j in pick],
                                    weights=[samples[i]] + [samples[j] for j in pick])
            kept += n - len(mixing)
            for _step in range(2, steps + 1):  # the nodes that mixed, with each other
                new = np.array([np.average([new[j] for j in (i, *near(i)) if j in mixing],
                                           weights=[samples[j] for j in (i, *near(i))
                                                    if j in mixing])
                                if i in mixing else new[i] for i in range(n)])
            models = new
            reports = run_round(engines, r)
            got = [engines[placement[f"c{i}"]].current_model(f"c{i}")["w"][0, 0]
                   for i in range(n)]
            assert got == pytest.approx(models)
            ran = sorted(c for e in engines.values() for c, rr in e.pool.trained if rr == r)
            assert ran == sorted(f"c{i}" for i in drawn)
            assert sum(rep.participants for rep in reports.values()) == len(drawn)
            # step 1 sends only trained models across: one per drawn node with a neighbour
            # on the other cluster
            crossing = sum(1 for i in drawn for j in near(i)
                           if placement[f"c{i}"] != placement[f"c{j}"])
            if steps == 1:
                assert sum(rep.messages_inter for rep in reports.values()) == crossing
        assert kept  # the draws above leave a node with no drawn node around it


def test_a_neighbours_model_the_round_does_not_have_is_refused() -> None:
    """Decentralized at client_fraction < 1, a member may deliver a model only from a
    drawn neighbour (a later mixing step: from a neighbour that mixes) to a node that
    mixes in the round; anything else is refused by name and stored nowhere: a member
    cannot add a voter to a robust aggregator's count or park models, and the honest
    rounds that follow are those of a run without it."""
    n, fraction = 8, 0.25
    graph, _ = graph_of("ring", n)
    placement = {f"c{i}": "a" if i < 4 else "b" for i in range(n)}
    engines, _ = build(graph, placement, fraction=fraction)
    honest, _ = build(graph, placement, fraction=fraction)
    transport = engines["a"].transport
    w = {"w": np.full((2, 2), 1e6, np.float32)}

    def deliver(r: int, src: int, dst: int, kind: str = "peer") -> bool:
        return transport.deliver_remote(
            job_id="j", round=r, source_node=f"c{src}", target_node=f"c{dst}",
            source_cluster="b", payload=encode(w, kind=kind, samples=1),
            message_id=f"j/{r}/{kind}/c{src}/c{dst}")

    tried = set()
    for r in (1, 2, 3, 4, 5, 6):
        transport.begin_round(r)
        draw = engines["a"].draw(r)
        # c4 and c7 (cluster b) border cluster a's c3 and c0
        for src, dst in ((4, 3), (7, 0)):
            if f"c{dst}" in draw.mixing and f"c{src}" not in draw.trained:
                with pytest.raises(DeliveryRefused, match=f"c{src} was not drawn"):
                    deliver(r, src, dst)
                tried.add("not drawn")
            if f"c{dst}" not in draw.mixing:
                with pytest.raises(DeliveryRefused, match=f"c{dst} takes no neighbour"):
                    deliver(r, src, dst)
                tried.add("not mixing")
        with pytest.raises(DeliveryRefused, match="c5 is not a neighbour of c1"):
            deliver(r, 5, 1)
        with pytest.raises(DeliveryRefused, match="mixes 1 time"):
            deliver(r, 4, 3, kind="peer2")
        assert len(transport._mailbox) == 0
        run_round(engines, r)
        run_round(honest, r)
        for i in range(n):
            node, cluster = f"c{i}", placement[f"c{i}"]
            np.testing.assert_array_equal(engines[cluster].current_model(node)["w"],
                                          honest[cluster].current_model(node)["w"])
    assert tried == {"not drawn", "not mixing"}
    # what the round has is taken, once
    r = next(r for r in range(7, 40) if {"c4", "c3"} <= engines["a"].draw(r).mixing
             and "c4" in engines["a"].draw(r).trained)
    transport.begin_round(r)
    assert deliver(r, 4, 3) and not deliver(r, 4, 3)
    assert transport.receive(r, "peer", "c4", "c3", 1).samples == 1


def test_a_tree_update_the_round_does_not_have_is_refused() -> None:
    """Star at client_fraction 0.5: an update up only from a drawn client to its parent,
    down only from the parent to a drawn child; hybrid groups' models only in a round
    they exchange in. Anything else is refused by name, stored nowhere, and the rounds
    are those of a run without it."""
    graph, _ = graph_of("star", 6)
    placement = {"server": "a", **{f"c{i}": "a" if i < 3 else "b" for i in range(6)}}
    engines, _ = build(graph, placement, fraction=0.5)
    honest, _ = build(graph, placement, fraction=0.5)
    transport = engines["a"].transport
    w = {"w": np.full((2, 2), 1e6, np.float32)}

    def deliver(r: int, src: str, dst: str, kind: str, engine: str = "a") -> bool:
        return engines[engine].transport.deliver_remote(
            job_id="j", round=r, source_node=src, target_node=dst,
            source_cluster=placement[src], payload=encode(w, kind=kind, samples=1),
            message_id=f"j/{r}/{kind}/{src}/{dst}")

    for r in (1, 2, 3):
        for t in (transport, engines["b"].transport):
            t.begin_round(r)
        drawn = engines["a"].draw(r).trained
        idle = sorted({"c3", "c4", "c5"} - drawn)
        busy = sorted({"c3", "c4", "c5"} & drawn)
        assert idle and busy
        with pytest.raises(DeliveryRefused, match=f"{idle[0]} takes no part in round {r}"):
            deliver(r, idle[0], "server", "up")
        with pytest.raises(DeliveryRefused, match=f"c0 is not the parent of {busy[0]}"):
            deliver(r, busy[0], "c0", "up")
        with pytest.raises(DeliveryRefused, match=f"{busy[0]} is not the parent of c1"):
            deliver(r, busy[0], "c1", "down")
        with pytest.raises(DeliveryRefused, match=f"{idle[0]} takes no part"):
            deliver(r, "server", idle[0], "down", engine="b")
        assert len(transport._mailbox) == len(engines["b"].transport._mailbox) == 0
        run_round(engines, r)
        run_round(honest, r)
        np.testing.assert_array_equal(engines["a"].current_model("server")["w"],
                                      honest["a"].current_model("server")["w"])

    graph, _ = graph_of("hybrid", 4, groups=[0, 0, 1, 1], inter_cluster_period=2)
    placement = {"g:a": "a", "c0": "a", "c1": "a", "g:b": "b", "c2": "b", "c3": "b"}
    engines, _ = build(graph, placement)
    engines["a"].transport.begin_round(1)
    with pytest.raises(DeliveryRefused, match="do not exchange peer models in round 1"):
        deliver(1, "g:b", "g:a", "peer")
    engines["a"].transport.begin_round(2)
    assert deliver(2, "g:b", "g:a", "peer")


def test_a_nodes_model_crosses_to_each_neighbouring_cluster_once() -> None:
    """Full graph, two nodes a cluster: each node's model goes to the other cluster in one
    message for both its neighbours there (send_many), and every node still averages all
    four models, as the plan's transfer count says."""
    graph, routing = graph_of("full", 4)
    placement = {"c0": "a", "c1": "a", "c2": "b", "c3": "b"}
    engines, links = build(graph, placement)
    reports = run_round(engines, 1)
    mean = float(np.average(np.arange(4.0), weights=np.arange(1.0, 5.0)))  # i trained, i+1 samples
    for i in range(4):
        assert engines[placement[f"c{i}"]].current_model(f"c{i}")["w"][0, 0] == pytest.approx(mean)
    assert reports["a"].messages_inter == reports["b"].messages_inter == 2  # per edge: 4
    ci = np.array([0, 0, 1, 1])
    edges = np.array([(u, v) for u, v, _ in routing.edges()])
    assert inter_transfers(edges, ci, 1) == 4
    assert inter_transfers(edges, ci, 1, grouped=False) == 8
    assert links.sent_bytes == reports["a"].bytes_inter + reports["b"].bytes_inter


def test_a_message_for_a_group_of_nodes_is_checked_against_the_plan() -> None:
    graph, _ = graph_of("full", 4)
    placement = {"c0": "a", "c1": "a", "c2": "b", "c3": "b"}
    engines, _ = build(graph, placement)
    transport = engines["a"].transport
    transport.begin_round(1)
    w = {"w": np.ones((2, 2), np.float32)}

    def deliver(targets: str | None, *, kind: str = "peer", to: str = "@a") -> bool:
        meta = {} if targets is None else {TARGETS_KEY: targets}
        return transport.deliver_remote(
            job_id="j", round=1, source_node="c2", target_node=to, source_cluster="b",
            payload=encode(w, meta, kind=kind, samples=3), message_id=f"j/1/{kind}/c2/{to}")

    for targets, kind, to, needle in [("c0,c2", "peer", "@a", "each must be a node of this"),
                                      ("c0,c0", "peer", "@a", "once"),
                                      (None, "peer", "@a", "each must be"),
                                      ("c0,c1", "peer", "@b", "another cluster"),
                                      ("c0,c1", "up", "@a", "only neighbours' models")]:
        with pytest.raises(DeliveryRefused, match=needle):
            deliver(targets, kind=kind, to=to)
        assert len(transport._mailbox) == 0
    assert deliver("c0,c1")
    assert not deliver("c0,c1")  # a retried copy: applied once
    for node in ("c0", "c1"):
        assert transport.receive(1, "peer", "c2", node, 1).samples == 3


def test_mixing_steps_are_checked_in_the_job() -> None:
    from proto.job import JobSpec, JobSpecError
    JobSpec.from_dict({"topology": {"kind": "k_connected", "mixing_steps": 2},
                       "aggregation": {"name": "fedavg"}})
    with pytest.raises(JobSpecError, match="topology.mixing_steps"):
        JobSpec.from_dict({"topology": {"kind": "star", "mixing_steps": 2}})
    with pytest.raises(JobSpecError, match="topology.mixing_steps"):
        JobSpec.from_dict({"topology": {"kind": "ring", "mixing_steps": 9}})
    with pytest.raises(JobSpecError, match="topology.mixing_steps.*fedavgm"):
        JobSpec.from_dict({"topology": {"kind": "ring", "mixing_steps": 2},
                           "aggregation": {"name": "fedavgm"}})


def test_hierarchical_levels_pass_through_inner_aggregators() -> None:
    graph, _ = graph_of("hierarchical", 4, hierarchy_branching=2, hierarchy_levels=2)
    placement = {n: ("a" if n in ("c0", "c1", "agg1_0", "server") else "b") for n in graph.nodes}
    engines, _ = build(graph, placement)
    reports = run_round(engines, 1)
    expected = sum(i * (i + 1) for i in range(4)) / 10
    assert reports["a"].accuracy == pytest.approx(expected)
    run_round(engines, 2)
    assert engines["b"].pool.started[("c3", 2)] == pytest.approx(expected)


def test_client_fraction_trains_the_same_sample_on_every_cluster() -> None:
    graph, _ = graph_of("star", 10)
    placement = {n: ("a" if n in ("c0", "c1", "c2", "server") else "b") for n in graph.nodes}
    engines, _ = build(graph, placement, fraction=0.3)
    last = 0.0  # the initial model's value
    for r in (1, 2, 3):
        reports = run_round(engines, r)
        trained = sorted(n for e in engines.values() for n, rr in e.pool.trained if rr == r)
        expected = sorted(f"c{i}" for i in g.participants(10, 0.3, 0, r))
        assert trained == expected and len(trained) == 3
        assert sum(rep.participants for rep in reports.values()) == 3
        # a client sampled now starts from the server's latest model, not from its own
        # model of the last round it took part in (or the initial one)
        server = engines["a"]
        started = {**engines["a"].pool.started, **engines["b"].pool.started}
        assert all(started[(c, r)] == pytest.approx(last) for c in trained)
        last = float(server.current_model("server")["w"][0, 0])


def test_missing_neighbour_times_out_naming_node_and_cluster() -> None:
    graph, _ = graph_of("star", 2)
    placement = {"server": "a", "c0": "a", "c1": "b"}
    engines, _ = build(graph, placement)
    engines["a"].timeout = 0.2
    with pytest.raises(MessageTimeout, match=r"from node c1 \(cluster b\)"):
        engines["a"].run_round(1)


def test_a_failed_training_aborts_the_round_at_once_and_joins_every_thread() -> None:
    graph, _ = graph_of("star", 3)
    engines, _ = build(graph, {n: "a" for n in graph.nodes})
    engine = engines["a"]
    engine.timeout = 600  # a wait that is not cut short would hang the test

    def broken(node: str, model: Any, r: int) -> Any:
        raise RuntimeError(f"actor for {node} died")

    engine.pool.train = broken  # type: ignore[method-assign]
    before = threading.active_count()
    # every client's training fails; whichever fails first (the threads race) aborts it
    with pytest.raises(RuntimeError, match=r"actor for c[0-2] died"):
        engine.run_round(1)
    assert threading.active_count() == before  # the server's thread was joined


def test_the_root_sends_the_rounds_model_to_every_cluster_at_once() -> None:
    """A cluster slow to take the round's model holds back no other's: b and c each take
    theirs only once the other's is on its way (sent one cluster after the other, the
    first one's wait never ends)."""
    graph, _ = graph_of("star", 4)
    placement = {"server": "a", "c0": "a", "c1": "b", "c2": "c", "c3": "b"}
    engines, links = build(graph, placement)
    both = threading.Barrier(2)
    deliver = links.send_update

    def held(**kw: Any) -> None:
        if kw["target_cluster"] != "a" and kw["target_node"] in ("c1", "c2"):
            both.wait(timeout=60)  # broken (BrokenBarrierError) if the other never comes
        deliver(**kw)

    links.send_update = held  # type: ignore[method-assign]
    reports = run_round(engines, 1)
    expected = sum(i * (i + 1) for i in range(4)) / sum(i + 1 for i in range(4))
    assert reports["a"].accuracy == pytest.approx(expected)


def test_a_cluster_the_round_cannot_reach_fails_it_by_name_and_blocks_no_other() -> None:
    graph, _ = graph_of("star", 3)
    placement = {"server": "a", "c0": "a", "c1": "b", "c2": "c"}
    engines, links = build(graph, placement)
    deliver = links.send_update

    def b_unreachable(**kw: Any) -> None:
        if kw["target_cluster"] == "b":
            raise RemoteSendError(f"update {kw['message_id']} to cluster b: unreachable")
        deliver(**kw)

    links.send_update = b_unreachable  # type: ignore[method-assign]
    def run_c() -> None:
        with contextlib.suppress(Exception):  # its update may meet a's aborted round
            engines["c"].run_round(1)

    c = threading.Thread(target=run_c)
    c.start()
    with pytest.raises(RemoteSendError, match="to cluster b: unreachable"):
        engines["a"].run_round(1)  # c1 (on b) comes before c2 (on c)
    c.join()
    assert ("c2", 1) in engines["c"].pool.trained  # c had its model and trained


def test_updates_are_checked_against_the_plan() -> None:
    graph, _ = graph_of("star", 4)
    placement = {"server": "a", "c0": "a", "c1": "a", "c2": "b", "c3": "b"}
    engines, _ = build(graph, placement)
    transport = engines["a"].transport
    body = encode({"w": np.ones((2, 2), np.float32)}, kind="up", samples=3)
    fields = dict(job_id="j", source_node="c2", target_node="server", payload=body)
    with pytest.raises(DeliveryRefused, match="plan places it on 'b'"):
        transport.deliver_remote(round=1, source_cluster="a", **fields)  # c2 is on b
    with pytest.raises(DeliveryRefused, match="round 5"):
        transport.deliver_remote(round=5, source_cluster="b", **fields)
    with pytest.raises(DeliveryRefused, match="job 'x'"):
        transport.deliver_remote(round=1, source_cluster="b", **{**fields, "job_id": "x"})
    bad_shape = encode({"w": np.ones((3, 2), np.float32)}, kind="up", samples=3)
    with pytest.raises(DeliveryRefused, match="shape"):
        transport.deliver_remote(round=1, source_cluster="b", **{**fields, "payload": bad_shape})
    nan = encode({"w": np.full((2, 2), np.nan, np.float32)}, kind="up", samples=3)
    with pytest.raises(DeliveryRefused, match="NaN"):
        transport.deliver_remote(round=1, source_cluster="b", **{**fields, "payload": nan})
    extra = encode({"w": np.ones((2, 2), np.float32), "x": np.ones(1, np.float32)}, kind="up",
                   samples=3)
    with pytest.raises(DeliveryRefused, match="unexpected"):
        transport.deliver_remote(round=1, source_cluster="b", **{**fields, "payload": extra})
    state = encode({"w": np.ones((2, 2), np.float32)}, kind="state", samples=0)
    with pytest.raises(DeliveryRefused, match="plan places it on 'a'"):  # c0 lives on a
        transport.deliver_remote(round=1, source_cluster="b", job_id="j", source_node="c0",
                                 target_node="c0", payload=state)
    assert transport.deliver_remote(round=1, source_cluster="b", **fields)
    assert not transport.deliver_remote(round=1, source_cluster="b", **fields)  # a repeat


def test_a_members_negative_batchnorm_statistics_are_refused_and_nothing_is_kept() -> None:
    """A variance below 0 is finite, so the NaN check let it through: averaged into the
    job's model, it made sqrt(var + eps) NaN in every evaluation after. Refused as it
    arrives, naming the tensor; the same update with honest statistics is taken."""
    template = {"conv.weight": np.zeros((2, 2), np.float32),
                "bn.running_mean": np.zeros(2, np.float32),
                "bn.running_var": np.ones(2, np.float32),
                "bn.num_batches_tracked": np.array(3, np.int64)}
    mailbox = Mailbox()
    transport = HybridTransport(job_id="j", local_cluster="a",
                                locate={"server": "a", "c0": "b"}.__getitem__,
                                mailbox=mailbox, resolve=lambda h: h, codec=PlainCodec(),
                                link=Links(), template=template)
    fields = dict(job_id="j", source_node="c0", target_node="server", round=1,
                  source_cluster="b")
    for name, bad in (("bn.running_var", np.array([1.0, -0.5], np.float32)),
                      ("bn.num_batches_tracked", np.array(-1, np.int64))):
        body = encode({**template, name: bad}, kind="up", samples=3)
        with pytest.raises(DeliveryRefused, match=f"{name!r} holds negative values"):
            transport.deliver_remote(payload=body, **fields)
        assert len(mailbox) == 0
    # a mean below 0 is a mean: taken
    honest = {**template, "bn.running_mean": np.array([-3.0, 2.0], np.float32)}
    assert transport.deliver_remote(payload=encode(honest, kind="up", samples=3), **fields)
    assert len(mailbox) == 1


def test_a_migrating_nodes_state_that_lies_is_refused_and_nothing_is_taken() -> None:
    """restore_aggregator (a node moving in, a checkpoint) checks the state against the
    job's model before it takes any of it: a negative second moment, a hybrid anchor of
    another shape or with NaN; AggregationError, and the node has no state after."""
    from worker.aggregators import AggregationError
    from worker.executor.engine import ANCHOR

    graph, _ = graph_of("star", 2)
    engines, _ = build(graph, {"server": "a", "c0": "a", "c1": "b"},
                       aggregator=lambda: get_aggregator(AggregationSpec(name="fedadam")))
    engine = engines["a"]
    honest = {"m/w": np.zeros((2, 2)), "v/w": np.ones((2, 2)), "t/w": np.array(3)}
    for lie, needle in (({"v/w": -np.ones((2, 2))}, "negative"),
                        ({ANCHOR + "w": np.zeros((3, 2))}, "anchor tensor 'w' has shape"),
                        ({ANCHOR + "w": np.full((2, 2), np.nan)}, "anchor tensor 'w' holds NaN")):
        with pytest.raises(AggregationError, match=needle):
            engine.restore_aggregator("server", {**honest, **lie})
        assert engine.aggregator_state("server") == {}
    engine.restore_aggregator("server", {**honest, ANCHOR + "w": np.ones((2, 2))})
    assert set(engine.aggregator_state("server")) == {"m/w", "v/w", "t/w", ANCHOR + "w"}


def test_a_member_cannot_inflate_its_weight_in_an_average() -> None:
    graph, _ = graph_of("star", 2)
    placement = {"server": "a", "c0": "a", "c1": "b"}
    engines, links = build(graph, placement)
    honest = run_round(engines, 1)["a"].accuracy
    # cluster b claims 10^9 samples for c1: the server weighs c1 by the plan's 2 samples
    engines, links = build(graph, placement)
    original = links.send_update

    def lying(**kw: Any) -> None:
        if kw["source_node"] == "c1":
            p = decode(kw["payload"])
            kw["payload"] = encode(p.tensors, p.metadata, kind=p.kind, samples=10**9)
        original(**kw)

    links.send_update = lying  # type: ignore[method-assign]
    assert run_round(engines, 1)["a"].accuracy == pytest.approx(honest)


def test_payload_header_carries_kind_and_samples_and_is_checked() -> None:
    payload = decode(encode({"x": np.arange(3, dtype=np.float32)}, {"k": "v"}, kind="up",
                            samples=17))
    assert payload.samples == 17 and payload.kind == "up" and payload.metadata["k"] == "v"
    assert np.array_equal(payload.tensors["x"], np.arange(3, dtype=np.float32))
    for bad in (b"\xff" * 12, b"\x08" + b"\x00" * 7 + b"{}      ",
                encode({"x": np.zeros(1, np.float32)}, kind="up", samples=1)[:-1]):
        with pytest.raises(PayloadError):
            decode(bad)


def test_mailbox_hands_each_message_out_once_and_forgets_finished_rounds() -> None:
    from worker.executor.mailbox import Envelope

    box = Mailbox()
    key = (1, "up", "c0", "server")
    assert box.put(key, Envelope({"w": 1}, 1, 4, remote=True))
    assert box.take(key, 1).samples == 1
    assert not box.put(key, Envelope({"w": 2}, 2, 4, remote=True))  # a replay after take
    assert len(box) == 0
    box.put((1, "up", "c1", "server"), Envelope({}, 1, 4, remote=True))  # never read
    box.forget_before(2, ("up",))
    assert len(box) == 0
    # a message wakes its own reader, while another keeps waiting for its own
    got: list[int] = []
    reader = threading.Thread(target=lambda: got.append(box.take((2, "up", "c0", "s"), 10).samples))
    reader.start()
    box.put((2, "up", "c9", "s"), Envelope({}, 9, 4, remote=True))
    box.put((2, "up", "c0", "s"), Envelope({}, 5, 4, remote=True))
    reader.join(10)
    assert got == [5] and len(box) == 1


@pytest.mark.parametrize("fraction", [1.0, 0.3])
@pytest.mark.parametrize("kind", ["star", "hybrid", "hierarchical", "k_connected", "ring", "full"])
def test_every_aggregator_a_job_accepts_runs_its_rounds(kind: str, fraction: float) -> None:
    """Every aggregator JobSpec accepts on a topology and client_fraction runs there: a
    round may leave an aggregator few models (krum failed round 1 of a hierarchy's root
    and a hybrid group at 0.3; now it takes their median), and what the job refuses it
    refuses with a reason naming the key."""
    from proto.job import JobSpec, JobSpecError
    from worker.aggregators import AGGREGATOR_NAMES

    n = 20
    extra = {"k_connected_mode": "random"} if kind == "k_connected" else {}
    graph, _ = graph_of(kind, n, groups=[0] * 10 + [1] * 10, **extra)
    placement = {node: "a" if node in graph.aggregators or g.client_index(node) < 10 else "b"
                 for node in graph.nodes}
    ran = []
    for name in AGGREGATOR_NAMES:
        job = {"data": {"number_of_clients": n}, "training": {"client_fraction": fraction},
               "topology": {"kind": kind, **extra}, "aggregation": {"name": name}}
        try:
            spec = JobSpec.from_dict(job)
        except JobSpecError as exc:
            assert "is invalid: expected" in str(exc)
            continue
        engines, _ = build(graph, placement, fraction=fraction,
                           aggregator=lambda spec=spec: get_aggregator(spec.aggregation))
        for r in (1, 2, 3):
            run_round(engines, r)
        ran.append(name)
    assert {"fedavg", "median"} <= set(ran)
    # krum: refused on a ring (a node has 3 models, krum_byzantine 1 needs 4) and in any
    # decentralized job at a fraction < 1; a tree's aggregator with too few takes the median
    assert ("krum" in ran) == (kind in ("star", "hybrid", "hierarchical")
                               or (kind != "ring" and fraction == 1.0))
