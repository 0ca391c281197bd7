"""The daemon's half of end-to-end delivery: an update counts as delivered only when the
executor that took the Delivery answered ``ok`` (no answer in time, a refusal, a client
that left, an answer from someone else: each is a DeliveryError the sender hears)."""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from fabricd.bridge import BridgeServer
from fabricd.updates import DeliveryError
from proto.bridge import BridgeStream, Delivery, DeliveryResult, Hello
from proto.messages import UpdateHeader, is_transient_rejection

BODY = b"safetensors-ish body"
HEADER = UpdateHeader(job_id="j1", round=2, source_node="c1", target_node="server",
                      message_id="j1/2/up/c1/server", tensor_count=1, byte_length=len(BODY),
                      sha256=hashlib.sha256(BODY).digest())


class Server:
    def __init__(self, server: BridgeServer) -> None:
        self.server = server

    async def attach(self, *, answers: bool = True, job: str = "j1") -> BridgeStream:
        stream = BridgeStream(await trio.open_unix_socket(str(self.server.path)), 1 << 20)
        await stream.send(Hello(role="executor", cluster_id="b", job_id=job,
                                answers_deliveries=answers))
        before = len(self.server.clients)
        while len(self.server.clients) == before:
            await trio.sleep(0.01)
        return stream

    async def deliver(self) -> str | None:
        """None if delivered, else the DeliveryError's reason."""
        try:
            await self.server.deliver(HEADER, BODY, "a")
        except DeliveryError as exc:
            return str(exc)
        return None


@pytest.fixture
async def bridge() -> AsyncIterator[Server]:
    path = Path(tempfile.mkdtemp(prefix="fpd-")) / "bridge.sock"
    server = BridgeServer(path, backend=Any, cluster_id="b", max_payload=1 << 20,  # type: ignore[arg-type]
                          delivery_timeout=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        yield Server(server)
        nursery.cancel_scope.cancel()


async def _answer(stream: BridgeStream, **answer: Any) -> Delivery:
    msg, payload = await stream.recv()
    assert isinstance(msg, Delivery) and payload == BODY and msg.source_cluster == "a"
    await stream.send(DeliveryResult(message_id=msg.message_id, source_cluster=msg.source_cluster,
                                     **{"reason": "", **answer}))
    return msg


async def _collect(bridge: Server, into: list[str | None]) -> None:
    into.append(await bridge.deliver())


@pytest.mark.trio
async def test_delivered_only_on_the_executors_ok(bridge: Server) -> None:
    executor = await bridge.attach()
    result: list[str | None] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_collect, bridge, result)
        await _answer(executor, ok=True)
    assert result == [None]


@pytest.mark.trio
async def test_a_refusal_carries_the_executors_reason(bridge: Server) -> None:
    executor = await bridge.attach()
    for retry in (False, True):
        result: list[str | None] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_collect, bridge, result)
            await _answer(executor, ok=False, reason="round 2 is not accepted", retry=retry)
        reason = result[0]
        assert reason is not None and "refused it: round 2 is not accepted" in reason
        assert is_transient_rejection(reason) is retry


@pytest.mark.trio
async def test_no_answer_a_stranger_answer_or_a_client_that_left_is_not_a_delivery(
        bridge: Server) -> None:
    executor = await bridge.attach()
    # Another local client answers for the delivery it did not get: ignored; the real
    # consumer stays silent, so the delivery fails (transiently) at the deadline.
    stranger = await bridge.attach(job="other")
    result: list[str | None] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_collect, bridge, result)
        msg, _ = await executor.recv()
        await stranger.send(DeliveryResult(message_id=msg.message_id, source_cluster="a", ok=True,
                                           reason=""))
    assert result[0] is not None and "did not answer the delivery within 1 s" in result[0]
    assert is_transient_rejection(result[0])
    # The late answer changes nothing either.
    await executor.send(DeliveryResult(message_id=msg.message_id, source_cluster="a", ok=True,
                                       reason=""))

    result.clear()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_collect, bridge, result)
        await executor.recv()
        await executor.stream.aclose()
    assert result[0] is not None and "went away before it answered" in result[0]
    assert is_transient_rejection(result[0])
    result.clear()
    await stranger.stream.aclose()
    while bridge.server.clients:
        await trio.sleep(0.01)
    reason = await bridge.deliver()
    assert reason is not None and "no executor attached for job 'j1'" in reason
    assert is_transient_rejection(reason)


@pytest.mark.trio
async def test_a_client_that_does_not_answer_deliveries_is_acked_on_write(bridge: Server) -> None:
    legacy = await bridge.attach(answers=False)
    assert await bridge.deliver() is None
    msg, payload = await legacy.recv()
    assert isinstance(msg, Delivery) and payload == BODY
