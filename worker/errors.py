"""The root of every error the worker side raises on purpose.

Callers catch `WorkerError` (or one of its subclasses) rather than `Exception`; anything
else escaping the worker is a bug.
"""

from __future__ import annotations

from proto.errors import FabricError


class WorkerError(FabricError):
    """Something the worker was asked to do cannot be done; the message says what and why."""
