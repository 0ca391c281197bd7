"""Bounds on what py-libp2p 0.8.1's yamux buffers for a remote peer.

Its receive loop appends every DATA frame to the stream's buffer whether or not anybody
reads the stream, and only *warns* when the peer sends past the window it was granted:
a peer that ignores flow control (or opens streams nobody reads) makes the daemon hold
whatever it sends. So every connection's stream buffers are counted, and the connection
is cut (not the data merely dropped: the peer is not following the protocol) when

- one stream holds more unread bytes than twice the largest window this side grants
  (a peer honouring flow control never gets there), or
- a peer that has not proved membership has more than ``PREAUTH_BUFFER_BYTES`` unread
  bytes buffered over all its streams (a member's hello is a few KiB).

Which peers are members is asked of the function given to ``trust`` (the daemon's
membership); without one, only the per-stream bound applies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from libp2p.stream_muxer.yamux import yamux as _yamux

from fabricd._bounded import Throttle
from fabricd.errors import FabricdError
from fedcore.logs import get_logger

log = get_logger("fabricd.muxguard")

#: unread bytes buffered for a peer that has not proved membership (all streams)
PREAUTH_BUFFER_BYTES = 2 * 1024 * 1024

_trusted: Callable[[str], bool] | None = None
_throttle = Throttle(log)
_applied = False
cut_connections = 0


class BufferOverrun(FabricdError):
    """A peer made this side buffer more than it may; its connection is being cut."""


def trust(is_member: Callable[[str], bool] | None) -> None:
    """Tell the guard which peers proved membership (None: nobody is asked)."""
    global _trusted
    _trusted = is_member


def stream_limit() -> int:
    return 2 * max(_yamux.DEFAULT_WINDOW_SIZE, _yamux.MAX_WINDOW_SIZE)


class _Buffer(bytearray):
    """One stream's receive buffer; its growth and shrinkage are counted by its owner."""

    def __init__(self, owner: _Buffers, data: bytes | bytearray = b"") -> None:
        super().__init__(data)
        self.owner = owner
        owner.total += len(data)

    def extend(self, data: Any) -> None:
        n = len(data)
        self.owner.admit(len(self), n)
        super().extend(data)
        self.owner.total += n

    def __delitem__(self, index: Any) -> None:
        before = len(self)
        super().__delitem__(index)
        self.owner.total -= before - len(self)

    def clear(self) -> None:
        self.owner.total -= len(self)
        super().clear()


class _Buffers(dict[int, bytearray]):
    """A yamux connection's ``stream_buffers``, with the unread bytes of all of them."""

    def __init__(self, conn: Any) -> None:
        super().__init__()
        self.conn = conn
        self.total = 0

    def __setitem__(self, key: int, value: bytearray) -> None:
        if key in self:
            self.total -= len(super().__getitem__(key))
        if not isinstance(value, _Buffer):
            value = _Buffer(self, value)
        super().__setitem__(key, value)

    def __delitem__(self, key: int) -> None:
        self.total -= len(super().__getitem__(key))
        super().__delitem__(key)

    def pop(self, key: int, *default: Any) -> Any:
        if key in self:
            self.total -= len(super().__getitem__(key))
        return super().pop(key, *default)

    def clear(self) -> None:
        self.total = 0
        super().clear()

    def admit(self, held: int, n: int) -> None:
        """Raise BufferOverrun (and start the connection's shutdown) if ``n`` more bytes
        on a stream already holding ``held`` would pass a bound."""
        reason = None
        if held + n > stream_limit():
            reason = (f"{held + n} unread bytes on one stream, past the {stream_limit()} a peer "
                      f"honouring yamux flow control can send")
        elif self.total + n > PREAUTH_BUFFER_BYTES and _trusted is not None \
                and not _trusted(str(self.conn.peer_id)):
            reason = (f"{self.total + n} unread bytes over its streams before proving membership "
                      f"(allowance {PREAUTH_BUFFER_BYTES})")
        if reason is None:
            return
        global cut_connections
        cut_connections += 1
        _throttle.warning("mux.connection_cut", peer=str(self.conn.peer_id), reason=reason,
                          cut_total=cut_connections)
        self.conn.event_shutting_down.set()
        raise BufferOverrun(reason)


def apply() -> None:
    """Count every new yamux connection's stream buffers (idempotent)."""
    global _applied
    if _applied:
        return
    original = _yamux.Yamux.__init__

    def guarded_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.stream_buffers = _Buffers(self)

    _yamux.Yamux.__init__ = guarded_init  # type: ignore[method-assign]
    _applied = True
