"""The physical clusters a plan places clients on: id, capacity, daemon peer id."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scheduler.errors import ClusterSpecError

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class ClusterSlot:
    """A cluster that can host up to `capacity` clients; `peer_id` is its daemon ("" if
    not known yet)."""

    cluster_id: str
    capacity: int
    peer_id: str = ""


def parse_clusters(text: str) -> list[ClusterSlot]:
    """Parse `a:CAP,b:CAP,...` (the `--clusters` flag). IDs must be distinct."""
    slots: list[ClusterSlot] = []
    for item in text.split(","):
        item = item.strip()
        cid, sep, cap = item.partition(":")
        if not sep or not _ID.match(cid) or not cap.strip().isdigit():
            raise ClusterSpecError(
                f"--clusters: {item!r} is not ID:CAPACITY (e.g. a:100,b:100,c:100; IDs are "
                "letters, digits, '.', '_' or '-'; capacity a whole number >= 0)")
        slots.append(ClusterSlot(cid, int(cap)))
    return as_slots(slots)


def as_slots(clusters: Sequence[ClusterSlot] | Mapping[str, int]) -> list[ClusterSlot]:
    """Normalise a cluster list (or `{cluster_id: capacity}`) and check it."""
    if isinstance(clusters, Mapping):
        slots = [ClusterSlot(str(c), int(cap)) for c, cap in clusters.items()]
    else:
        slots = list(clusters)
    if not slots:
        raise ClusterSpecError("no clusters to place clients on")
    ids = [s.cluster_id for s in slots]
    dup = sorted({c for c in ids if ids.count(c) > 1})
    if dup:
        raise ClusterSpecError(f"cluster ids must be distinct, repeated: {', '.join(dup)}")
    bad = [s for s in slots if s.capacity < 0]
    if bad:
        raise ClusterSpecError(f"cluster {bad[0].cluster_id} has capacity {bad[0].capacity}; "
                               "capacities must be >= 0")
    return slots
