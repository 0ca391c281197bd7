"""A plan over the 4 MiB cap of a control body, through real daemons.

A routing matrix takes ~26 bytes a client, so past ~120,000 clients it no longer fits a
`job.plan` (and a cluster's label histograms, past ~400,000 clients, no longer fit a
job.start reply: they come in job.profile pages). The driver then sends it as signed `job.plan.part`s and a `job.plan` naming
their sha256; the executors assemble and check it, and both daemons learn the placement
from it (they admit each update only from the cluster the plan places its source on).
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

import pytest

from bench.bench_scale import job, write_dataset
from proto.control import PLAN_PART_BYTES
from proto.ids import MAX_MESSAGE_BYTES
from scheduler.run.driver import Driver
from scheduler.testbed import LocalTestbed, job_allowances
from tests.e2e._faults import job_driver
from tests.e2e.test_testbed_job import small_job

pytestmark = pytest.mark.slow


def run(testbed: LocalTestbed, spec: Any, clusters: list[Any], *,
        inline_plan_bytes: int | None = None,
        profile_page_bytes: int | None = None) -> tuple[Any, Driver]:
    with job_driver(testbed, clusters, spec, timeout=600) as driver:
        if inline_plan_bytes is not None:
            driver.inline_plan_bytes = inline_plan_bytes
        if profile_page_bytes is not None:
            driver.profile_page_bytes = profile_page_bytes
        return driver.run(), driver


def learned(testbed: LocalTestbed, name: str, job_id: str) -> bool:
    text = (Path(testbed.root) / f"{name}.log").read_text(errors="replace")
    return re.search(rf"placement\.learned .*job={re.escape(job_id)}\b", text) is not None


def test_a_small_plan_sent_in_parts_runs_and_the_daemons_learn_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fedpilot.scheduler")
    spec = small_job("e2e-plan-parts")
    with LocalTestbed(2, backend="inprocess", workdir=str(tmp_path), capacity=4) as testbed:
        clusters = testbed.start(timeout=60)
        result, _ = run(testbed, spec, clusters, inline_plan_bytes=0)  # parts, however small
        assert "event=plan_in_parts job=e2e-plan-parts" in caplog.text
        assert len(result.summary.rounds) == 2
        assert result.summary.bytes_inter_total > 0 and result.model
        for name in testbed.cluster_ids:  # from the parts, as from an inline plan
            assert learned(testbed, name, spec.job_id), name


def test_a_job_whose_plan_is_over_4_mib_runs_through_real_daemons(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # the clients' histograms come in job.profile pages too: 256 KiB of counts a reply
    # here (90,000 clients of 10 labels a cluster: 4 pages each); at the real 3 MiB page a
    # cluster of ~400,000 such clients or more would need them (its job.start reply alone
    # was over the 4 MiB cap before)
    caplog.set_level(logging.INFO, logger="fedpilot.scheduler")
    clients = 180_000
    dataset = write_dataset(tmp_path / "digits-big.npz", clients, 1)
    spec = job(dataset, clients, 0.001, 2, "hybrid")
    with LocalTestbed(2, backend="inprocess", workdir=str(tmp_path / "tb"),
                      capacity=clients // 2 + 1, allow=job_allowances(spec)) as testbed:
        clusters = testbed.start(timeout=120)
        started = time.perf_counter()
        result, driver = run(testbed, spec, clusters, profile_page_bytes=256 * 1024)
        seconds = time.perf_counter() - started
        assert f"event=profile_in_pages job={spec.job_id} pages=8" in caplog.text
        assert driver.plan is not None
        plan_bytes = len(driver.plan.routing.to_bytes())
        assert plan_bytes > MAX_MESSAGE_BYTES  # it could not have gone inline
        assert f"event=plan_in_parts job={spec.job_id}" in caplog.text
        rounds = result.summary.rounds
        assert [r.participants for r in rounds] == [clients // 1000] * 2
        assert result.summary.bytes_inter_total > 0 and result.model
        for name in testbed.cluster_ids:
            assert learned(testbed, name, spec.job_id), name
        print(f"\nplan_bytes={plan_bytes} parts={-(-plan_bytes // PLAN_PART_BYTES)} "
              f"job_seconds={seconds:.1f} round_seconds={[round(r.seconds, 2) for r in rounds]}")
