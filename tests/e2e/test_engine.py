"""The per-cluster round engine on two in-process clusters joined by a loopback link.

Checks the dataflow of each topology against a hand computation and that bytes are
accounted on the path each message really took.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from worker.executor import graph as g
from worker.executor.engine import ClusterEngine, weighted_average
from worker.executor.mailbox import Mailbox, MessageTimeout
from worker.executor.transport import HybridTransport, samples_of, with_samples


class PlainCodec:
    def compress(self, weights: dict[str, np.ndarray], edge: tuple[str, ...]) -> bytes:
        return st_save(weights)

    def decompress(self, payload: bytes, edge: tuple[str, ...]) -> dict[str, np.ndarray]:
        return dict(st_load(payload))


class FakePool:
    """'Training' adds the client's index to every weight; client i has i + 1 samples."""

    def __init__(self) -> None:
        self.trained: list[tuple[str, int]] = []
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
        self.transports[target_cluster].deliver_remote(message_id, payload)


class Fedavg:
    def aggregate(self, global_weights, updates):
        return weighted_average(updates)


def build(graph: g.RoundGraph, placement: dict[str, str]) -> tuple[dict[str, ClusterEngine], Links]:
    links = Links()
    engines = {}
    init = {"w": np.zeros((2, 2), dtype=np.float32)}
    for cluster in sorted(set(placement.values())):
        transport = HybridTransport(job_id="j", local_cluster=cluster, locate=placement.__getitem__,
                                    mailbox=Mailbox(), resolve=lambda h: h, codec=PlainCodec(),
                                    link=links)
        links.transports[cluster] = transport
        engines[cluster] = ClusterEngine(
            cluster_id=cluster, graph=graph, transport=transport, pool=FakePool(),
            initial_weights=init, make_aggregator=lambda node: Fedavg(),
            make_inner_aggregator=Fedavg, evaluate_global=lambda w: (float(w["w"][0, 0]), 0.0),
            timeout=10)
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
    graph = g.star(4)
    placement = {"server": "a", "c0": "a", "c1": "a", "c2": "b", "c3": "b"}
    engines, links = build(graph, placement)
    reports = run_round(engines, 1)
    # clients add their index to a zero model; fedavg weights client i by i + 1 samples
    expected = sum(i * (i + 1) for i in range(4)) / sum(i + 1 for i in range(4))
    (evaluation,) = reports["a"].evaluations
    assert evaluation.node == "server"
    assert evaluation.accuracy == pytest.approx(expected)
    assert engines["b"].current_model("c3")["w"][0, 0] == pytest.approx(expected)
    model_bytes = 2 * 2 * 4
    # a: c0, c1 up to the server and the server down to c0, c1 stay inside cluster a
    assert reports["a"].bytes_intra == 4 * model_bytes
    assert reports["a"].messages_inter == 2          # down to c2, c3
    assert reports["b"].messages_inter == 2          # up from c2, c3
    assert reports["b"].bytes_intra == 0
    assert reports["a"].bytes_inter + reports["b"].bytes_inter == links.sent_bytes > 0
    assert reports["a"].personal_total + reports["b"].personal_total == 8


def test_hybrid_groups_exchange_only_every_period() -> None:
    graph = g.hybrid({"a": ["c0", "c1"], "b": ["c2", "c3"]}, inter_cluster_period=2)
    placement = {"g:a": "a", "c0": "a", "c1": "a", "g:b": "b", "c2": "b", "c3": "b"}
    engines, links = build(graph, placement)
    first = run_round(engines, 1)
    assert first["a"].bytes_inter == first["b"].bytes_inter == 0
    group_a = (0 * 1 + 1 * 2) / 3
    assert first["a"].evaluations[0].accuracy == pytest.approx(group_a)
    second = run_round(engines, 2)
    assert second["a"].messages_inter == second["b"].messages_inter == 1
    # after the exchange both groups hold the sample-weighted mean of the two group models
    a_model = group_a + group_a  # round 2 starts from round 1's group model
    b1 = (2 * 3 + 3 * 4) / 7
    b_model = b1 + (2 * 3 + 3 * 4) / 7
    consensus = (a_model * 3 + b_model * 7) / 10
    assert second["a"].evaluations[0].accuracy == pytest.approx(consensus, rel=1e-5)
    assert second["b"].evaluations[0].accuracy == pytest.approx(consensus, rel=1e-5)


def test_ring_peers_average_with_neighbours() -> None:
    graph = g.decentralized("ring", 4, [(0, 1), (1, 2), (2, 3), (3, 0)])
    placement = {"c0": "a", "c1": "a", "c2": "b", "c3": "b"}
    engines, _ = build(graph, placement)
    reports = run_round(engines, 1)
    # c0 averages itself (0, 1 sample) with c1 (1, 2 samples) and c3 (3, 4 samples)
    c0 = (0 * 1 + 1 * 2 + 3 * 4) / 7
    evaluations = {e.node: e.accuracy for r in reports.values() for e in r.evaluations}
    assert evaluations["c0"] == pytest.approx(c0)
    assert reports["a"].messages_inter == 2  # c1 -> c2 and c0 -> c3


def test_hierarchical_levels_pass_through_inner_aggregators() -> None:
    graph = g.hierarchical(4, branching=2, levels=2)
    placement = {n: ("a" if n in ("c0", "c1", "agg1_0", "server") else "b") for n in graph.nodes}
    engines, _ = build(graph, placement)
    reports = run_round(engines, 1)
    expected = sum(i * (i + 1) for i in range(4)) / 10
    assert reports["a"].evaluations[0].accuracy == pytest.approx(expected)
    assert engines["b"].current_model("c3")["w"][0, 0] == pytest.approx(expected)


def test_missing_neighbour_times_out_naming_node_and_cluster() -> None:
    graph = g.star(2)
    placement = {"server": "a", "c0": "a", "c1": "b"}
    engines, _ = build(graph, placement)
    engines["a"].timeout = 0.2
    with pytest.raises(MessageTimeout, match=r"from node c1 \(cluster b\)"):
        engines["a"].run_round(1)


def test_sample_count_rides_in_safetensors_metadata() -> None:
    payload = with_samples(st_save({"x": np.arange(3, dtype=np.float32)}), 17)
    assert samples_of(payload) == 17
    assert np.array_equal(st_load(payload)["x"], np.arange(3, dtype=np.float32))
    with pytest.raises(ValueError):
        samples_of(st_save({"x": np.zeros(1, dtype=np.float32)}))
    with pytest.raises(ValueError):
        samples_of(b"\xff" * 12)
