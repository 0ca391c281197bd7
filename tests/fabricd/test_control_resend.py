"""A round.run whose link was lost is resent, resolving the cluster again (Daemon.send_control).

The resend's resolve can fail while the new link's membership exchange is not done (issue
32: it met a stream closed with the dead gateway, "bad membership reply: StreamClosed");
it is resolved again within the resends. Nothing is sent to a peer that did not resolve
as a member, and a cluster refused before any link was lost is refused at once.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from fabricd.bridge import RequestFailed
from fabricd.daemon import LINK_RESENDS, Daemon
from proto.errors import StreamClosed

REFUSED = "cluster 'c2' (peer 12D3KooWPeer) is not a member: bad membership reply: StreamClosed"


def _daemon(resolves: list[str | Exception], sends: list[Exception | None]) -> tuple[Daemon, list[str]]:
    """A daemon whose resolve and control sends play the given outcomes; the peers sent to."""
    daemon = Daemon.__new__(Daemon)
    sent_to: list[str] = []

    async def resolve(cluster_id: str) -> str:
        outcome = resolves.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def send(peer_id: str, request_id: str, body: dict[str, Any], audience: str) -> Any:
        sent_to.append(peer_id)
        failure = sends.pop(0)
        if failure is not None:
            raise failure
        return SimpleNamespace(ok=True, body={"round": 3}, reason="")

    daemon.resolve = resolve  # type: ignore[method-assign]
    daemon.control_service = SimpleNamespace(send=send)  # type: ignore[assignment]
    return daemon, sent_to


@pytest.mark.trio
async def test_a_resent_round_run_resolves_again_until_the_new_link_is_a_member(autojump_clock: Any) -> None:
    daemon, sent_to = _daemon(["old-link", RequestFailed(REFUSED), "new-link"],
                              [StreamClosed("stream closed before a frame"), None])
    result = await daemon.send_control("c2", "s26", {"kind": "round.run"})
    assert result.ok and result.body == {"round": 3}, result.reason
    assert sent_to == ["old-link", "new-link"]


@pytest.mark.trio
async def test_a_resend_that_never_resolves_fails_naming_the_peer_and_the_lost_request(
        autojump_clock: Any) -> None:
    daemon, sent_to = _daemon(["old-link"] + [RequestFailed(REFUSED)] * LINK_RESENDS,
                              [StreamClosed("stream closed before a frame")])
    result = await daemon.send_control("c2", "s26", {"kind": "round.run"})
    assert not result.ok
    assert result.reason.startswith(REFUSED) and "the request under way was lost" in result.reason
    assert sent_to == ["old-link"]


@pytest.mark.trio
async def test_a_cluster_refused_before_any_link_was_lost_is_refused_at_once() -> None:
    daemon, sent_to = _daemon([RequestFailed(REFUSED), "never"], [])
    result = await daemon.send_control("c2", "s26", {"kind": "round.run"})
    assert not result.ok and result.reason == REFUSED
    assert sent_to == []
