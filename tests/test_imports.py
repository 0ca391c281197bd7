"""Every module of the project imports, from this checkout and only from it.

A module that resolves elsewhere (the editable install of another checkout, a stray file
left by a move) hides an import that a clean clone cannot satisfy: `fabricd.logs`, moved
to `fedcore.logs`, was imported by a new module and passed every local run, and only a
clean clone failed to collect. mypy does not see it (the packages are installed without
a py.typed marker, so a missing submodule reads as an untyped one).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("proto", "fedcore", "fabricd", "worker", "scheduler", "fedpilot")


def test_every_module_imports_from_this_checkout() -> None:
    for package in PACKAGES:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, package + "."):
            importlib.import_module(info.name)
    stray = {name: module.__file__ for name, module in sys.modules.items()
             if name.split(".")[0] in PACKAGES and getattr(module, "__file__", None)
             and not Path(str(module.__file__)).resolve().is_relative_to(ROOT)}
    assert not stray, f"modules imported from outside {ROOT}: {stray}"
