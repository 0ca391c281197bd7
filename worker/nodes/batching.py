"""TrainBatcher: one actor call for several light clients of a round.

On Ray an actor call, with its object put and get, costs a few milliseconds; a light client
(a small model on a few dozen samples) trains in about as long, so a round of a thousand
such clients paid for its calls more than for its training. The engine asks for one
client at a time, from its client threads, as each client's model arrives; the batcher
gathers the calls that start from the same model in the same round for a moment (the first
one waits `linger` seconds for the others), then sends them in chunks, one actor call per
chunk (round robin over the actor slots), and hands every caller its own client's
reference (Ray's `num_returns`). A chunk holds as many clients as train in `target_seconds`
by the measured per-client time: heavy clients keep one call each, and a batched round
trains exactly what an unbatched one does (same seeds, same starting model).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

Ref = Any

#: chunk size before any client's training time has been measured
INITIAL_CHUNK = 16


@dataclass
class _Group:
    model: Any
    clients: list[int] = field(default_factory=list)
    refs: list[Ref] | None = None
    error: BaseException | None = None


class TrainBatcher:
    """Coalesces concurrent `submit(client, model, round)` calls into batched calls.

    `one(client, model, round)` trains one client (a heavy client's own call);
    `many(clients, model, round)` trains several in one call and returns one reference
    per client. `slots` is how many actors can train at once: a group is cut into at least
    that many chunks when it has that many clients, so batching never idles an actor.
    """

    def __init__(self, one: Callable[[int, Any, int], Ref],
                 many: Callable[[Sequence[int], Any, int], list[Ref]], *, slots: int,
                 linger: float = 0.003, target_seconds: float = 0.05,
                 max_chunk: int = 64) -> None:
        self._one = one
        self._many = many
        self.slots = max(1, slots)
        self.linger = linger
        self.target_seconds = target_seconds
        self.max_chunk = max_chunk
        self.per_client: float | None = None   # measured seconds of one client's training
        self.calls = 0                         # actor calls made
        self.clients = 0                       # clients trained through them
        self._open: dict[tuple[int, int], _Group] = {}
        self._cond = threading.Condition()

    def observe(self, seconds: float) -> None:
        """One client's measured training time (moving average)."""
        if seconds < 0 or seconds != seconds:
            return
        with self._cond:
            self.per_client = (seconds if self.per_client is None
                               else 0.8 * self.per_client + 0.2 * seconds)

    def chunk_size(self) -> int:
        if self.per_client is None:
            return min(self.max_chunk, INITIAL_CHUNK)
        return max(1, min(self.max_chunk, int(self.target_seconds / max(self.per_client, 1e-6))))

    def submit(self, client: int, model: Any, round_index: int) -> Ref:
        size = self.chunk_size()
        if size <= 1:
            with self._cond:
                self.calls += 1
                self.clients += 1
            return self._one(client, model, round_index)
        key = (round_index, id(model))
        full = size * self.slots
        with self._cond:
            group = self._open.get(key)
            leader = group is None or group.model is not model
            if leader:
                group = self._open[key] = _Group(model)
            assert group is not None
            index = len(group.clients)
            group.clients.append(client)
            if not leader:
                if len(group.clients) >= full:
                    self._cond.notify_all()
                while group.refs is None and group.error is None:
                    self._cond.wait()
                if group.error is not None:
                    raise group.error
                assert group.refs is not None
                return group.refs[index]
            deadline = time.monotonic() + self.linger
            while len(group.clients) < full:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._open.get(key) is group:
                del self._open[key]  # closed: a later call starts a new group
            clients = list(group.clients)
        refs: list[Ref] = []
        error: BaseException | None = None
        try:
            chunk = max(1, min(size, -(-len(clients) // self.slots)))
            for start in range(0, len(clients), chunk):
                part = clients[start:start + chunk]
                refs.extend(self._many(part, model, round_index))
                with self._cond:
                    self.calls += 1
                    self.clients += len(part)
        except BaseException as exc:  # every caller of the group hears it
            error = exc
        with self._cond:
            group.refs, group.error = (None, error) if error is not None else (refs, None)
            self._cond.notify_all()
        if error is not None:
            raise error
        return refs[index]


__all__ = ["INITIAL_CHUNK", "TrainBatcher"]
