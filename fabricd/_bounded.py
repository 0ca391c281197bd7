"""Bounded tables and throttled logging for anything a remote peer can make grow."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, TypeVar

from fedcore.logs import EventLogger

K = TypeVar("K")
V = TypeVar("V")


class BoundedDict(OrderedDict[K, V]):
    """A dict that forgets its oldest insertion once it holds more than ``limit`` entries.

    Every table a remote peer can add entries to is one of these, so a flood of peers or
    claims costs a fixed amount of memory and never grows a status reply past its limit.
    """

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: K, value: V) -> None:
        if key in self:
            self.move_to_end(key)
        super().__setitem__(key, value)
        while len(self) > self.limit:
            self.popitem(last=False)


def release_one(held: dict[str, int], peer: str) -> None:
    """One fewer of what ``peer`` holds (streams it has open here); a peer that holds none
    leaves the table, so it stays as small as what is held."""
    left = held.get(peer, 1) - 1
    if left > 0:
        held[peer] = left
    else:
        held.pop(peer, None)


class Throttle:
    """Logs an event at most once per ``every`` seconds, with how many were suppressed.

    A flood of hostile input must leave a trace in the log without filling the disk.
    """

    def __init__(self, log: EventLogger, every: float = 1.0) -> None:
        self.log = log
        self.every = every
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, event: str, **fields: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(event, -1e9) < self.every:
            self._suppressed[event] = self._suppressed.get(event, 0) + 1
            return
        self._last[event] = now
        suppressed = self._suppressed.pop(event, 0)
        if suppressed:
            fields = {**fields, "suppressed_since_last": suppressed}
        self.log.warning(event, **fields)
