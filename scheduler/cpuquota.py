"""A slow site on this machine: a process tree under a CPU quota (`submit --local --slow`).

A cluster slowed by a factor F runs its daemon, and so its executor and that executor's
Ray, in a cgroup of its own whose processes together get 1 / F of a fair share of this
machine's CPUs (CPUs / clusters, at most one CPU): cgroup v2's
`cpu.max` where the unified hierarchy has the cpu controller, else cgroup v1's
`cpu.cfs_quota_us`. Where neither can be written (no permission, no cpu controller),
`CpuQuota.apply` says why and nothing is slowed. deploy/netns-testbed.sh (`FP_SLOW`) slows
its sites' daemons through this module's command line (it prints the cgroup, then how):

    python -m scheduler.cpuquota apply PID FACTOR CLUSTERS NAME
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


@dataclass
class CpuQuota:
    """One cgroup holding a slowed cluster's processes (removed by `remove`)."""

    path: Path
    kind: str                      # "cgroup v2 cpu.max" | "cgroup v1 cpu.cfs_quota_us"

    @classmethod
    def apply(cls, pid: int, cpus: float, name: str) -> CpuQuota:
        """Put process `pid` (and what it starts from now on) under `cpus` CPUs; OSError
        naming what was tried when this machine allows neither kind."""
        quota = max(1000, int(PERIOD_US * cpus))
        tried: list[str] = []
        for kind, parent, files in _candidates(quota):
            path = parent / name
            try:
                path.mkdir(exist_ok=True)
                for file, value in files.items():
                    (path / file).write_text(value)
                (path / "cgroup.procs").write_text(str(pid))
                return cls(path, kind)
            except OSError as exc:
                tried.append(f"{kind} at {path}: {exc.strerror or exc}")
                _rmdir(path)
        raise OSError("no CPU quota on this machine (" + "; ".join(tried or [
            f"no cgroup cpu controller under {CGROUP_ROOT}"]) + ")")

    def remove(self) -> None:
        """Remove the cgroup once its processes are gone (best effort)."""
        _rmdir(self.path)


def slow_down(pid: int, factor: float, clusters: int, name: str) -> tuple[CpuQuota | None, str]:
    """Put process `pid` (a cluster's daemon, before it starts an executor) under 1 /
    `factor` of a fair share of this machine's CPUs (CPUs / `clusters`, at most one: what
    an unslowed cluster gets here at most): the quota and how, or None and why not."""
    share = min(1.0, len(os.sched_getaffinity(0)) / max(1, clusters))
    try:
        quota = CpuQuota.apply(pid, share / factor, name)
    except OSError as exc:
        return None, f"not slowed: {exc}"
    return quota, f"{share / factor:.2f} of a CPU, 1/{factor:g} of a fair share ({quota.kind})"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if args[:1] != ["apply"] or len(args) != 5:
            raise ValueError("expected apply PID FACTOR CLUSTERS NAME")
        pid, factor, clusters = int(args[1]), float(args[2]), int(args[3])
        if not factor > 1.0 or clusters < 1:
            raise ValueError(f"FACTOR must be > 1 and CLUSTERS >= 1, got {args[2]} and {args[3]}")
    except ValueError as exc:
        print(f"python -m scheduler.cpuquota: {exc}", file=sys.stderr)
        return 2
    quota, how = slow_down(pid, factor, clusters, args[4])
    print(quota.path if quota else "")
    print(how)
    return 0


def _candidates(quota: int) -> list[tuple[str, Path, dict[str, str]]]:
    """Where a child cgroup with a CPU quota may go: beside this process's own."""
    out = []
    own = _own_cgroups()
    for mount in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
        base = mount / own.get("", "/").lstrip("/")
        controllers = base / "cgroup.controllers"
        if controllers.exists() and "cpu" in controllers.read_text().split():
            out.append(("cgroup v2 cpu.max", base, {"cpu.max": f"{quota} {PERIOD_US}"}))
    for controller in ("cpu", "cpu,cpuacct"):
        base = CGROUP_ROOT / controller / own.get(controller, "/").lstrip("/")
        if (base / "cpu.cfs_quota_us").exists():
            out.append(("cgroup v1 cpu.cfs_quota_us", base,
                        {"cpu.cfs_period_us": str(PERIOD_US), "cpu.cfs_quota_us": str(quota)}))
            break
    return out


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per controller ("" for the unified hierarchy)."""
    try:
        lines = Path(f"/proc/{os.getpid()}/cgroup").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            out[controller] = path
        if "," in controllers:
            out[controllers] = path
    return out


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


__all__ = ["CpuQuota", "slow_down"]

if __name__ == "__main__":
    sys.exit(main())
