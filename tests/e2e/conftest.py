"""End-to-end test settings: a LocalTestbed writes its CA and daemon configs in this
process instead of one `fabricd` subprocess per step.

`LocalTestbed.prepare` runs `fabricd certs init-ca`, `fabricd init` per daemon and
`fabricd id` as subprocesses (six interpreter starts for three clusters: 4-9 s a testbed
on a loaded 2-core machine, and the e2e suite starts ~30 testbeds). Here the same
`fabricd.cli.main` runs in-process: the same code writes the same files; the daemons
themselves still run as subprocesses. `fedpilot-scheduler submit --local` run as a
subprocess (test_submit_cli, test_testbed_own_code's newcomer run) keeps the real
subprocess path under test.

`three_clusters`: the started three-cluster testbed (in-process executors) that several
fault and security tests run their job on.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import scheduler.testbed
from fabricd.cli import main as fabricd_main


def _run_inprocess(args: list[str], what: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = fabricd_main(list(args))
    if code != 0:
        raise scheduler.testbed.JobFailed(f"testbed: {what} failed: {err.getvalue().strip() or out.getvalue().strip()}")
    return out.getvalue()


@pytest.fixture(scope="session", autouse=True)
def _testbed_prepares_in_process() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scheduler.testbed, "_run", _run_inprocess)
        yield


@pytest.fixture()
def three_clusters(tmp_path: Path) -> Iterator[tuple[scheduler.testbed.LocalTestbed, Any]]:
    """A started testbed of three clusters with in-process executors: (testbed, clusters)."""
    with scheduler.testbed.LocalTestbed(3, backend="inprocess", workdir=str(tmp_path / "tb"), capacity=3) as tb:
        yield tb, tb.start(timeout=60)
