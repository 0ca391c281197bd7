"""Session-wide test settings: keep Ray on loopback and quiet, one BLAS thread a process;
under pytest-xdist (`make test` runs two workers) give each worker its own share of the
ports."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DISABLE_DOCKER_CPU_WARNING", "1")
# One BLAS / OpenMP thread in every test process and the daemons and executors it starts
# (set before numpy or torch loads): two xdist workers fill the two cores, and a second
# thread spins while it waits for the first one's share of a busy machine. At load 20, a
# 1000-node mixing_factor's eigvalsh took 6.7 s of CPU with the default threads, 0.24 s
# with one; test_topology, test_mixing_steps, test_placement(_populations) and
# test_learning_robustness 55 -> 37-43 s of CPU. Production keeps the libraries' defaults.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _share_ports_between_workers() -> None:
    """`scheduler.testbed.free_port` hands out a port the kernel says is free now, and a
    daemon binds it a moment later; meanwhile another xdist worker's free_port could be
    handed the same one. So each worker takes only its own share: every port of another
    worker's share counts as handed out already. (Linux's bind(0) offers odd ports first,
    so the shares are pairs of ports, dealt in turn.) Each worker has its own temp dirs
    (pytest's basetemp), its own session mesh and its own Ray."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if count < 2 or not worker.startswith("gw"):
        return
    import scheduler.testbed

    index = int(worker[2:])
    scheduler.testbed._HANDED_OUT.update(p for p in range(1 << 16) if (p >> 1) % count != index)


_share_ports_between_workers()


def _fork_daemons() -> None:
    """The tests' daemons are forked from a warm process, not started from nothing:
    tests/_zygote.py says why (FEDPILOT_TEST_ZYGOTE=0: from nothing)."""
    import scheduler.testbed
    from tests import _zygote

    scheduler.testbed.LocalTestbed.popen = staticmethod(_zygote.popen)  # type: ignore[assignment]


_fork_daemons()


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
    bench = str(Path(__file__).resolve().parent / "bench")
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
