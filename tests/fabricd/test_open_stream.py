"""fabricd._sender.open_stream: which failures it retries at once, and which it leaves to
its caller (a dial that already tried every way to the peer: NoRoute)."""

from __future__ import annotations

from typing import Any

import pytest

from fabricd import _sender
from fabricd._sender import NoRoute, open_stream

PEER = "12D3KooWQERALmmBeds4KMi5uGUmiYxoyTKP6c86MAVUJVjVn2sw"


class _Host:
    """new_stream fails with ``errors`` in turn, then returns a stream."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def new_stream(self, peer_id: Any, protocols: Any) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "stream"


@pytest.fixture(autouse=True)
def _no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_sender, "backoff", lambda attempt: 0.0)


@pytest.mark.trio
async def test_a_failed_stream_open_is_retried() -> None:
    host = _Host(RuntimeError("StreamFailure under load"), ConnectionError("a reset"))
    assert await open_stream(host, PEER, "/p") == "stream"  # type: ignore[arg-type]
    assert host.calls == 3


@pytest.mark.trio
async def test_no_route_is_raised_at_once() -> None:
    host = _Host(NoRoute("relay /ip4/127.0.0.1/tcp/1/p2p/x unreachable"))
    with pytest.raises(NoRoute, match="unreachable"):
        await open_stream(host, PEER, "/p")  # type: ignore[arg-type]
    assert host.calls == 1


@pytest.mark.trio
async def test_every_attempt_failing_raises_the_last_error() -> None:
    host = _Host(*[RuntimeError(f"failure {i}") for i in range(3)])
    with pytest.raises(RuntimeError, match="failure 2"):
        await open_stream(host, PEER, "/p", attempts=3)  # type: ignore[arg-type]
    assert host.calls == 3
