"""The executor's control service refuses a malformed body before anything changes: the
scheduler's reply names the kind and the field, and the next valid message works."""

from __future__ import annotations

from typing import Any

import pytest

from fedpilot.loopback import LoopbackMesh
from proto.control import JobPlan, JobStart, RoundRun, plan_parts, read_histograms
from proto.job import JobSpec
from scheduler.errors import JobFailed
from scheduler.planning.clusters import ClusterSlot
from scheduler.run.driver import plan_epoch
from worker.context import InProcessContext
from worker.executor.runtime import runtime_factory


def test_a_malformed_plan_or_round_is_refused_and_changes_nothing() -> None:
    spec = JobSpec.from_dict({
        "job": {"id": "ctl", "seed": 1},
        "data": {"number_of_clients": 3, "dirichlet_beta": 0.5},
        "training": {"federated_learning_rounds": 1, "number_of_epochs": 1},
        "placement": {"max_materialized": 1}})
    mesh = LoopbackMesh(["a"], lambda cid: runtime_factory(InProcessContext(), cid), capacity=3)
    service = mesh.services["a"]
    try:
        started = mesh.request("a", JobStart("ctl", job=spec.to_dict(), clients=(0, 1, 2))
                               .to_body(), 60)
        histograms = read_histograms(started, 3)
        plan = plan_epoch(spec, histograms, [ClusterSlot("a", 3)], epoch=0)
        good_plan = JobPlan("ctl", routing=plan.routing).to_body()

        with pytest.raises(JobFailed, match=r"cluster a refused job.plan: ControlMessageError: "
                                            r"job.plan: field 'client_samples': must be 3 "):
            mesh.request("a", {**good_plan, "client_samples": [10, 10]}, 60)
        assert service.transport is None and service.engine is None  # not even half-planned
        mesh.request("a", good_plan, 60)

        good_round: dict[str, Any] = RoundRun("ctl", round=1, deadline=120.0).to_body()
        with pytest.raises(JobFailed, match=r"refused round.run: ControlMessageError: round.run: "
                                            r"field 'deadline': must be seconds in \(0, 86400\]"):
            # a repeated attempt with a bad deadline: the attempt must not be taken either
            mesh.request("a", {**good_round, "attempt": 7, "deadline": -1}, 60)
        with pytest.raises(JobFailed, match=r"round.run: field 'round': missing"):
            mesh.request("a", {k: v for k, v in good_round.items() if k != "round"}, 60)
        assert service.transport is not None and service.transport.attempt == 0

        record = mesh.request("a", good_round, 60)
        assert record["round"] == 1 and record["participants"] == 3
    finally:
        service.abort("test over")


def test_a_plan_in_parts_is_refused_unless_they_match_its_digest() -> None:
    spec = JobSpec.from_dict({
        "job": {"id": "ctl-parts", "seed": 1},
        "data": {"number_of_clients": 3, "dirichlet_beta": 0.5},
        "training": {"federated_learning_rounds": 1, "number_of_epochs": 1},
        "placement": {"max_materialized": 1}})
    mesh = LoopbackMesh(["a"], lambda cid: runtime_factory(InProcessContext(), cid), capacity=3)
    service = mesh.services["a"]
    try:
        started = mesh.request("a", JobStart("ctl-parts", job=spec.to_dict(),
                                             clients=(0, 1, 2)).to_body(), 60)
        histograms = read_histograms(started, 3)
        plan = plan_epoch(spec, histograms, [ClusterSlot("a", 3)], epoch=0)
        data = plan.routing.to_bytes()
        parts, digest = plan_parts("ctl-parts", data)
        by_digest = JobPlan("ctl-parts", routing_sha256=digest, routing_size=len(data)).to_body()

        with pytest.raises(JobFailed, match=r"job.plan: field 'routing_sha256': parts \[0\]"):
            mesh.request("a", by_digest, 60)  # no part arrived
        part = parts[0].to_body()
        forged = part["data"][:-1] + bytes([part["data"][-1] ^ 1])  # same length, other bytes
        mesh.request("a", {**part, "data": forged}, 60)
        with pytest.raises(JobFailed, match=r"job.plan: field 'routing_sha256': the plan's "
                                            r"parts are \d+ bytes with sha256"):
            mesh.request("a", by_digest, 60)
        assert service.transport is None and service.engine is None  # nothing adopted
        assert mesh.request("a", part, 60) == {"parts": 1}
        assert mesh.request("a", by_digest, 60)["clients"] == 3
        assert mesh.request("a", RoundRun("ctl-parts", round=1, deadline=120.0).to_body(),
                            60)["participants"] == 3
    finally:
        service.abort("test over")
