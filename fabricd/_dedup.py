"""Exactly-once delivery that no volume of updates can evict.

Delivered message ids are kept per *scope* - the verified sending cluster and the job -
and, inside a scope, per round. A scope keeps the rounds within ``round_window`` of the
newest round it delivered; an older round is *closed*: its ids are dropped and anything
sent for it later is refused, never delivered again. A scope holds at most
``ids_per_scope`` ids: when a new id would pass that, the scope closes its oldest rounds
first, and if the id's own round is the oldest one left (or round 0), the id is refused.

So memory is bounded by ``ids_per_scope`` times the scopes (clusters x jobs with a local
consumer), a member's flood only ever closes its own rounds, and an id that was
delivered is either still known (``duplicate``) or lies in a closed round (refused).

Round 0 carries job-level messages (final model, restored and checkpointed states): it
is never closed by newer rounds, only counted against the quota.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proto.messages import UpdateHeader

#: ids kept per (sending cluster, job): limits.dedup_ids_per_member
IDS_PER_SCOPE = 65_536
#: rounds behind the newest delivered one that stay open (a re-run round after a
#: recovery goes back at most a checkpoint period)
ROUND_WINDOW = 64

DUPLICATE = "duplicate"


@dataclass
class _Scope:
    #: message id -> its round
    ids: dict[str, int] = field(default_factory=dict)
    #: round -> ids delivered in it, for open rounds only
    rounds: dict[int, list[str]] = field(default_factory=dict)
    newest: int = 0
    #: rounds below this (except round 0) are closed
    floor: int = 1

    def close_below(self, floor: int) -> None:
        for r in [r for r in self.rounds if 0 < r < floor]:
            for mid in self.rounds.pop(r):
                self.ids.pop(mid, None)
        self.floor = max(self.floor, floor)


class DeliveredWindows:
    """The ids of delivered updates, per (sender cluster, job) and round, bounded."""

    def __init__(self, ids_per_scope: int = IDS_PER_SCOPE, round_window: int = ROUND_WINDOW) -> None:
        if ids_per_scope < 1 or round_window < 1:
            raise ValueError("ids_per_scope and round_window must be positive")
        self.ids_per_scope = ids_per_scope
        self.round_window = round_window
        self._scopes: dict[tuple[str, str], _Scope] = {}
        self.refused = 0

    def verdict(self, cluster: str, header: UpdateHeader) -> str | None:
        """None if ``header``'s update may be delivered, ``DUPLICATE`` if it already was,
        else why it is refused (its round is closed, or its scope is full)."""
        scope = self._scopes.get((cluster, header.job_id))
        if scope is None:
            return None
        if header.message_id in scope.ids:
            return DUPLICATE
        why = self._refusal(scope, cluster, header)
        if why is not None:
            self.refused += 1
        return why

    def _refusal(self, scope: _Scope, cluster: str, header: UpdateHeader) -> str | None:
        r = header.round
        if 0 < r < scope.floor:
            return (f"stale: round {r} of job {header.job_id!r} from cluster {cluster!r} is closed (this "
                    f"daemon keeps rounds >= {scope.floor}, within {self.round_window} rounds of "
                    f"{scope.newest} and at most {self.ids_per_scope} ids, limits.dedup_ids_per_member); "
                    f"an update of a closed round is never delivered, so not again either")
        if len(scope.ids) < self.ids_per_scope:
            return None
        # Full: only rounds older than this one may make room.
        if r == 0 or not any(0 < o < r for o in scope.rounds):
            return (f"quota: cluster {cluster!r} already has {len(scope.ids)} delivered updates of job "
                    f"{header.job_id!r} in rounds this daemon keeps open (limits.dedup_ids_per_member = "
                    f"{self.ids_per_scope}); a round's ids are released when newer rounds close it")
        return None

    def record(self, cluster: str, header: UpdateHeader) -> None:
        """Remember a delivered update (call only after ``verdict`` allowed it)."""
        scope = self._scopes.setdefault((cluster, header.job_id), _Scope())
        r = header.round
        if header.message_id in scope.ids:
            return
        if r > scope.newest:
            scope.newest = r
            scope.close_below(r - self.round_window)
        while len(scope.ids) >= self.ids_per_scope:
            older = [o for o in scope.rounds if 0 < o < r]
            if not older:
                break  # verdict() refused this unless it raced other deliveries: bounded by those
            scope.close_below(min(older) + 1)
        scope.ids[header.message_id] = r
        scope.rounds.setdefault(r, []).append(header.message_id)

    def forget_job(self, job_id: str) -> int:
        """Drop every scope of ``job_id`` (its last consumer left; the id may run again)."""
        gone = [key for key in self._scopes if key[1] == job_id]
        count = sum(len(self._scopes[key].ids) for key in gone)
        for key in gone:
            del self._scopes[key]
        return count

    def __len__(self) -> int:
        return sum(len(s.ids) for s in self._scopes.values())
