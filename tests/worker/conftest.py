"""Worker test fixtures: one local Ray cluster for the whole session (slow tests only)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.context import InProcessContext


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """A real 2-CPU Ray cluster on 127.0.0.1, started once and shut down at the end."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # another package's fixture started one: reuse it
        yield
        return
    # the Ray workers can import bench/'s user models (`usercnn:BNCNN`) as a user's own
    # module on PYTHONPATH; they inherit the environment Ray starts with, nothing else does
    saved = os.environ.get("PYTHONPATH")
    bench = str(Path(__file__).resolve().parents[2] / "bench")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (saved, bench) if p)
    try:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=2,
                 log_to_driver=False, namespace="fedpilot-tests")
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    try:
        yield
    finally:
        ray.shutdown()


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
