"""One error tree: every exception class the project defines derives from
`proto.errors.FabricError`, through one root per package (issue 17)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from proto.errors import FabricError

PACKAGES = ("proto", "fedcore", "fabricd", "worker", "scheduler", "fedpilot")
#: the classes right under FabricError, each with why it is a root of its own
ROOTS = {
    "proto.errors.ProtocolError": "bad input on a wire, a bridge or in a file",
    "proto.errors.StreamClosed": "a clean end of a stream: not bad input (also EOFError)",
    "proto.job.JobSpecError": "a bad job file; clusters and the scheduler check the same spec",
    "fedcore.data.errors.DatasetError": "fedcore's root",
    "fabricd.errors.FabricdError": "fabricd's root",
    "worker.errors.WorkerError": "the worker side's root",
    "scheduler.errors.SchedulerError": "the scheduler's root",
}


def _project_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for package in PACKAGES:
        root = importlib.import_module(package)
        names = [package] + [m.name for m in pkgutil.walk_packages(root.__path__, package + ".")]
        for name in names:
            module = importlib.import_module(name)
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if issubclass(cls, BaseException) and cls.__module__ == name:
                    found[f"{name}.{cls.__qualname__}"] = cls
    return found


EXCEPTIONS = _project_exceptions()


def test_the_walk_finds_the_project_exceptions() -> None:
    assert len(EXCEPTIONS) > 40 and set(ROOTS) <= set(EXCEPTIONS)


@pytest.mark.parametrize("name", sorted(EXCEPTIONS))
def test_every_exception_derives_from_fabric_error(name: str) -> None:
    assert issubclass(EXCEPTIONS[name], FabricError), (
        f"{name} does not derive from proto.errors.FabricError: give it its package's root")


def test_one_root_per_package() -> None:
    roots = {name for name, cls in EXCEPTIONS.items() if cls is not FabricError
             and not any(issubclass(base, FabricError) and base is not FabricError
                        for base in cls.__mro__[1:])}
    assert roots == set(ROOTS)
