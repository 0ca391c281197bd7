from __future__ import annotations

import subprocess
import sys

FORBIDDEN = ("fabricd", "worker", "scheduler", "libp2p", "torch", "ray", "pickle")


def test_proto_imports_none_of_the_other_packages() -> None:
    code = (
        "import sys\n"
        "import proto, proto.ids, proto.errors, proto.codec, proto.messages, proto.stream, "
        "proto.bridge, proto.certs\n"
        f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


def test_scheduler_imports_nothing_from_worker() -> None:
    """Neither by import statement nor by what a plan or a submit loads (the round graph,
    histograms and metrics come from the routing matrix, fedcore.data and
    fedcore.metrics)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "scheduler"
    offending = [f"{path.relative_to(root.parent)}:{n}"
                 for path in root.rglob("*.py")
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if line.strip().startswith(("import worker", "from worker"))]
    assert not offending, offending
    code = (
        "import sys\n"
        "import scheduler.cli, scheduler.plan_cli, scheduler.submit, scheduler.run.driver, "
        "scheduler.run.mesh, scheduler.rundir.status, scheduler.rundir.results, scheduler.testbed\n"
        "bad = [m for m in sys.modules if m == 'worker' or m.startswith('worker.')]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
