"""LeaseKeeper: a heartbeat that flaps under load is not a loss; silence plus the mesh's
word is, within seconds."""

from __future__ import annotations

import threading
import time
from typing import Any

from scheduler.errors import JobFailed
from scheduler.run.leases import LeaseKeeper


class Channel:
    local_cluster = "scheduler"

    def __init__(self) -> None:
        self.answering = threading.Event()
        self.answering.set()

    def request(self, cluster_id: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        if not self.answering.wait(timeout):
            raise JobFailed(f"cluster {cluster_id} did not answer {body['kind']}")
        return {}

    def take_update(self, job_id: str, source_node: str, timeout: float) -> bytes:
        raise AssertionError("not used")


def test_a_disconnected_flag_alone_does_not_lose_a_cluster_that_answers() -> None:
    channel = Channel()
    keeper = LeaseKeeper(channel, "j", ["a", "b"], lease=3.0,  # type: ignore[arg-type]
                         connected=lambda: {"a": True, "b": False}).start()
    try:
        time.sleep(4 * keeper.interval)
        assert keeper.lost() == {}  # b's heartbeats look late, but b answers its lease
        channel.answering.clear()  # now b (and a) fall silent
        deadline = time.monotonic() + 30
        while "b" not in keeper.lost() and time.monotonic() < deadline:
            time.sleep(0.1)
        loss = keeper.lost()["b"]
        assert "left the mesh" in loss.reason
        assert loss.detected - loss.last_seen > keeper.lease / 2
    finally:
        channel.answering.set()
        keeper.stop()


def test_stop_during_a_pass_starts_no_renewal_after_it(monkeypatch: Any) -> None:
    """stop() while the keeper's thread is between waking and renewing: the thread must
    not hand a renewal to a pool that stop() already shut down (it raised in the thread
    and printed a traceback under every job that ended then)."""
    crashed: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook",
                        lambda args: crashed.append(args.exc_value))  # type: ignore[arg-type]
    keeper = LeaseKeeper(Channel(), "j", ["a"], lease=1.0).start()  # type: ignore[arg-type]
    with keeper._lock:                      # the thread wakes and waits here
        time.sleep(keeper.interval + 0.3)
        stopper = threading.Thread(target=keeper.stop)
        stopper.start()
        time.sleep(0.3)
    stopper.join(timeout=30)
    keeper._thread.join(timeout=30)
    assert not stopper.is_alive() and not keeper._thread.is_alive()
    assert crashed == []
