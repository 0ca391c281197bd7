"""fabricd: the peer-to-peer daemon that joins one Ray cluster to the fedpilot-fabric mesh.

Public surface: ``run(config)`` / ``Daemon`` (fabricd.daemon), ``load_config`` / ``Config`` /
``ConfigError`` (fabricd.config), and the ``fabricd`` command line (fabricd.cli). Everything
else (``_host``, ``_fastpath``, ``_streams``) is private machinery. Names are loaded lazily
so that ``fabricd status`` does not pay for importing libp2p.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Config", "ConfigError", "Daemon", "load_config", "run"]

_HOMES = {"Config": "fabricd.config", "ConfigError": "fabricd.config", "load_config": "fabricd.config",
          "Daemon": "fabricd.daemon", "run": "fabricd.daemon"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'fabricd' has no attribute {name!r}")
