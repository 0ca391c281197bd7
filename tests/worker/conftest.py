"""Worker test fixtures: contexts on the session's Ray (conftest.py's ray_session) or in-process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from worker.context import InProcessContext


@pytest.fixture
def ray_context(ray_session: None) -> Iterator[object]:
    from worker.context import RayContext

    ctx = RayContext()
    try:
        yield ctx
    finally:
        ctx.shutdown()


@pytest.fixture
def inprocess_context() -> Iterator[InProcessContext]:
    ctx = InProcessContext(num_cpus=2)
    try:
        yield ctx
    finally:
        ctx.shutdown()
