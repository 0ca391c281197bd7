"""The one error type of dataset loading (its own module so every reader can raise it)."""

from __future__ import annotations

from proto.errors import FabricError


class DatasetError(FabricError, ValueError):
    """A dataset name, file or array is not usable; the message says which and why."""
