"""Duplicate suppression that a flood cannot evict (fabricd._dedup), as a pure table.

The daemon-level test is tests/fabricd/test_security_flood.py; here the real default
bound meets a real 100,000-id flood in well under a second.
"""

from __future__ import annotations

import pytest

from fabricd._dedup import DUPLICATE, IDS_PER_SCOPE, DeliveredWindows
from proto.messages import UpdateHeader


def _h(job: str, rnd: int, mid: str) -> UpdateHeader:
    return UpdateHeader(job_id=job, round=rnd, source_node="s", target_node="t", message_id=mid,
                        tensor_count=1, byte_length=1, sha256=b"\0" * 32)


def _deliver(table: DeliveredWindows, cluster: str, header: UpdateHeader) -> str | None:
    verdict = table.verdict(cluster, header)
    if verdict is None:
        table.record(cluster, header)
    return verdict


def test_a_100000_id_flood_in_one_round_never_re_delivers_the_first_id() -> None:
    table = DeliveredWindows()
    first = _h("j", 1, "j/1/update/c0/server")
    assert _deliver(table, "a", first) is None
    refused = sum(_deliver(table, "a", _h("j", 1, f"flood-{i}")) is not None for i in range(100_000))
    assert refused == 100_000 - IDS_PER_SCOPE + 1  # refused past the quota, not evicted
    assert table.verdict("a", first) == DUPLICATE
    assert len(table) == IDS_PER_SCOPE


def test_a_flood_across_rounds_closes_old_rounds_which_are_then_refused() -> None:
    table = DeliveredWindows(ids_per_scope=100, round_window=64)
    first = _h("j", 1, "first")
    assert _deliver(table, "a", first) is None
    for r in range(2, 12):
        for i in range(50):
            assert _deliver(table, "a", _h("j", r, f"{r}-{i}")) is None
    assert len(table) <= 100
    why = table.verdict("a", first)
    assert why is not None and why.startswith("stale: round 1 ") and "limits.dedup_ids_per_member" in why


def test_rounds_beyond_the_window_close_and_round_0_stays() -> None:
    table = DeliveredWindows(ids_per_scope=1000, round_window=3)
    final = _h("j", 0, "final")
    assert _deliver(table, "a", final) is None
    assert _deliver(table, "a", _h("j", 1, "r1")) is None
    assert _deliver(table, "a", _h("j", 5, "r5")) is None
    assert table.verdict("a", _h("j", 1, "r1")).startswith("stale:")  # type: ignore[union-attr]
    assert table.verdict("a", _h("j", 2, "r2")) is None  # 5 - 3: still open
    assert table.verdict("a", final) == DUPLICATE


def test_one_members_flood_does_not_touch_another_members_scope() -> None:
    table = DeliveredWindows(ids_per_scope=50, round_window=64)
    genuine = _h("j", 1, "genuine")
    assert _deliver(table, "b", genuine) is None
    for r in range(1, 40):
        for i in range(20):
            _deliver(table, "a", _h("j", r, f"{r}-{i}"))
    assert table.verdict("b", genuine) == DUPLICATE
    assert table.verdict("b", _h("j", 2, "next")) is None
    held = len(table)
    assert table.forget_job("j") == held and len(table) == 0


def test_forgetting_a_job_keeps_other_jobs_ids() -> None:
    table = DeliveredWindows()
    for job, mid in (("a", "a/1/up/c0/s"), ("a", "a/2/up/c0/s"), ("ab", "ab/1/up/c0/s"),
                     ("b", "b/1/up/c0/s")):
        assert _deliver(table, "x", _h(job, 1, mid)) is None
    assert table.forget_job("a") == 2
    assert table.verdict("x", _h("a", 1, "a/1/up/c0/s")) is None  # a new run of job "a" gets through
    assert table.verdict("x", _h("ab", 1, "ab/1/up/c0/s")) == DUPLICATE
    assert table.verdict("x", _h("b", 1, "b/1/up/c0/s")) == DUPLICATE


def test_a_message_id_is_a_duplicate_only_from_the_cluster_that_delivered_it() -> None:
    table = DeliveredWindows()
    update = _h("j", 1, "j/1/up/c0/s")
    assert _deliver(table, "a", update) is None
    assert table.verdict("a", update) == DUPLICATE
    assert table.verdict("b", update) is None
    assert _deliver(table, "b", update) is None
    assert table.verdict("b", update) == DUPLICATE and len(table) == 2


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        DeliveredWindows(ids_per_scope=0)
