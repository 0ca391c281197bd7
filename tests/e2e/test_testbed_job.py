"""Jobs over real fabricd daemons (subprocesses on 127.0.0.1) with real executors.

Each cluster's daemon starts its own executor process when the scheduler's job reaches
it; updates between clusters cross the daemons as verified safetensors streams.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from proto.bridge import ControlResult, ControlSend, Hello, recv_bridge, send_bridge
from proto.job import JobSpec
from scheduler.run.driver import JobFailed
from scheduler.run.mesh import daemon_status
from scheduler.testbed import LocalTestbed
from tests.e2e._faults import drive

pytestmark = pytest.mark.slow


def small_job(job_id: str, **sections: Any) -> JobSpec:
    base: dict[str, Any] = {
        "job": {"id": job_id, "seed": 1},
        "data": {"number_of_clients": 6, "dirichlet_beta": 0.5},
        "training": {"federated_learning_rounds": 2, "number_of_epochs": 1},
        "topology": {"kind": "star"},
        "placement": {"strategy": "round_robin", "max_materialized": 2},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return JobSpec.from_dict(base)


def job_counters(testbed: LocalTestbed, name: str, job_id: str) -> dict[str, int]:
    status = daemon_status(testbed.bridge_socket(name))
    return dict(status.get("jobs", {}).get(job_id, {}))


@pytest.fixture(scope="module")
def inprocess_testbed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    workdir = tmp_path_factory.mktemp("tb")
    with LocalTestbed(2, backend="inprocess", workdir=str(workdir), capacity=4) as testbed:
        clusters = testbed.start(timeout=60)
        yield testbed, clusters


def test_inter_cluster_bytes_equal_the_daemons_counters(inprocess_testbed: Any) -> None:
    testbed, clusters = inprocess_testbed
    spec = small_job("e2e-bytes")
    result = drive(testbed, clusters, spec)
    summary = result.summary
    assert len(summary.rounds) == 2
    assert summary.bytes_inter_total > 0
    sent = {c: job_counters(testbed, c, spec.job_id).get("sent_bytes", 0)
            for c in testbed.cluster_ids}
    received = {c: job_counters(testbed, c, spec.job_id).get("received_bytes", 0)
                for c in testbed.cluster_ids}
    # the rounds' inter-cluster bytes plus the final model's streams (shares between
    # clusters, then the model to the scheduler's daemon, which streams it back to every
    # cluster to score the last round's personalized accuracy against)
    final = summary.final_model
    assert final["transfer_bytes"] == final["share_bytes"] + final["bytes"] > 0
    assert final["score_bytes"] == len(testbed.cluster_ids) * final["bytes"]
    assert sum(sent.values()) == summary.bytes_inter_total + final["transfer_bytes"]
    assert sum(received.values()) == (summary.bytes_inter_total + final["share_bytes"]
                                      + final["score_bytes"])
    # the executors asked their daemons too, and the summary carries it
    assert (sum(c.daemon_bytes_sent for c in summary.clusters)
            == summary.bytes_inter_total + final["transfer_bytes"])
    assert all(c.actors_materialized > 0 for c in summary.clusters)
    assert sum(c.clients for c in summary.clusters) == 6


def _send_as(socket_path: str, target: str, body: dict[str, Any]) -> ControlResult:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(socket_path)
    try:
        send_bridge(sock, Hello(role="scheduler"))
        send_bridge(sock, ControlSend(request_id="forged-1", target_cluster=target, body=body))
        msg, _ = recv_bridge(sock, 0)
    finally:
        sock.close()
    assert isinstance(msg, ControlResult)
    return msg


def test_job_messages_from_a_cluster_certificate_are_rejected_everywhere(
        inprocess_testbed: Any) -> None:
    testbed, _ = inprocess_testbed
    spec = small_job("forged")
    body = {"kind": "job.start", "job_id": spec.job_id, "job": spec.to_dict(), "clients": [0]}
    for sender in testbed.cluster_ids:
        for target in testbed.cluster_ids:
            if target == sender:
                continue
            result = _send_as(testbed.bridge_socket(sender), target, body)
            assert not result.ok
            assert "scheduler certificate" in result.reason
    # nobody started an executor for the forged job
    for name in testbed.cluster_ids:
        clients = daemon_status(testbed.bridge_socket(name))["bridge_clients"]
        assert not [c for c in clients if c["job_id"] == spec.job_id]
    # the rejection names the signer, and the receiving daemon logged it
    log = (Path(testbed.configs[testbed.cluster_ids[1]]).parent.parent
           / f"{testbed.cluster_ids[1]}.log").read_text()
    assert "control.rejected" in log and "scheduler certificate" in log


def test_a_cluster_that_disappears_before_start_fails_the_job_naming_it(
        tmp_path: Path) -> None:
    with LocalTestbed(2, backend="inprocess", workdir=str(tmp_path), capacity=4) as testbed:
        clusters = testbed.start(timeout=60)
        testbed.kill("cluster-2")
        # judged lost after a 4 s lease, not production's 15 s (the same code path)
        with pytest.raises(JobFailed, match="cluster-2"):
            drive(testbed, clusters, small_job("gone", faults={"lease_seconds": 4}))


def test_job_on_two_embedded_ray_clusters(tmp_path: Path) -> None:
    with LocalTestbed(2, backend="local", workdir=str(tmp_path), capacity=4) as testbed:
        clusters = testbed.start(timeout=60)
        spec = small_job("e2e-ray")
        result = drive(testbed, clusters, spec, backend="ray")
        summary = result.summary
        sent = sum(job_counters(testbed, c, spec.job_id).get("sent_bytes", 0)
                   for c in testbed.cluster_ids)
        assert summary.bytes_inter_total + summary.final_model["transfer_bytes"] == sent
        assert summary.bytes_inter_total > 0
        # 3 clients per cluster, at most 2 actors alive: the slots are recycled, not re-made
        assert [c.actors_materialized for c in summary.clusters] == [2, 2]
        for name in testbed.cluster_ids:
            log = (Path(testbed.configs[name]).parent / "executor-e2e-ray.log").read_text()
            assert "event=actor_created" in log and "context=ray" in log
