"""fedcore.metrics: a real in-process job feeds RunMetrics round by round; its /metrics
endpoint is scraped after every round and parsed with prometheus_client.parser."""

from __future__ import annotations

import math
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fedcore.metrics import RunMetrics, parse_endpoint
from proto.job import DataSpec, JobSpec, TrainingSpec
from worker.context import InProcessContext

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(address: str) -> Samples:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_executor_metrics_follow_a_real_job() -> None:
    spec = JobSpec(job_id="m", seed=4, data=DataSpec(number_of_clients=4),
                   training=TrainingSpec(federated_learning_rounds=3, number_of_epochs=1))
    job = {("job", "m")}
    from fedpilot.loopback import LoopbackMesh
    from scheduler.run.driver import Driver
    from worker.executor.runtime import runtime_factory

    mesh = LoopbackMesh(["a"], lambda cid: runtime_factory(InProcessContext(), cid), capacity=4)
    with RunMetrics("executor", cluster="a") as metrics:
        address = metrics.serve("127.0.0.1:0")
        seen = []

        def progress(m: object, total: int) -> None:
            metrics.observe_round(spec.job_id, m)
            seen.append(m)
            s = scrape(address)  # during the job, after each round
            assert s[("fedpilot_executor_round", frozenset(job))] == m.round  # type: ignore[attr-defined]
            assert s[("fedpilot_executor_accuracy", frozenset(job))] == pytest.approx(
                m.accuracy)  # type: ignore[attr-defined]

        driver = Driver(spec, mesh.clusters(), mesh, backend="inprocess", progress=progress)
        try:
            driver.run()
        finally:
            driver.close()
        s = scrape(address)
        assert s[("fedpilot_executor_rounds_total", frozenset(job))] == 3
        assert s[("fedpilot_executor_round_seconds_count", frozenset(job))] == 3
        assert s[("fedpilot_executor_round_seconds_sum", frozenset(job))] == pytest.approx(
            sum(m.seconds for m in seen))
        assert s[("fedpilot_executor_loss", frozenset(job))] == pytest.approx(seen[-1].loss)
        intra = s[("fedpilot_executor_bytes_total", frozenset(job | {("scope", "intra")}))]
        assert intra == sum(m.bytes_intra for m in seen) > 0
        assert s[("fedpilot_executor_bytes_total", frozenset(job | {("scope", "inter")}))] == 0
        assert s[("fedpilot_executor_info", frozenset({("cluster", "a")}))] == 1
    with pytest.raises(OSError):  # closed with the context
        scrape(address)


def test_scheduler_metrics_count_cluster_losses_and_nan_accuracy() -> None:
    with RunMetrics("scheduler") as metrics:
        address = metrics.serve("127.0.0.1:0")
        metrics.round_finished("j", 1, seconds=2.0, accuracy=math.nan, loss=0.5,
                               bytes_intra=10, bytes_inter=20, training_seconds=1.5,
                               epsilon=0.75)
        metrics.cluster_lost("j", "c")
        metrics.cluster_lost("j", "c")
        s = scrape(address)
    assert s[("fedpilot_scheduler_cluster_losses_total", frozenset({("job", "j"), ("cluster", "c")}))] == 2
    assert math.isnan(s[("fedpilot_scheduler_accuracy", frozenset({("job", "j")}))])
    assert s[("fedpilot_scheduler_training_seconds_total", frozenset({("job", "j")}))] == 1.5
    assert s[("fedpilot_scheduler_privacy_epsilon", frozenset({("job", "j")}))] == 0.75
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_endpoint("9101")
    with pytest.raises(ValueError):
        RunMetrics("worker")


def test_submit_rejects_a_bad_metrics_endpoint_before_starting(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from scheduler.cli import main

    job = tmp_path / "job.toml"
    job.write_text("[data]\nnumber_of_clients = 3\n")
    assert main(["submit", str(job), "--local", "1", "--backend", "inprocess", "--workdir",
                 str(tmp_path / "tb"), "--metrics", "nonsense"]) == 2
    err = capsys.readouterr().err.strip()
    assert "metrics endpoint 'nonsense': expected HOST:PORT" in err and "\n" not in err
    assert not (tmp_path / "tb").exists()


def test_each_executor_serves_its_own_rounds_and_fabricd_passes_the_endpoint(
        tmp_path: object) -> None:
    from pathlib import Path

    from fabricd.executors import ExecutorLauncher
    from fedpilot.loopback import LoopbackMesh
    from scheduler.run.driver import Driver
    from worker.executor.runtime import runtime_factory

    launcher = ExecutorLauncher(cluster_id="a", bridge_socket=Path("/x.sock"), ray_address="local",
                                log_dir=Path(str(tmp_path)), metrics_endpoint="127.0.0.1:0")
    command = launcher.command_for("j")
    assert command[command.index("--metrics") + 1] == "127.0.0.1:0"

    from proto.job import PlacementSpec

    spec = JobSpec(job_id="m2", seed=4, data=DataSpec(number_of_clients=6),
                   training=TrainingSpec(federated_learning_rounds=2, number_of_epochs=1),
                   placement=PlacementSpec(strategy="round_robin"))
    mesh = LoopbackMesh(["a", "b"], lambda cid: runtime_factory(InProcessContext(), cid),
                        capacity=6)
    served = {}
    for cid, service in mesh.services.items():
        service.metrics = RunMetrics("executor", cluster=cid)
        served[cid] = service.metrics.serve("127.0.0.1:0")
    driver = Driver(spec, mesh.clusters(), mesh, backend="inprocess")
    try:
        summary = driver.run().summary
    finally:
        driver.close()
    job = {("job", "m2")}
    inter = 0
    for cid, address in served.items():
        s = scrape(address)
        assert s[("fedpilot_executor_round", frozenset(job))] == 2
        assert s[("fedpilot_executor_rounds_total", frozenset(job))] == 2
        inter += s[("fedpilot_executor_bytes_total", frozenset(job | {("scope", "inter")}))]
        mesh.services[cid].metrics.close()
    assert inter == summary.bytes_inter_total > 0


def test_scheduler_metrics_count_contributions_their_staleness_and_the_dropped() -> None:
    with RunMetrics("scheduler") as metrics:
        address = metrics.serve("127.0.0.1:0")
        for r, seconds, accuracy, contributions, dropped in (
                (1, 1.5, 0.55, {"a": {"round": 1, "staleness": 0},
                                "b": {"round": 1, "staleness": 0}}, 1),
                (2, 2.0, 0.72, {"a": {"round": 2, "staleness": 0},
                                "c": {"round": 1, "staleness": 1}}, 0),
                (3, 4.0, 0.71, {"c": {"round": 3, "staleness": 0, "earlier": 1}}, 0)):
            metrics.observe_round("j", SimpleNamespace(
                round=r, seconds=seconds, accuracy=accuracy, loss=1.0, bytes_intra=0,
                bytes_inter=0, contributions=contributions, dropped=dropped))
        s = scrape(address)
    # seconds of rounds until the accuracy first reached each threshold, set once
    reached = {labels: v for (name, labels), v in s.items()
               if name == "fedpilot_scheduler_time_to_accuracy_seconds"}
    assert reached == {frozenset({("job", "j"), ("threshold", "0.5")}): 1.5,
                       frozenset({("job", "j"), ("threshold", "0.6")}): 3.5,
                       frozenset({("job", "j"), ("threshold", "0.7")}): 3.5}
    job = frozenset({("job", "j")})
    assert s[("fedpilot_scheduler_contributions_total", job | {("cluster", "a")})] == 2
    # c's late and fresh contributions met in aggregation 3 (its newest, "earlier": 1)
    assert s[("fedpilot_scheduler_contributions_total", job | {("cluster", "c")})] == 3
    assert s[("fedpilot_scheduler_contributions_dropped_total", job)] == 1
    assert s[("fedpilot_scheduler_contribution_staleness_count", job)] == 5
    assert s[("fedpilot_scheduler_contribution_staleness_sum", job)] == 1
