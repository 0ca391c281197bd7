"""Execution contexts: explicit objects for actors, object references and placement.

`InProcessContext` runs everything on threads (tests); `RayContext` runs on Ray. Importing
this package does not import Ray; `RayContext` is loaded on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import (
    ActorDiedError,
    ActorHandle,
    ExecutionContext,
    PlacementError,
    Ref,
    Reservation,
)
from .inprocess import InProcessContext

if TYPE_CHECKING:
    from .ray import RayContext

__all__ = [
    "ActorDiedError",
    "ActorHandle",
    "ExecutionContext",
    "InProcessContext",
    "PlacementError",
    "RayContext",
    "Ref",
    "Reservation",
]


def __getattr__(name: str) -> Any:
    if name == "RayContext":
        from .ray import RayContext

        return RayContext
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
