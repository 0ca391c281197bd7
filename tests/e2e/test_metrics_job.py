"""Must-show 1 (daemon side): a 3-cluster job over real daemons with /metrics on; every
endpoint is scraped and parsed during and after the job, the byte counters match the
daemons' status and summary.json's per-cluster figures, and a foreign peer is counted.
Must-show 5 on the same job: `fedpilot-scheduler status` on its run directory shows the
current round while it runs. Where a `prometheus` binary is installed (Debian's package; `make test` installs it best
effort), a real Prometheus server scrapes the job and its HTTP API returns the series."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fedcore.metrics import RunMetrics
from proto.job import JobSpec
from scheduler.cli import main as cli_main
from scheduler.run.driver import Driver
from scheduler.run.mesh import BridgeChannel, daemon_status
from scheduler.rundir.results import write_results
from scheduler.rundir.status import RunRecorder, read_run
from scheduler.testbed import LocalTestbed, fabricd_command, free_port, set_toml_value

pytestmark = pytest.mark.slow

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(endpoint: str) -> Samples:
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def by_cluster(samples: Samples, name: str) -> dict[str, float]:
    return {dict(labels)["cluster"]: v for (n, labels), v in samples.items() if n == name}


@dataclass
class Ran:
    tb: LocalTestbed
    names: list[str]
    endpoints: dict[str, str]
    summary: Any
    scrapes_during: int
    after: dict[str, Samples] = field(default_factory=dict)
    prometheus: str = ""  # its address, if one ran
    run_dir: Path = Path()
    scheduler_metrics: Samples = field(default_factory=dict)  # fedpilot_scheduler_* at the end
    status_seen: list[tuple[str, int]] = field(default_factory=list)  # (state, round) while running
    executors: dict[str, list[Samples]] = field(default_factory=dict)  # each one's scrapes


def start_prometheus(root: Path, targets: list[str]) -> tuple[subprocess.Popen[bytes], str] | None:
    exe = shutil.which("prometheus")
    if exe is None:
        return None
    config = root / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n"
                      "  - job_name: fabricd\n    static_configs:\n"
                      f"      - targets: {json.dumps(targets)}\n")
    address = f"127.0.0.1:{free_port()}"
    log = (root / "prometheus.log").open("wb")
    proc = subprocess.Popen([exe, f"--config.file={config}", f"--storage.tsdb.path={root / 'tsdb'}",
                             f"--web.listen-address={address}"], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://{address}/-/ready", timeout=2) as resp:
                if resp.status == 200:
                    return proc, address
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"prometheus did not start:\n{(root / 'prometheus.log').read_text()}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ran]:
    """A 3-cluster job over real daemons, scraped during and after (and by Prometheus)."""
    root = tmp_path_factory.mktemp("metrics-job")
    spec = JobSpec.from_dict({
        "job": {"id": "metrics-job", "seed": 1},
        "data": {"number_of_clients": 6, "dirichlet_beta": 0.5},
        "training": {"federated_learning_rounds": 3, "number_of_epochs": 1},
        "topology": {"kind": "star"},
        "placement": {"strategy": "round_robin", "max_materialized": 2},
    })
    with LocalTestbed(3, backend="inprocess", workdir=str(root / "tb"), capacity=4, metrics=True) as tb:
        clusters = tb.start(timeout=90)
        names = [*tb.cluster_ids, "scheduler"]
        endpoints = {n: daemon_status(tb.bridge_socket(n))["metrics_endpoint"] for n in names}
        assert all(re.fullmatch(r"127\.0\.0\.1:\d+", e) for e in endpoints.values()), endpoints
        prometheus = start_prometheus(root, list(endpoints.values()))
        try:
            result: dict[str, Any] = {}

            def drive() -> None:
                channel = BridgeChannel(tb.bridge_socket("scheduler"), job_id=spec.job_id)
                recorder = RunRecorder.for_job(run_dir, spec, backend="inprocess", metrics=job_metrics)
                driver = Driver(spec, clusters, channel, backend="inprocess", timeout=300,
                                progress=recorder)
                try:
                    job = driver.run()
                    write_results(run_dir, job.summary)  # as submit does at the end
                    result["summary"] = job.summary
                except BaseException as exc:  # reported below
                    recorder.failed(str(exc))
                    result["error"] = exc
                finally:
                    driver.close()
                    channel.close()

            run_dir = root / "run"
            job_metrics = RunMetrics("scheduler")  # what `submit --metrics HOST:PORT` serves
            job_endpoint = job_metrics.serve("127.0.0.1:0")
            thread = threading.Thread(target=drive)
            thread.start()
            scrapes_during = 0
            status_seen: list[tuple[str, int]] = []

            def watch_status() -> None:
                # in a thread of its own, often: a round of this small job can take less
                # than one pass of the scrapes below (once in CI every sample said round 0)
                while thread.is_alive():
                    if (run_dir / "summary.json").exists():
                        seen = read_run(run_dir).to_dict()
                        status_seen.append((seen["state"], seen["round"]))
                    time.sleep(0.02)

            watcher = threading.Thread(target=watch_status)
            watcher.start()
            executors: dict[str, list[Samples]] = {n: [] for n in tb.executor_endpoints}
            while thread.is_alive():
                for endpoint in [*endpoints.values(), job_endpoint]:
                    scrape(endpoint)  # parses while the job runs
                scrapes_during += 1
                for n, endpoint in tb.executor_endpoints.items():
                    try:  # an executor serves from job.start to job.stop; before, the
                        executors[n].append(scrape(endpoint))  # port may answer otherwise
                    except (OSError, http.client.HTTPException):
                        pass
                time.sleep(0.1)
            thread.join()
            watcher.join()
            assert "error" not in result, result.get("error")
            out = Ran(tb, names, endpoints, result["summary"], scrapes_during,
                      prometheus=prometheus[1] if prometheus else "", run_dir=run_dir,
                      status_seen=status_seen, executors=executors)
            out.after = {n: scrape(e) for n, e in endpoints.items()}
            out.scheduler_metrics = scrape(job_endpoint)
            job_metrics.close()
            yield out
        finally:
            if prometheus is not None:
                prometheus[0].terminate()
                prometheus[0].wait(30)


def test_three_cluster_job_metrics_match_summary(ran: Ran) -> None:
    tb, names, after, summary = ran.tb, ran.names, ran.after, ran.summary
    assert ran.scrapes_during >= 1
    assert summary.bytes_inter_total > 0
    jobs = {n: daemon_status(tb.bridge_socket(n))["jobs"] for n in names}
    for n in names:
        sent = sum(c.get("sent_bytes", 0) for c in jobs[n].values())
        received = sum(c.get("received_bytes", 0) for c in jobs[n].values())
        assert total(after[n], "fabricd_update_sent_bytes_total") == sent, n
        assert total(after[n], "fabricd_update_received_bytes_total") == received, n
        assert total(after[n], "fabricd_updates_in_flight") == 0, n
        assert total(after[n], "fabricd_connected_clusters") == 3, n  # the other three daemons
    # what x says it sent to y is what y says it received from x
    for x in names:
        for y, sent in by_cluster(after[x], "fabricd_update_sent_bytes_total").items():
            assert by_cluster(after[y], "fabricd_update_received_bytes_total")[x] == sent, (x, y)
    # summary.json's per-cluster daemon figures are the same counters
    for c in summary.clusters:
        assert total(after[c.cluster_id], "fabricd_update_sent_bytes_total") == c.daemon_bytes_sent > 0
        assert total(after[c.cluster_id], "fabricd_update_received_bytes_total") == c.daemon_bytes_received
    inter_between_clusters = sum(v for x in tb.cluster_ids for y, v in
                                 by_cluster(after[x], "fabricd_update_sent_bytes_total").items()
                                 if y != "scheduler")
    # the rounds' bytes plus the final model's shares between clusters (the model itself
    # goes to the scheduler's daemon, excluded above)
    assert inter_between_clusters == (summary.bytes_inter_total
                                      + summary.final_model["share_bytes"])


def test_every_executor_was_scraped_during_the_job(ran: Ran) -> None:
    """`[metrics] executor_endpoint`: each cluster's executor serves its round figures."""
    assert set(ran.executors) == set(ran.tb.cluster_ids)
    job = frozenset({("job", "metrics-job")})
    for cluster, scrapes in ran.executors.items():
        assert scrapes, f"{cluster}'s executor was never scraped"
        assert all(s[("fedpilot_executor_info", frozenset({("cluster", cluster)}))] == 1
                   for s in scrapes)
        rounds = [s.get(("fedpilot_executor_round", job), 0) for s in scrapes]
        assert rounds == sorted(rounds) and max(rounds) <= 3, (cluster, rounds)
    # the job's rounds took long enough to be seen finishing on some executor
    assert max(s.get(("fedpilot_executor_round", job), 0)
               for scrapes in ran.executors.values() for s in scrapes) >= 1


def test_scheduler_job_metrics_match_summary(ran: Ran) -> None:
    s, summary = ran.scheduler_metrics, ran.summary
    job = {("job", "metrics-job")}
    assert s[("fedpilot_scheduler_round", frozenset(job))] == 3
    assert s[("fedpilot_scheduler_rounds_total", frozenset(job))] == 3
    assert s[("fedpilot_scheduler_bytes_total", frozenset(job | {("scope", "inter")}))] == summary.bytes_inter_total
    assert s[("fedpilot_scheduler_bytes_total", frozenset(job | {("scope", "intra")}))] == summary.bytes_intra_total
    assert s[("fedpilot_scheduler_accuracy", frozenset(job))] == pytest.approx(summary.final_accuracy)
    assert s[("fedpilot_scheduler_round_seconds_sum", frozenset(job))] == pytest.approx(
        sum(r.seconds for r in summary.rounds))


def test_status_shows_the_running_jobs_current_round(ran: Ran, capsys: pytest.CaptureFixture[str]) -> None:
    running = [r for state, r in ran.status_seen if state == "running"]
    assert running, ran.status_seen
    assert any(1 <= r < 3 for r in running), ran.status_seen  # a round mid-job, not just the ends
    assert running == sorted(running)  # rounds only move forward
    assert cli_main(["status", str(ran.run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"job metrics-job: finished, round 3, accuracy {ran.summary.rounds[-1].accuracy:.4f}")
    assert cli_main(["status", str(ran.run_dir), "--json"]) == 0
    seen = json.loads(capsys.readouterr().out)
    assert (seen["state"], seen["round"]) == ("finished", 3), seen


def test_prometheus_server_scraped_the_job(ran: Ran) -> None:
    if not ran.prometheus:
        pytest.skip("no prometheus binary (Debian: apt-get install prometheus); make test installs it best effort")
    query = urllib.parse.urlencode({"query": "fabricd_update_sent_bytes_total"})
    want = {(ran.endpoints[x], cluster): v for x in ran.names
            for cluster, v in by_cluster(ran.after[x], "fabricd_update_sent_bytes_total").items()}
    assert want
    deadline = time.monotonic() + 60
    while True:  # until its latest scrape has the final counters
        with urllib.request.urlopen(f"http://{ran.prometheus}/api/v1/query?{query}", timeout=10) as resp:
            data = json.loads(resp.read())
        assert data["status"] == "success"
        got = {(r["metric"]["instance"], r["metric"]["cluster"]): float(r["value"][1])
               for r in data["data"]["result"]}
        if got == want:
            break
        assert time.monotonic() < deadline, f"prometheus has {got}, the daemons say {want}"
        time.sleep(0.5)
    assert all(r["metric"]["job"] == "fabricd" for r in data["data"]["result"])


def test_a_foreign_daemon_is_counted_as_refused(ran: Ran, tmp_path: Path) -> None:
    tb = ran.tb
    foreign_ca = tmp_path / "foreign-ca"
    subprocess.run([*fabricd_command(), "certs", "init-ca", "--out", str(foreign_ca)], check=True,
                   capture_output=True, timeout=120)
    first = daemon_status(tb.bridge_socket(tb.cluster_ids[0]))["listen_addrs"][0]
    subprocess.run([*fabricd_command(), "init", "--cluster-id", "intruder", "--listen",
                    f"/ip4/127.0.0.1/tcp/{free_port()}", "--ca", str(foreign_ca), "--out",
                    str(tmp_path / "intruder"), "--bootstrap", first], check=True,
                   capture_output=True, timeout=120)
    set_toml_value(tmp_path / "intruder" / "cluster.toml", "ray", "address", "inprocess")
    tb._spawn("intruder", tmp_path / "intruder" / "cluster.toml")
    endpoint = ran.endpoints[tb.cluster_ids[0]]
    key = ("fabricd_refusals_total", frozenset({("stage", "membership"), ("reason", "foreign_certificate")}))
    assert ran.after[tb.cluster_ids[0]].get(key, 0) == 0
    deadline = time.monotonic() + 60
    while scrape(endpoint).get(key, 0) < 1:
        assert time.monotonic() < deadline, "the foreign daemon was never counted"
        time.sleep(0.2)
    assert "intruder" not in {c["cluster_id"] for c in daemon_status(tb.bridge_socket(tb.cluster_ids[0]))["clusters"]
                              if c["connected"]}
