"""`submit --local --slow`: a cluster's process tree under a CPU quota (or a clear reason)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from scheduler import cpuquota
from scheduler.cpuquota import PERIOD_US, CpuQuota
from scheduler.errors import JobFailed
from scheduler.submit import slow_factors


def test_a_process_and_its_children_get_a_quarter_of_a_cpu_or_the_reason_why() -> None:
    code = "import subprocess, sys, time; time.sleep(0.5); subprocess.run(['sleep', '30'])"
    proc = subprocess.Popen([sys.executable, "-c", code])
    child: str | None = None
    try:
        try:
            quota = CpuQuota.apply(proc.pid, 0.25, f"fedpilot-test-{proc.pid}")
        except OSError as exc:
            assert "no CPU quota on this machine" in str(exc)
            pytest.skip(str(exc))
        try:
            limit = ((quota.path / "cpu.max").read_text().split() if "v2" in quota.kind
                     else [(quota.path / "cpu.cfs_quota_us").read_text().strip()])
            assert int(limit[0]) == PERIOD_US // 4
            # the child it starts after joining is in the cgroup too
            for _ in range(100):
                members = (quota.path / "cgroup.procs").read_text().split()
                child = next((m for m in members if m != str(proc.pid)), None)
                if child is not None:
                    break
                subprocess.run(["sleep", "0.05"])
            assert str(proc.pid) in members and child is not None
        finally:
            if child is not None:
                os.kill(int(child), signal.SIGKILL)
            proc.kill()
            proc.wait()
            for _ in range(100):
                if not (quota.path / "cgroup.procs").read_text().split():
                    break
                subprocess.run(["sleep", "0.05"])
            quota.remove()
        assert not quota.path.exists()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_slow_options_name_a_cluster_and_a_factor_above_one() -> None:
    assert slow_factors(["cluster-2=4", "cluster-3=2.5"]) == {"cluster-2": 4.0,
                                                              "cluster-3": 2.5}
    for bad in ("cluster-2", "cluster-2=1", "=4", "cluster-2=fast"):
        with pytest.raises(JobFailed, match="ID=FACTOR"):
            slow_factors([bad])


def test_the_testbeds_command_line_refuses_what_is_not_a_slow_down(
        capsys: pytest.CaptureFixture[str]) -> None:
    """deploy/netns-testbed.sh's FP_SLOW calls `python -m scheduler.cpuquota apply`; what
    is not PID, FACTOR > 1, CLUSTERS >= 1 and a name changes nothing and says why."""
    for bad in ([], ["apply", "1", "4", "3"], ["apply", "x", "4", "3", "n"],
                ["apply", "1", "1", "3", "n"], ["apply", "1", "4", "0", "n"], ["slow", "1"]):
        assert cpuquota.main(bad) == 2, bad
        assert "python -m scheduler.cpuquota:" in capsys.readouterr().err
