"""The gateway's dial-back (fabricd/_dialback.py) on in-memory streams: reached, not
reached, and every refusal (wrong message, a relayed link, a member asking too often, a
member that asks nothing); the asking side's reading of the answers. Real daemons finding
out by dial-back: tests/fabricd/test_relay.py."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from fabricd import _dialback
from fabricd._dialback import DialBackService, ask
from proto.codec import decode, frame
from proto.messages import DataPlaneOffer, DialBackRequest, DialBackResult
from tests.fabricd._hostile import MemoryStream


def _answer(stream: MemoryStream) -> DialBackResult | None:
    if not stream.written:
        return None
    message = decode(bytes(stream.written[4:]))
    assert isinstance(message, DialBackResult), message
    return message


def _peer() -> ID:
    return ID.from_pubkey(create_new_key_pair().public_key)


async def _ask(svc: DialBackService, peer: ID, port: int, observed: tuple[str, int] | None = ("127.0.0.1", 50000),
               message: Any = None) -> DialBackResult | None:
    stream = MemoryStream(peer, frame(message or DialBackRequest(port=port)), observed)
    await svc._handle(stream)  # type: ignore[arg-type]
    assert stream.closed
    return _answer(stream)


@pytest.mark.trio
async def test_the_gateway_dials_the_observed_address_at_the_announced_port() -> None:
    svc = DialBackService(host=None)  # type: ignore[arg-type]
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    reached = await _ask(svc, _peer(), port)
    assert reached == DialBackResult(reachable=True, address=f"127.0.0.1:{port}", reason="")
    for listener in listeners:
        await listener.aclose()
    # nothing listens there now: not reached, saying why and where
    missed = await _ask(svc, _peer(), port)
    assert missed is not None and not missed.reachable and missed.address == f"127.0.0.1:{port}"
    assert missed.reason.startswith("ConnectionRefusedError"), missed  # the cause, not trio's summary
    assert svc.counts == {"dialbacks_reached": 1, "dialbacks_failed": 1, "dialbacks_refused": 0}


@pytest.mark.trio
async def test_refusals_name_the_reason_and_dial_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    svc = DialBackService(host=None)  # type: ignore[arg-type]
    dialled: list[tuple[str, int]] = []

    async def dial(ip: str, port: int) -> DialBackResult:
        dialled.append((ip, port))
        return DialBackResult(reachable=False, address=f"{ip}:{port}", reason="test")
    monkeypatch.setattr(svc, "_dial", dial)
    member = _peer()
    wrong = await _ask(svc, member, 1, message=DataPlaneOffer(certificate=b"c"))
    assert wrong is not None and "expected DialBackRequest" in wrong.reason and not wrong.address
    relayed = await _ask(svc, member, 1, observed=None)
    assert relayed is not None and "relayed link" in relayed.reason
    assert await _ask(svc, member, 4001) is not None and dialled == [("127.0.0.1", 4001)]
    busy = await _ask(svc, member, 4001)  # at once again: refused, not dialled
    assert busy is not None and busy.reason.startswith("busy") and not busy.reachable
    assert await _ask(svc, _peer(), 4002) is not None  # another member is not held up
    assert dialled == [("127.0.0.1", 4001), ("127.0.0.1", 4002)]
    assert svc.counts["dialbacks_refused"] == 3


@pytest.mark.trio
async def test_a_member_that_asks_nothing_is_let_go_after_its_seconds(autojump_clock: Any) -> None:
    svc = DialBackService(host=None)  # type: ignore[arg-type]
    stream = MemoryStream(_peer(), b"", ("127.0.0.1", 1), silent=True)
    started = trio.current_time()
    with trio.fail_after(60):
        await svc._handle(stream)  # type: ignore[arg-type]
    assert trio.current_time() - started == pytest.approx(_dialback.DIAL_SECONDS)
    assert stream.closed and not stream.written


@pytest.mark.trio
@pytest.mark.parametrize("answer,verdict", [
    (DialBackResult(reachable=True, address="203.0.113.5:4001", reason=""), "reached"),
    (DialBackResult(reachable=False, address="203.0.113.5:4001", reason="no TCP connection in 3 s"), "missed"),
    (DialBackResult(reachable=False, address="", reason="busy: one dial-back per member every 10 s"), None),
    (DataPlaneOffer(certificate=b"c"), None),
    (None, None),
])
async def test_the_asker_takes_only_a_dial_back_as_a_verdict(answer: Any, verdict: str | None,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal, another message or a broken stream is no verdict (asked again later)."""
    async def open_stream(host: Any, gateway: str, protocol: str, attempts: int) -> MemoryStream:
        if answer is None:
            raise OSError("connection reset")
        return MemoryStream(_peer(), frame(answer), None)
    monkeypatch.setattr(_dialback, "open_stream", open_stream)
    result = await ask(None, "QmGateway", 4001)  # type: ignore[arg-type]
    if verdict is None:
        assert result is None
    else:
        assert result == answer and result.reachable == (verdict == "reached")
