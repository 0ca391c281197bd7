"""Where a cluster's incoming model messages wait for the node that needs them."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from worker.errors import WorkerError

Key = tuple[int, str, str, str]  # (round, kind, source node, target node)


class MessageTimeout(WorkerError, TimeoutError):
    """A node waited too long for a neighbour's message."""


@dataclass(frozen=True)
class Envelope:
    """One model message: weights (or a handle the context can resolve) and sample count."""

    weights: Any
    samples: int
    nbytes: int
    remote: bool


class Mailbox:
    """Thread-safe store of messages keyed by (round, kind, src, dst).

    A message is handed out once: `take` removes it, so memory is released as soon as
    its reader has it (object references are freed when the last holder drops them), and
    a repeat of a key already stored or taken is ignored. A message from another cluster
    carries its message id, which is applied at most once: a second copy (fabricd
    retries under the same id until the sender hears it arrived) is a duplicate even
    after its round was reopened for a repeat. Each waiter sleeps on its own
    event, so a message wakes only the node waiting for it (a thousand clients of a round
    do not wake each other).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)  # a round aborted, or the mailbox closed
        self._items: dict[Key, Envelope] = {}
        self._taken: set[Key] = set()
        self._waiters: dict[Key, threading.Event] = {}
        self._closed: str | None = None
        self._aborted: dict[int, str] = {}  # round -> why its waits were cut short
        self._applied: dict[str, Key] = {}  # message id -> the key it was stored under

    def put(self, key: Key, envelope: Envelope, message_id: str = "") -> bool:
        """Store a message; False (nothing changes) if it is a repeat: of a `message_id`
        already applied, or of a key already stored or taken."""
        with self._lock:
            if message_id and message_id in self._applied:
                return False
            if key in self._items or key in self._taken:
                return False
            self._items[key] = envelope
            if message_id:
                self._applied[message_id] = key
            waiter = self._waiters.get(key)
        if waiter is not None:
            waiter.set()
        return True

    def take(self, key: Key, timeout: float, where: str = "") -> Envelope:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if key in self._items:
                    self._taken.add(key)
                    self._waiters.pop(key, None)
                    return self._items.pop(key)
                if key[0] in self._aborted:
                    raise MessageTimeout(f"round {key[0]} was aborted while waiting for "
                                         f"{_describe(key)}: {self._aborted[key[0]]}")
                if self._closed is not None:
                    raise MessageTimeout(f"stopped while waiting for {_describe(key)}: "
                                         f"{self._closed}")
                waiter = self._waiters.setdefault(key, threading.Event())
            left = deadline - time.monotonic()
            if left <= 0:
                with self._lock:
                    self._waiters.pop(key, None)
                raise MessageTimeout(
                    f"no {key[1]!r} message from node {key[2]}{where} to node {key[3]} "
                    f"in round {key[0]} after {timeout:.0f} s"
                )
            waiter.wait(left)

    def close(self, reason: str) -> None:
        """Wake every waiter with an error (used when the job is stopped)."""
        with self._lock:
            self._closed = reason
            waiters = list(self._waiters.values())
            self._ended.notify_all()
        for waiter in waiters:
            waiter.set()

    def abort_round(self, round_index: int, reason: str) -> None:
        """Wake every waiter of `round_index` with an error and forget its messages (a
        failed round is run again from the start, if at all)."""
        with self._lock:
            self._aborted[round_index] = reason
            for key in [k for k in self._items if k[0] == round_index]:
                del self._items[key]
            waiters = [w for k, w in self._waiters.items() if k[0] == round_index]
            self._ended.notify_all()
        for waiter in waiters:
            waiter.set()

    def applied(self, message_id: str) -> bool:
        """True if the message with this id was stored (it will not be stored again)."""
        with self._lock:
            return message_id in self._applied

    def reopen_round(self, round_index: int) -> None:
        """Let `round_index` be waited on again (before it is repeated): its waits are no
        longer cut short and its messages may arrive anew (under new message ids: the ids
        already applied stay refused)."""
        with self._lock:
            self._aborted.pop(round_index, None)
            self._taken = {k for k in self._taken if k[0] != round_index}

    def forget_before(self, round_index: int, kinds: tuple[str, ...]) -> None:
        """Drop what rounds before `round_index` left of messages of `kinds` (unread ones,
        the memory of what was taken): a round's keys are only repeated while it runs."""
        with self._lock:
            for key in [k for k in self._items if k[0] < round_index and k[1] in kinds]:
                del self._items[key]
            self._taken = {k for k in self._taken if k[0] >= round_index or k[1] not in kinds}
            # the transport refuses those rounds outright now, so their ids need no memory
            self._applied = {m: k for m, k in self._applied.items()
                             if k[0] >= round_index or k[1] not in kinds}

    def aborted(self, round_index: int) -> str | None:
        """Why `round_index`'s waits were cut short (or the mailbox closed), else None."""
        with self._lock:
            return self._aborted.get(round_index, self._closed)

    def wait_aborted(self, round_index: int, timeout: float) -> str | None:
        """Sleep up to `timeout` seconds, woken at once if `round_index` is aborted (or the
        mailbox closed); why it was, else None."""
        with self._ended:
            self._ended.wait_for(lambda: round_index in self._aborted or self._closed is not None,
                                 timeout)
            return self._aborted.get(round_index, self._closed)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


def _describe(key: Key) -> str:
    return f"{key[1]!r} message {key[2]} -> {key[3]} (round {key[0]})"
