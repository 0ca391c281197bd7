"""The package layout, as import rules (every import statement, also inside functions).

    fedpilot/    public API: run(), loopback                                   tier 3
    fabricd/  worker/  scheduler/   daemon | Ray side | scheduler              tier 2
    fedcore/     data and partitions (numpy only), metrics, logs               tier 1
    proto/       the contract                                                  tier 0

No arrow runs up a tier. In tier 2 the three packages do not import each other: the
scheduler talks to clusters through the daemon's bridge (proto.bridge), and reaches the
worker only through a child process (`python -m worker.preflight`) or the executor at
job.start. Named exceptions, each with its reason, are listed below; a new one is a
decision, not an accident. `scheduler/planning/` is pure: no I/O, processes, threads or
heavy runtimes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIERS = {"proto": 0, "fedcore": 1, "fabricd": 2, "worker": 2, "scheduler": 2, "fedpilot": 3}
#: (importing file, imported package): why it may
EXCEPTIONS = {
    ("scheduler/testbed.py", "fabricd"): "the local testbed writes the daemons' configs "
                                         "and starts them",
    ("fedpilot/loopback.py", "worker"): "the in-process mesh runs the clusters' executors "
                                        "in this process",
}
PLANNING_FORBIDDEN = {"socket", "subprocess", "threading", "multiprocessing", "asyncio",
                      "trio", "ray", "torch", "libp2p", "http", "urllib", "requests",
                      "worker", "fabricd", "fedpilot"}


def imports(path: Path, package: list[str] | None = None) -> set[str]:
    """Absolute module names `path` imports (relative imports resolved against its
    package, by default where it lies in the repository)."""
    tree = ast.parse(path.read_text(), str(path))
    if package is None:
        package = list(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.add(node.module)
    return found


def modules() -> list[tuple[str, Path]]:
    return [(pkg, f) for pkg in TIERS for f in sorted((ROOT / pkg).rglob("*.py"))]


def test_no_import_runs_up_a_tier_or_across_tier_two() -> None:
    wrong = []
    for pkg, path in modules():
        rel = path.relative_to(ROOT).as_posix()
        for module in imports(path):
            top = module.split(".")[0]
            if top not in TIERS or top == pkg or (rel, top) in EXCEPTIONS:
                continue
            if TIERS[top] >= TIERS[pkg]:
                wrong.append(f"{rel} imports {module} (tier {TIERS[top]} from tier {TIERS[pkg]})")
    assert not wrong, "\n".join(wrong)


def test_planning_is_pure() -> None:
    planning = sorted((ROOT / "scheduler" / "planning").rglob("*.py"))
    assert planning
    wrong = []
    for path in planning:
        for module in imports(path):
            top = module.split(".")[0]
            inside = module.startswith(("scheduler.planning", "scheduler.errors"))
            if top in PLANNING_FORBIDDEN or (top == "scheduler" and not inside):
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(("rel", "top"), sorted(EXCEPTIONS))
def test_every_exception_is_still_needed(rel: str, top: str) -> None:
    assert any(m.split(".")[0] == top for m in imports(ROOT / rel)), (
        f"{rel} no longer imports {top}: drop it from EXCEPTIONS")


def test_the_rules_can_fail(tmp_path: Path) -> None:
    """The parser sees a function-level import and resolves a relative one."""
    bad = tmp_path / "probe.py"
    bad.write_text("def f():\n    from worker.models import build_model\n"
                   "from ..scheduler import cli\n")
    assert {"worker.models", "scheduler"} <= imports(bad, ["fedcore"])
