"""Control requests on /fedpilot/control/1.0.0: a request/response relay between bridge clients.

A bridge client sends ``ControlSend(request_id, target_cluster, body)``; this daemon opens
a control stream to the target's daemon with ``ControlRequest(request_id, body)``; that
daemon gives a ``ControlDelivery`` (with the sender's verified cluster id, peer id and
certificate role) to a local client, whose ``ControlReply`` travels back as
``ControlResponse`` and reaches the sender as ``ControlResult``. No local client means
a clear refusal, never a silent drop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID

from fabricd._streams import close_quietly, read_message_exact, remote_peer, write_message
from fabricd.logs import get_logger
from fabricd.membership import Membership
from proto.certs import Certificate
from proto.errors import ProtocolError
from proto.ids import MAX_MESSAGE_BYTES, PROTOCOL_CONTROL
from proto.messages import ControlRequest, ControlResponse

log = get_logger("fabricd.control")

CONTROL_LIMIT = MAX_MESSAGE_BYTES + 1024


class ControlSink(Protocol):
    async def control(self, request_id: str, from_cluster: str, from_peer: str, from_role: str,
                      body: dict[str, Any]) -> tuple[bool, dict[str, Any], str]:
        """Deliver a control request locally and return (ok, body, reason) of the reply."""


Seal = Callable[[dict[str, Any]], dict[str, Any]]
Unseal = Callable[[dict[str, Any], str], tuple[Certificate, dict[str, Any]]]


class ControlService:
    """`seal` signs every outgoing body; `unseal(body, sender_peer)` verifies every incoming
    one (see fabricd.signing) and raises ProtocolError with the reason to refuse it."""

    def __init__(self, host: IHost, membership: Membership, sink: ControlSink, *,
                 timeout: float = 30.0, seal: Seal | None = None,
                 unseal: Unseal | None = None, cluster_id: str = "") -> None:
        self.host = host
        self.m = membership
        self.sink = sink
        self.timeout = timeout
        self.seal = seal
        self.unseal = unseal
        self.cluster_id = cluster_id
        self.served = 0
        self.refused = 0

    def register(self) -> None:
        self.host.set_stream_handler(
            PROTOCOL_CONTROL,  # type: ignore[arg-type]
            self.m.guard("control", self._handle, on_refuse=self._refuse),
        )

    async def _refuse(self, stream: INetStream, reason: str) -> None:
        await write_message(stream, ControlResponse(request_id="unknown", ok=False, body={}, reason=reason))

    async def _reply_error(self, stream: INetStream, peer: str, request_id: str, reason: str) -> None:
        self.refused += 1
        log.warning("control.rejected", peer=peer, request_id=request_id, reason=reason)
        await write_message(stream, ControlResponse(request_id=request_id, ok=False, body={}, reason=reason))
        await close_quietly(stream)

    async def _handle(self, stream: INetStream) -> None:
        peer = remote_peer(stream)
        cert = self.m.member_certificate(peer)
        try:
            with trio.fail_after(self.timeout):
                msg = await read_message_exact(stream, CONTROL_LIMIT)
        except (ProtocolError, EOFError, trio.TooSlowError) as exc:
            await self._reply_error(stream, peer, "unknown", f"bad control frame: {type(exc).__name__}: {exc}")
            return
        if not isinstance(msg, ControlRequest):
            await self._reply_error(stream, peer, "unknown", f"expected ControlRequest, got {msg.TYPE}")
            return
        if cert is None:
            await self._reply_error(stream, peer, msg.request_id, "not a member")
            return
        body = msg.body
        if self.unseal is not None:
            try:
                cert, body = self.unseal(msg.body, peer)
            except ProtocolError as exc:
                await self._reply_error(stream, peer, msg.request_id,
                                        f"rejected by cluster {self.cluster_id}: {exc}")
                return
        with trio.move_on_after(self.timeout) as scope:
            ok, body, reason = await self.sink.control(
                msg.request_id, cert.cluster_id, peer, cert.role, body)
        if scope.cancelled_caught:
            ok, body, reason = False, {}, f"no reply from the local client within {self.timeout:.0f} s"
        self.served += 1
        log.info("control.served", peer=peer, cluster=cert.cluster_id, request_id=msg.request_id, ok=ok,
                 reason=reason)
        await write_message(stream, ControlResponse(request_id=msg.request_id, ok=ok, body=body, reason=reason))
        await close_quietly(stream)

    async def send(self, peer_id: str, request_id: str, body: dict[str, Any]) -> ControlResponse:
        """Send one control request to a member daemon and return its response."""
        if self.seal is not None:
            body = self.seal(body)
        await self.m.wait_verdict(peer_id)
        stream = await self.host.new_stream(ID.from_base58(peer_id), [PROTOCOL_CONTROL])  # type: ignore[list-item]
        try:
            await write_message(stream, ControlRequest(request_id=request_id, body=body))
            with trio.fail_after(self.timeout + 5):
                msg = await read_message_exact(stream, CONTROL_LIMIT)
        finally:
            await close_quietly(stream)
        if not isinstance(msg, ControlResponse):
            raise ProtocolError(f"expected ControlResponse from {peer_id}, got {msg.TYPE}")
        return msg
