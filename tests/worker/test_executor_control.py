"""The executor's control service refuses a malformed body before anything changes: the
scheduler's reply names the kind and the field, and the next valid message works."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from fedpilot.loopback import LoopbackMesh
from proto.control import (
    PROFILE_REPLY,
    JobPlan,
    JobProfile,
    JobStart,
    RoundRun,
    page_rows,
    plan_parts,
    read_histograms,
)
from proto.job import JobSpec
from proto.routing import RoutingMatrix
from scheduler.errors import JobFailed
from scheduler.planning.clusters import ClusterSlot
from scheduler.run.driver import plan_epoch
from worker.context import InProcessContext
from worker.executor.runtime import runtime_factory


def one_cluster(job_id: str, clients: int) -> tuple[JobSpec, LoopbackMesh]:
    """A one-round job of `clients` clients and one in-process cluster "a" that can hold
    them all."""
    spec = JobSpec.from_dict({
        "job": {"id": job_id, "seed": 1},
        "data": {"number_of_clients": clients, "dirichlet_beta": 0.5},
        "training": {"federated_learning_rounds": 1, "number_of_epochs": 1},
        "placement": {"max_materialized": 1}})
    mesh = LoopbackMesh(["a"], lambda cid: runtime_factory(InProcessContext(), cid),
                        capacity=clients)
    return spec, mesh


def test_a_malformed_plan_or_round_is_refused_and_changes_nothing() -> None:
    spec, mesh = one_cluster("ctl", clients=3)
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
        with pytest.raises(JobFailed, match=r"job.plan: field 'pooled_labels': must be 10 "
                                            r"counts \(one per class of the job's data\), got 3"):
            mesh.request("a", {**good_plan, "pooled_labels": [1, 2, 3]}, 60)
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
    spec, mesh = one_cluster("ctl-parts", clients=3)
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


def test_histograms_come_in_pages_of_this_clusters_own_clients_only() -> None:
    spec, mesh = one_cluster("ctl-profile", clients=30)
    service = mesh.services["a"]
    try:
        with pytest.raises(JobFailed, match=r"job.start: field 'client_range': names client 30"):
            mesh.request("a", JobStart("ctl-profile", job=spec.to_dict(),
                                       client_range=(0, 31, 2)).to_body(), 60)
        assert service.spec is None  # refused before anything changed
        # this cluster holds the odd clients, 15 of them; a reply holds 40 bytes of counts
        started = mesh.request("a", JobStart("ctl-profile", job=spec.to_dict(),
                                             client_range=(1, 30, 2), histogram_bytes=40
                                             ).to_body(), 60)
        dtype, labels = started["histogram_dtype"], started["histogram_shape"][1]
        per_page = page_rows(40, labels, dtype)
        assert 1 <= per_page < 15 and started["histogram_shape"][0] == per_page
        pages = [read_histograms(started, per_page)]
        offset = per_page
        while offset < 15:
            count = min(per_page, 15 - offset)
            reply = mesh.request("a", JobProfile("ctl-profile", offset=offset, count=count
                                                 ).to_body(), 60)
            pages.append(read_histograms(reply, count, dtype=dtype, labels=labels,
                                         what=PROFILE_REPLY))
            offset += count
        assert service.runtime is not None
        whole = service.runtime.histograms(list(range(1, 30, 2)))
        assert np.array_equal(np.concatenate(pages), [whole[c] for c in range(1, 30, 2)])
        # the clients' label mix the model learns: personalized accuracy's reference
        every = service.runtime.histograms(list(range(spec.data.number_of_clients)))
        pooled = np.sum(list(every.values()), axis=0)
        assert service.runtime._config.pooled_labels == tuple(int(n) for n in pooled)

        for body, field in [({"offset": 15, "count": 1}, "offset"),   # not one of its clients
                            ({"offset": 14, "count": 2}, "count"),
                            ({"offset": 0, "count": per_page + 1}, "count")]:
            with pytest.raises(JobFailed, match=rf"refused job.profile: ControlMessageError: "
                                                rf"job.profile: field '{field}'"):
                mesh.request("a", {"kind": "job.profile", "job_id": "ctl-profile", **body}, 60)
    finally:
        service.abort("test over")


def test_a_cluster_without_clients_answers_no_rows() -> None:
    spec, mesh = one_cluster("ctl-none", clients=3)
    try:
        started = mesh.request("a", JobStart("ctl-none", job=spec.to_dict()).to_body(), 60)
        assert read_histograms(started, 0).shape[0] == 0
        with pytest.raises(JobFailed, match=r"job.profile: field 'offset': must be in 0..-1"):
            mesh.request("a", JobProfile("ctl-none", offset=0, count=1).to_body(), 60)
    finally:
        mesh.services["a"].abort("test over")


@pytest.mark.parametrize(("aggregator", "job_steps", "fixed"), [
    ("fedavg", 2, 2),    # explicit steps
    ("fedavgm", 0, 1),   # auto, but fedavgm mixes once: a plan with more is refused too
])
def test_a_plan_whose_mixing_steps_differ_from_the_jobs_is_refused(aggregator: str, job_steps: int,
                                                                   fixed: int) -> None:
    spec = JobSpec.from_dict({
        "job": {"id": "ctl-mix", "seed": 1},
        "data": {"number_of_clients": 4, "dirichlet_beta": 0.5},
        "training": {"federated_learning_rounds": 1, "number_of_epochs": 1},
        "topology": {"kind": "ring", "mixing_steps": job_steps}, "aggregation": {"name": aggregator},
        "placement": {"max_materialized": 1}})
    mesh = LoopbackMesh(["a"], lambda cid: runtime_factory(InProcessContext(), cid), capacity=4)
    service = mesh.services["a"]
    try:
        started = mesh.request("a", JobStart("ctl-mix", job=spec.to_dict(), clients=(0, 1, 2, 3))
                               .to_body(), 60)
        routing = plan_epoch(spec, read_histograms(started, 4), [ClusterSlot("a", 4)],
                             epoch=0).routing
        assert routing.mixing_steps == fixed
        other = RoutingMatrix.from_dict({**routing.to_dict(), "mixing_steps": 3})
        with pytest.raises(JobFailed, match=rf"routing matrix has mixing_steps 3; the job fixes "
                                            rf"{fixed} \(topology.mixing_steps = {job_steps}, "
                                            rf"aggregation.name = '{aggregator}'\)"):
            mesh.request("a", JobPlan("ctl-mix", routing=other).to_body(), 60)
        assert service.engine is None
        mesh.request("a", JobPlan("ctl-mix", routing=routing).to_body(), 60)
        assert service.engine is not None and service.engine.mixing_steps == fixed
    finally:
        service.abort("test over")


def test_a_new_plan_ends_the_round_still_running_before_it_changes_the_job() -> None:
    """A round whose training outlasted the scheduler's abort (a loaded machine: compose,
    a cluster falsely lost) must not run on under the next plan: its late sends went to a
    node the new plan no longer had, and its failure aborted the repeated round."""
    spec = JobSpec.from_dict({
        "job": {"id": "ctl-stale", "seed": 1},
        "data": {"number_of_clients": 4, "dirichlet_beta": 0.5},
        "training": {"federated_learning_rounds": 2, "number_of_epochs": 1},
        "topology": {"kind": "hybrid"}, "placement": {"max_materialized": 1}})
    mesh = LoopbackMesh(["a", "b"], lambda cid: runtime_factory(InProcessContext(), cid),
                        capacity=4)
    a = mesh.services["a"]
    try:
        started = mesh.request("a", JobStart("ctl-stale", job=spec.to_dict(), clients=(0, 1, 2, 3))
                               .to_body(), 60)
        mesh.request("b", JobStart("ctl-stale", job=spec.to_dict(), clients=(0, 1, 2, 3))
                     .to_body(), 60)
        histograms = read_histograms(started, 4)
        two = plan_epoch(spec, histograms, [ClusterSlot("a", 2), ClusterSlot("b", 2)], epoch=0)
        assert set(two.routing.clusters) == {"a", "b"}
        for cid in ("a", "b"):
            mesh.request(cid, JobPlan("ctl-stale", routing=two.routing).to_body(), 60)
        # round 1 on a only: a's group waits for b's, which never runs it
        with ThreadPoolExecutor(1) as pool:
            stale = pool.submit(mesh.request, "a",
                                RoundRun("ctl-stale", round=1, deadline=120.0).to_body(), 120)
            deadline = time.monotonic() + 60
            while a._running is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert a._running == (1, 0) and not stale.done()
            # b is "lost": the job goes on with a alone
            one = plan_epoch(spec, histograms, [ClusterSlot("a", 4)], epoch=1)
            mesh.request("a", JobPlan("ctl-stale", routing=one.routing).to_body(), 60)
            assert stale.done(), "job.plan returned while the old round still ran under it"
            with pytest.raises(JobFailed, match=r"re-planned \(epoch 1\) while round 1 ran here"):
                stale.result()
        record = mesh.request("a", RoundRun("ctl-stale", round=1, attempt=1, deadline=120.0)
                              .to_body(), 120)
        assert record["round"] == 1 and record["participants"] == 4
    finally:
        for service in mesh.services.values():
            service.abort("test over")
