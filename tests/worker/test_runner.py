"""run_job on the in-process context: accuracy, equivalences between topologies, remote
delivery through a transport, and bad jobs rejected before any actor starts."""

from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict
from collections.abc import Hashable, Sequence
from pathlib import Path

import numpy as np
import pytest

from proto.job import (
    AggregationSpec,
    DataSpec,
    JobSpec,
    ModelSpec,
    PlacementSpec,
    TopologySpec,
    TrainingSpec,
)
from worker.context import InProcessContext, PlacementError
from worker.runner import JobError, RoundMetrics, run_job


def job(kind: str = "star", clients: int = 6, rounds: int = 3, **topology: object) -> JobSpec:
    return JobSpec(job_id=f"t-{kind}", seed=3,
                   data=DataSpec(number_of_clients=clients),
                   topology=TopologySpec(kind=kind, **topology),  # type: ignore[arg-type]
                   training=TrainingSpec(federated_learning_rounds=rounds, number_of_epochs=1),
                   placement=PlacementSpec(max_materialized=3))


def run(spec: JobSpec, **kw: object) -> list[RoundMetrics]:
    with InProcessContext(num_cpus=2) as ctx:
        return list(run_job(spec, ctx, **kw))  # type: ignore[arg-type]


def test_digits_star_fedavg_30_clients_30_rounds_reaches_080(
        digits_star_metrics: list[RoundMetrics]) -> None:
    spec = JobSpec(job_id="digits-star", seed=0)  # what the fixture ran: digits, 30 clients,
    assert (spec.data.number_of_clients, spec.data.dirichlet_beta) == (30, 0.5)  # dirichlet,
    assert (spec.topology.kind, spec.aggregation.name) == ("star", "fedavg")  # star, fedavg
    assert (spec.training.federated_learning_rounds, spec.training.number_of_epochs) == (30, 2)
    metrics = digits_star_metrics
    assert [m.round for m in metrics] == list(range(1, 31))
    assert metrics[-1].accuracy >= 0.80
    assert metrics[-1].accuracy > metrics[0].accuracy
    assert metrics[-1].accuracy_of == "global_model"
    assert all(m.clients_trained == 30 for m in metrics)
    model_bytes = metrics[0].bytes_intra // 60  # 30 models down + 30 updates up
    assert metrics[0].bytes_intra == 60 * model_bytes and metrics[0].bytes_inter == 0
    assert metrics[-1].actors_created == 8  # max_materialized, recycled for 30 clients


@pytest.mark.parametrize("kind", ["hierarchical", "full", "hybrid"])
def test_fedavg_topologies_that_must_equal_star(kind: str) -> None:
    """With FedAvg, averaging in levels, over a full graph, or in groups exchanging every
    round all compute the same sample-weighted global mean as the star."""
    star = run(job("star"))
    other = run(job(kind, hierarchy_branching=2))
    assert [m.accuracy for m in other] == pytest.approx([m.accuracy for m in star], abs=1e-9)


def test_decentralized_ring_reports_node_mean_and_consensus() -> None:
    metrics = run(job("ring", clients=5, rounds=2))
    assert all(m.accuracy_of == "mean_node_models" for m in metrics)
    assert all(m.messages_intra == 10 for m in metrics)  # 5 nodes x 2 neighbours
    assert "consensus_accuracy" in metrics[-1].extra
    assert "consensus_accuracy" not in metrics[0].extra


def test_client_fraction_trains_a_seeded_subset() -> None:
    spec = job()
    spec = dataclasses.replace(spec, training=dataclasses.replace(spec.training,
                                                                   client_fraction=0.5))
    metrics = run(spec)
    assert all(m.clients_trained == 3 for m in metrics)
    assert [m.accuracy for m in metrics] == [m.accuracy for m in run(spec)]


class Loopback:
    """The remote halves of two runners meeting in memory (fabricd in the real system)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.boxes: dict[tuple[Hashable, int], dict[Hashable, bytes]] = defaultdict(dict)

    def send(self, src: Hashable, dst: Hashable, weights_bytes: bytes, round: int) -> None:
        with self.cond:
            self.boxes[(dst, round)][src] = bytes(weights_bytes)
            self.cond.notify_all()

    def receive(self, dst: Hashable, round: int, senders: Sequence[Hashable]
                ) -> list[tuple[Hashable, bytes]]:
        with self.cond:
            box = self.boxes[(dst, round)]
            if not self.cond.wait_for(lambda: all(s in box for s in senders), timeout=60):
                raise TimeoutError(f"{dst} round {round}")
            return [(s, box[s]) for s in senders]


def test_two_clusters_through_a_transport_match_one_cluster() -> None:
    spec = job("star", clients=6, rounds=3)
    single = run(spec)
    transport, results = Loopback(), {}

    def cluster(name: str, clients: list[int], aggregators: list[str]) -> None:
        with InProcessContext(num_cpus=2) as ctx:
            results[name] = list(run_job(spec, ctx, transport=transport, local_clients=clients,
                                         local_aggregators=aggregators))

    threads = [threading.Thread(target=cluster, args=("a", [0, 1, 2], ["server"])),
               threading.Thread(target=cluster, args=("b", [3, 4, 5], []))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [m.accuracy for m in results["a"]] == [m.accuracy for m in single]
    assert all(np.isnan(m.accuracy) for m in results["b"])  # the server is not there
    assert all(m.bytes_inter > 0 for m in results["a"] + results["b"])
    assert results["b"][0].messages_inter == 3 and results["a"][0].messages_inter == 3


def npz(tmp_path: Path, name: str, **arrays: np.ndarray) -> str:
    path = tmp_path / f"{name}.npz"
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return f"npz:{path}"


def bad_jobs(tmp_path: Path) -> list[tuple[JobSpec, str]]:
    base = job()
    x, y = np.zeros((20, 4), np.float32), np.arange(20) % 2
    (tmp_path / "tri.csv").write_text("0,1\n1,0,1\n")
    (tmp_path / "asym.csv").write_text("0,1,0,0,0,0\n" + "0,0,0,0,0,0\n" * 5)
    return [
        (dataclasses.replace(base, model=ModelSpec(name="resnet")), "unknown model 'resnet'"),
        (dataclasses.replace(base, aggregation=AggregationSpec(name="fedsgd")),
         "unknown aggregation.name 'fedsgd'"),
        (job("tree"), "unknown topology.kind 'tree'"),
        (job("custom", adjacency_file=str(tmp_path / "tri.csv")),
         "row 2 has 3 columns but the file has 2 rows"),
        (job("custom", adjacency_file=str(tmp_path / "asym.csv")),
         "not symmetric: row 1, column 2"),
        (dataclasses.replace(base, data=DataSpec(dataset=npz(tmp_path, "missing", x_train=x, y_train=y),
                                                 number_of_clients=2)),
         "missing array(s) x_test, y_test"),
        (dataclasses.replace(base, data=DataSpec(
            dataset=npz(tmp_path, "short", x_train=x, y_train=y[:5], x_test=x, y_test=y),
            number_of_clients=2)), "x_train has 20 samples but y_train has 5"),
        (dataclasses.replace(base, training=TrainingSpec(optimizer="lbfgs")), "lbfgs"),
        (dataclasses.replace(base, placement=PlacementSpec(placement_group_strategy="RANDOM")),
         "placement.placement_group_strategy must be one of SPREAD, PACK"),
    ]


def test_bad_jobs_fail_before_any_actor(tmp_path: Path) -> None:
    for spec, message in bad_jobs(tmp_path):
        with InProcessContext(num_cpus=2) as ctx:
            with pytest.raises(JobError) as err:
                run_job(spec, ctx)
            assert message in str(err.value), str(err.value)
            assert f"job {spec.job_id!r}" in str(err.value)
            assert ctx.actors_created == 0


def test_cluster_too_small_fails_at_once() -> None:
    spec = job()
    with InProcessContext(num_cpus=1) as ctx:
        with pytest.raises(PlacementError, match=r"3 bundle\(s\) x \{'CPU': 1.0\}"):
            run_job(spec, ctx, cpus_per_node=1.0)
        assert ctx.actors_created == 0


def test_hybrid_groups_exchange_every_period() -> None:
    metrics = run(job("hybrid", clients=6, rounds=4, hierarchy_branching=3,
                      inter_cluster_period=2))
    assert [m.extra.get("exchanged", 0.0) for m in metrics] == [0.0, 1.0, 0.0, 1.0]
    # per round: 6 models down + 6 updates up; exchange rounds add 2 group->group messages
    assert [m.messages_intra for m in metrics] == [12, 14, 12, 14]
    assert all(m.accuracy_of == "mean_group_models" for m in metrics)
