"""The sending daemon's retry policy (fabricd/updates.py ``UpdateService._send_retrying``):
a body the receiver cut at its rate floor ("too slow:", this end starved) is sent again
under the same message id, a bounded number of times; a final rejection is not."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import trio

import fabricd.updates as updates
from fabricd._sender import SEND_ATTEMPTS
from fabricd.updates import UpdateService
from proto.messages import UpdateAck, UpdateHeader

BODY = b"x" * 4096


class _Stream:
    closed = False


class _Pool:
    def __init__(self) -> None:
        self.taken = 0
        self.given_back = 0

    async def take(self, peer_id: str) -> tuple[_Stream, bool]:
        self.taken += 1
        return _Stream(), False

    def give_back(self, peer_id: str, stream: _Stream) -> None:
        self.given_back += 1


def _service() -> tuple[UpdateService, _Pool]:
    service = UpdateService(None, None, None, cluster_id="a",  # type: ignore[arg-type]
                            max_update_bytes=1 << 20, max_inflight_bytes=1 << 20)
    pool = _Pool()
    service.pool = pool  # type: ignore[assignment]
    return service, pool


def _header() -> UpdateHeader:
    return UpdateHeader(job_id="j", round=1, source_node="s", target_node="t", message_id="m-1",
                        tensor_count=1, byte_length=len(BODY), sha256=hashlib.sha256(BODY).digest())


def _answers(monkeypatch: pytest.MonkeyPatch, acks: list[tuple[str, str, bool]]) -> list[str]:
    """exchange() answers with ``acks`` in turn: (status, reason, whole body written)."""
    sent: list[str] = []

    async def exchange(stream: Any, header: UpdateHeader, *args: Any) -> tuple[UpdateAck, bool]:
        sent.append(header.message_id)
        status, reason, completed = acks[len(sent) - 1]
        return UpdateAck(message_id=header.message_id, status=status, reason=reason,
                         received_bytes=0), completed

    async def no_discard(stream: Any, clean: bool) -> None:
        stream.closed = True

    async def no_sleep(seconds: float) -> None:
        await trio.lowlevel.checkpoint()

    monkeypatch.setattr(updates, "exchange", exchange)
    monkeypatch.setattr(updates, "discard", no_discard)
    monkeypatch.setattr(updates.trio, "sleep", no_sleep)
    return sent


TOO_SLOW = "too slow: 0 bytes in 5.1 s, below the minimum rate of 262144 bytes/s"


@pytest.mark.trio
@pytest.mark.parametrize("written", [False, True], ids=["cut mid-body", "cut after the whole body"])
async def test_a_body_cut_at_the_rate_floor_is_sent_again_under_its_id(
        monkeypatch: pytest.MonkeyPatch, written: bool) -> None:
    sent = _answers(monkeypatch, [("rejected", TOO_SLOW, written), ("ok", "", True)])
    service, pool = _service()
    ack = await service._send_retrying("peer", _header(), BODY, None)
    assert ack.status == "ok"
    assert sent == ["m-1", "m-1"] and service.send_retries == 1
    assert pool.given_back == 1  # only the stream that carried the acked update


@pytest.mark.trio
async def test_the_floor_retry_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    sent = _answers(monkeypatch, [("rejected", TOO_SLOW, False)] * (SEND_ATTEMPTS + 2))
    service, _ = _service()
    ack = await service._send_retrying("peer", _header(), BODY, None)
    assert ack.status == "rejected" and ack.reason == TOO_SLOW
    assert len(sent) == SEND_ATTEMPTS


@pytest.mark.trio
async def test_a_final_rejection_is_not_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    sent = _answers(monkeypatch, [("rejected", "not placed on this cluster", False), ("ok", "", True)])
    service, _ = _service()
    ack = await service._send_retrying("peer", _header(), BODY, None)
    assert ack.status == "rejected" and len(sent) == 1
