"""The star root's buffered intake (worker.executor.contributions) on its own clock: when an
aggregation closes and what it takes, decided by the rule, not by the machine's speed.

Clusters a (the root's own), b and c; buffer_size 2, straggler_grace 0.5 s. A contribution of
an earlier round (a leftover) must not close an aggregation before the round's own
contributions of clusters about as fast as the others are in (PATIENCE x the time the
buffer takes to fill with fresh ones): with the grace alone, every aggregation of equal
clusters closed with the root's and the leftover, so the cluster that missed once missed
ever after."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from worker.executor import contributions
from worker.executor.contributions import PATIENCE, CloseRule, ContributionBuffer, applied
from worker.executor.mailbox import Envelope

BASE = {"w": np.zeros(2, np.float32)}


class Watched(threading.Condition):
    """The buffer's condition: `decided` is set whenever the aggregation chose to wait."""

    def __init__(self) -> None:
        super().__init__()
        self.decided = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.decided.set()
        return super().wait(timeout)


class Root:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.clock = 0.0
        monkeypatch.setattr(contributions, "time", SimpleNamespace(monotonic=lambda: self.clock))
        self.buffer = ContributionBuffer(
            CloseRule(buffered=True, buffer_size=2, max_staleness=4, grace=0.5),
            locate=lambda node: node[0], aborted=lambda r: None)
        self.cond = self.buffer._cond = Watched()
        self.taken: list[Any] = []
        self.thread: threading.Thread | None = None

    def expect(self, t: float, r: int, clusters: str) -> None:
        self.clock = t
        self.buffer.expect(r, [f"{c}{r}" for c in clusters], BASE)

    def at(self, t: float, r: int = 0, clusters: str = "") -> None:
        """Time is t; the clusters' contributions to round r are complete."""
        with self.cond:
            self.clock = t
            self.cond.decided.clear()
            for c in clusters:
                assert self.buffer.put(r, f"{c}{r}", Envelope(BASE, 1, 8, True), f"{c}/{r}")
            self.cond.notify_all()

    def collect(self, r: int) -> None:
        self.taken = []
        self.cond.decided.clear()
        self.thread = threading.Thread(
            target=lambda: self.taken.extend(self.buffer.collect(r, 1e6, own="a")), daemon=True)
        self.thread.start()

    def waiting(self) -> bool:
        """Whether the aggregation, having looked at the buffer since the last `at`, waits."""
        assert self.thread is not None
        while not self.cond.decided.wait(0.05) and self.thread.is_alive():
            pass
        return self.thread.is_alive()

    def closed(self) -> list[tuple[str, int]]:
        assert self.thread is not None
        self.thread.join(60)
        assert not self.thread.is_alive()
        return sorted((c.cluster, c.staleness) for c, _ in self.taken)

    def record(self) -> dict[str, dict[str, int]]:
        """What the round's record says the aggregation applied."""
        for contribution, envelopes in self.taken:
            contribution.updates = [(env.weights, env.samples) for _, env in envelopes]
        return applied([c for c, _ in self.taken])


def round_one(root: Root) -> None:
    """Round 1: a and b took 10 s, c not within 2 x that (a straggler: not waited for
    beyond it); c's contribution comes later."""
    root.expect(0.0, 1, "abc")
    root.at(10.0, 1, "ab")
    root.collect(1)
    assert root.waiting()
    root.at(10.0 * PATIENCE - 0.1)
    assert root.waiting()
    root.at(10.0 * PATIENCE)
    assert root.closed() == [("a", 0), ("b", 0)]
    root.at(21.0, 1, "c")  # a leftover now


def test_a_cluster_about_as_fast_as_the_others_is_waited_for_past_the_grace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    root = Root(monkeypatch)
    root.expect(0.0, 1, "abc")
    root.at(10.0, 1, "ab")      # full: the 2nd fastest took 10 s
    root.collect(1)
    assert root.waiting()
    root.at(11.0)                # the grace is over: c, not 2 x slower yet, is waited for
    assert root.waiting()
    root.at(10.0 * PATIENCE - 1.0, 1, "c")
    assert root.closed() == [("a", 0), ("b", 0), ("c", 0)]


def test_the_roots_own_cluster_is_no_yardstick(monkeypatch: pytest.MonkeyPatch) -> None:
    """It reports without a network hop: the others' time is what the buffer waits by."""
    root = Root(monkeypatch)
    root.expect(0.0, 1, "abc")
    root.at(1.0, 1, "a")
    root.collect(1)
    root.at(10.0, 1, "b")        # the buffer is full: the 2nd fastest took 10 s
    assert root.waiting()
    root.at(11.0)
    assert root.waiting()
    root.at(12.0, 1, "c")
    assert root.closed() == [("a", 0), ("b", 0), ("c", 0)]


def test_a_leftover_does_not_crowd_out_a_cluster_about_as_fast_as_the_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    root = Root(monkeypatch)
    round_one(root)
    root.expect(30.0, 2, "ab")  # c is still busy with round 1
    root.at(40.0, 2, "a")       # a's and c's leftover fill it; b took 10 s last time
    root.collect(2)
    assert root.waiting()
    root.at(41.0)
    assert root.waiting()
    root.at(30.0 + PATIENCE * 10.0 - 1.0, 2, "b")
    assert root.closed() == [("a", 0), ("b", 0), ("c", 1)]


def test_a_straggler_costs_an_aggregation_the_wait_and_no_more(
        monkeypatch: pytest.MonkeyPatch) -> None:
    root = Root(monkeypatch)
    round_one(root)
    root.expect(30.0, 2, "ab")
    root.at(40.0, 2, "a")
    root.collect(2)
    root.at(30.0 + PATIENCE * 10.0 - 0.1)
    assert root.waiting()
    root.at(30.0 + PATIENCE * 10.0)
    assert root.closed() == [("a", 0), ("c", 1)]


def test_a_cluster_known_to_be_a_straggler_gets_the_grace_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """c's last contribution took 21 s, over 2 x the 10 s the buffer takes to fill."""
    root = Root(monkeypatch)
    round_one(root)
    root.expect(30.0, 2, "abc")  # c trains again once it has sent
    root.at(40.0, 2, "ab")
    root.collect(2)
    assert root.waiting()
    root.at(40.4)
    assert root.waiting()
    root.at(40.5)
    assert root.closed() == [("a", 0), ("b", 0), ("c", 1)]


def test_a_leftover_counts_at_once_when_no_other_cluster_trains_the_round(
        monkeypatch: pytest.MonkeyPatch) -> None:
    root = Root(monkeypatch)
    round_one(root)
    root.expect(30.0, 2, "a")  # b and c are both busy
    root.at(40.0, 2, "a")
    root.collect(2)
    assert root.closed() == [("a", 0), ("c", 1)]


def test_a_clusters_late_and_fresh_contributions_in_one_aggregation_are_both_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """c trains again once it has sent: its round-1 contribution, late, and its round-2
    one meet in aggregation 2; the record keeps both (the driver reads the newest)."""
    root = Root(monkeypatch)
    round_one(root)
    root.expect(30.0, 2, "abc")
    root.at(40.0, 2, "ab")
    root.collect(2)
    root.at(40.2, 2, "c")        # within the grace
    assert root.closed() == [("a", 0), ("b", 0), ("c", 0), ("c", 1)]
    assert root.record() == {"a": {"round": 2, "staleness": 0, "updates": 1},
                             "b": {"round": 2, "staleness": 0, "updates": 1},
                             "c": {"round": 2, "staleness": 0, "updates": 2, "earlier": 1}}
