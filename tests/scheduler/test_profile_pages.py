"""The driver fetches label histograms in pages (job.start's reply, then job.profile), so
a cluster's reply stays under the control cap whatever its client count; a page that is
not exactly the rows, labels and dtype asked for fails the job naming the field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from fedpilot.loopback import LoopbackMesh
from proto.job import JobSpec
from scheduler.run.driver import Driver, JobFailed
from worker.context import InProcessContext
from worker.executor.runtime import runtime_factory

Tamper = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]


class Spy:
    """The loopback mesh, recording each request and optionally changing replies."""

    def __init__(self, mesh: LoopbackMesh, tamper: Tamper | None = None) -> None:
        self.mesh = mesh
        self.tamper = tamper
        self.sent: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.mesh, name)

    def request(self, cluster_id: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        self.sent.append(body)
        reply = self.mesh.request(cluster_id, body, timeout)
        return self.tamper(body, reply) if self.tamper is not None else reply


def spec() -> JobSpec:
    return JobSpec.from_dict({
        "job": {"id": "pages", "seed": 3},
        "data": {"number_of_clients": 9, "dirichlet_beta": 0.5},
        "training": {"federated_learning_rounds": 1, "number_of_epochs": 1},
        "placement": {"max_materialized": 2}})


def run(page_bytes: int | None, tamper: Tamper | None = None) -> tuple[Any, Driver, Spy]:
    mesh = LoopbackMesh(["a", "b", "c"], lambda cid: runtime_factory(InProcessContext(), cid),
                        capacity=4)
    channel = Spy(mesh, tamper)
    driver = Driver(spec(), mesh.clusters(), channel, backend="inprocess",  # type: ignore[arg-type]
                    timeout=120)
    if page_bytes is not None:
        driver.profile_page_bytes = page_bytes
    try:
        return driver.run(), driver, channel
    finally:
        driver.close()


def test_histograms_in_pages_plan_the_same_job_as_in_one_reply() -> None:
    whole, whole_driver, whole_channel = run(None)
    paged, paged_driver, paged_channel = run(20)  # 10 labels of u1: 2 rows a page
    assert not [b for b in whole_channel.sent if b["kind"] == "job.profile"]
    profiles = [b for b in paged_channel.sent if b["kind"] == "job.profile"]
    # 3 clients a cluster: rows 0-1 came with job.start, row 2 with one job.profile each
    assert sorted((b["offset"], b["count"]) for b in profiles) == [(2, 1)] * 3
    starts = [b for b in paged_channel.sent if b["kind"] == "job.start"]
    assert sorted(tuple(b["client_range"]) for b in starts) == [(0, 7, 3), (1, 8, 3), (2, 9, 3)]
    assert all("clients" not in b or not b["clients"] for b in starts)
    assert paged_driver._client_samples == whole_driver._client_samples
    assert whole_driver.plan is not None and paged_driver.plan is not None
    assert paged_driver.plan.routing.to_bytes() == whole_driver.plan.routing.to_bytes()
    assert [r.accuracy for r in paged.summary.rounds] == [r.accuracy for r in whole.summary.rounds]


@pytest.mark.parametrize(("change", "field"), [
    ({"histogram_dtype": "<u2", "histogram_counts": b"\x00" * 20}, "histogram_dtype"),
    ({"histogram_shape": [2, 10], "histogram_counts": b"\x00" * 20}, "histogram_shape"),
    ({"histogram_shape": [1, 9], "histogram_counts": b"\x00" * 9}, "histogram_shape"),
    ({"histogram_counts": b"\x00" * 11}, "histogram_counts"),
])
def test_a_page_not_as_asked_fails_the_job_naming_the_field(change: dict[str, Any],
                                                            field: str) -> None:
    def tamper(body: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
        return {**reply, **change} if body["kind"] == "job.profile" else reply

    with pytest.raises(JobFailed, match=rf"answered job.profile \(rows 2..2\) with bad "
                                        rf"histograms: job.profile reply: field '{field}'"):
        run(20, tamper)
