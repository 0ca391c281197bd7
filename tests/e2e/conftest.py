"""End-to-end test settings.

`three_clusters`: the started three-cluster testbed (in-process executors) that several
fault and security tests run their job on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import scheduler.testbed


@pytest.fixture()
def three_clusters(tmp_path: Path) -> Iterator[tuple[scheduler.testbed.LocalTestbed, Any]]:
    """A started testbed of three clusters with in-process executors: (testbed, clusters)."""
    with scheduler.testbed.LocalTestbed(3, backend="inprocess", workdir=str(tmp_path / "tb"), capacity=3) as tb:
        yield tb, tb.start(timeout=60)
