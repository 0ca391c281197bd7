"""Must-show 1 (daemon side): a 3-cluster job over real daemons with /metrics on; every
endpoint is scraped and parsed during and after the job, the byte counters match the
daemons' status and summary.json's per-cluster figures, and a foreign peer is counted."""

from __future__ import annotations

import re
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from proto.job import JobSpec
from scheduler.driver import Driver
from scheduler.mesh import BridgeChannel, daemon_status
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


def test_three_cluster_job_metrics_match_summary(tmp_path: Path) -> None:
    spec = JobSpec.from_dict({
        "job": {"id": "metrics-job", "seed": 1},
        "data": {"number_of_clients": 6, "dirichlet_beta": 0.5},
        "training": {"federated_learning_rounds": 3, "number_of_epochs": 1},
        "topology": {"kind": "star"},
        "placement": {"strategy": "round_robin", "max_materialized": 2},
    })
    with LocalTestbed(3, backend="inprocess", workdir=str(tmp_path), capacity=4, metrics=True) as tb:
        clusters = tb.start(timeout=90)
        names = [*tb.cluster_ids, "scheduler"]
        endpoints = {n: daemon_status(tb.bridge_socket(n))["metrics_endpoint"] for n in names}
        assert all(re.fullmatch(r"127\.0\.0\.1:\d+", e) for e in endpoints.values()), endpoints

        result: dict[str, Any] = {}

        def drive() -> None:
            channel = BridgeChannel(tb.bridge_socket("scheduler"))
            driver = Driver(spec, clusters, channel, backend="inprocess", timeout=300)
            try:
                result["summary"] = driver.run().summary
            except BaseException as exc:  # reported below
                result["error"] = exc
            finally:
                driver.close()
                channel.close()

        thread = threading.Thread(target=drive)
        thread.start()
        scrapes_during = 0
        while thread.is_alive():
            for endpoint in endpoints.values():
                scrape(endpoint)  # parses while the job runs
            scrapes_during += 1
            time.sleep(0.2)
        thread.join()
        assert "error" not in result, result.get("error")
        assert scrapes_during >= 1
        summary = result["summary"]
        assert summary.bytes_inter_total > 0

        after = {n: scrape(e) for n, e in endpoints.items()}
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
        assert inter_between_clusters == summary.bytes_inter_total

        # a daemon of another federation knocks on cluster-1 and is counted there
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
        endpoint = endpoints[tb.cluster_ids[0]]
        deadline = time.monotonic() + 60
        key = ("fabricd_refusals_total", frozenset({("stage", "membership"), ("reason", "foreign_certificate")}))
        while scrape(endpoint).get(key, 0) < 1:
            assert time.monotonic() < deadline, "the foreign daemon was never counted"
            time.sleep(0.2)
