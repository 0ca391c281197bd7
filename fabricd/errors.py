"""The root of every error fabricd raises on purpose.

`FabricdError` is what a caller catches (the CLI turns it into one line and exit code 1);
bad input from the wire stays a `proto.errors.ProtocolError`.
"""

from __future__ import annotations

from proto.errors import FabricError


class FabricdError(FabricError):
    """Something the daemon was asked to do cannot be done; the message says what and why."""
