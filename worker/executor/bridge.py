"""The executor's side of fabricd's bridge: one Unix socket, a reader thread.

Large payloads cross the socket as sealed memfds both ways (proto.bridge: the daemon maps
what the executor wrote; a delivery is the daemon's own receive buffer, mapped read-only
here), small ones as bytes. Outgoing updates wait for the daemon's SendResult (the far cluster's executor accepted
the update: end-to-end delivery); incoming deliveries go straight to the transport and
each is answered with a DeliveryResult (accepted, a duplicate, or refused and why), on
which the daemon acks it to its sender; control requests from the scheduler are answered
on a separate thread so that deliveries keep flowing while a round runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from proto.bridge import (
    BridgeMessage,
    ControlDelivery,
    ControlReply,
    Delivery,
    DeliveryResult,
    Error,
    Hello,
    Payload,
    SendResult,
    SendUpdate,
)
from proto.bridge_connection import BridgeConnection
from proto.errors import ProtocolError, StreamClosed
from worker.executor.transport import DeliveryNotReady, RemoteSendError

log = logging.getLogger("fedpilot.executor")


CONTROL_WORKERS = 4  # control messages answered at once (the rest queue in order)


class BridgeLink:
    """Implements `RemoteLink` over the bridge and dispatches what the daemon sends."""

    def __init__(
        self,
        path: str,
        *,
        cluster_id: str,
        job_id: str,
        on_delivery: Callable[[Delivery, Payload], bool],
        on_control: Callable[[ControlDelivery], tuple[bool, dict[str, Any], str]],
        on_replied: Callable[[ControlDelivery], None] | None = None,
        on_control_arrived: Callable[[ControlDelivery], None] | None = None,
        max_payload: int = 1 << 30,
        send_timeout: float = 300.0,
    ) -> None:
        self.cluster_id = cluster_id
        self.job_id = job_id
        self._on_delivery = on_delivery
        self._on_control = on_control
        self._on_replied = on_replied
        self._on_control_arrived = on_control_arrived
        self._send_timeout = send_timeout
        self._control_pool = ThreadPoolExecutor(max_workers=CONTROL_WORKERS,
                                                thread_name_prefix="control")
        self._conn = BridgeConnection(
            path, Hello(role="executor", cluster_id=cluster_id, job_id=job_id,
                        answers_deliveries=True, accepts_fds=True),
            max_payload=max_payload, on_message=self._on_message, on_closed=self._on_closed)
        self._conn.start()

    # -- RemoteLink ----------------------------------------------------------------------
    def send_update(self, *, target_cluster: str, job_id: str, round: int, source_node: str,
                    target_node: str, message_id: str, payload: bytes) -> None:
        msg = SendUpdate.for_payload(
            payload, target_cluster=target_cluster, job_id=job_id, round=round,
            source_node=source_node, target_node=target_node, message_id=message_id)
        try:
            result = self._conn.exchange(msg, SendResult, message_id, self._send_timeout, payload)
        except TimeoutError:
            raise RemoteSendError(f"update {message_id} to cluster {target_cluster}: fabricd "
                                  f"did not answer within {self._send_timeout:.0f} s",
                                  retry=True) from None
        except StreamClosed as exc:
            raise RemoteSendError(f"update {message_id} to cluster {target_cluster} was not "
                                  f"delivered: {exc}", retry=False) from exc
        if not result.ok:
            raise RemoteSendError(f"update {message_id} to cluster {target_cluster} was not "
                                  f"delivered: {result.reason}", retry=result.retry)

    def abandon_send(self, message_id: str, reason: str) -> None:
        """Stop waiting for the daemon's answer to that update (its round was aborted: a
        dial to a lost cluster's address may hang for minutes); its send raises now."""
        self._conn.abandon(SendResult, message_id, RemoteSendError(
            f"update {message_id} was abandoned: {reason}", retry=False))

    # -- incoming (on the connection's reader thread) ------------------------------------
    def _on_message(self, msg: BridgeMessage, payload: Payload) -> None:
        if isinstance(msg, Delivery):
            self._answer_delivery(msg, payload)
        elif isinstance(msg, ControlDelivery):
            if self._on_control_arrived is not None:  # e.g. renew the lease, even if
                self._on_control_arrived(msg)         # every control worker is busy
            # a bounded pool: a burst of control messages cannot start a thread each
            self._control_pool.submit(self._answer, msg)
        elif isinstance(msg, Error):
            log.error("event=bridge_error cluster=%s reason=%s", self.cluster_id, msg.reason)
        else:
            log.warning("event=bridge_unexpected type=%s", msg.TYPE)

    def _on_closed(self, exc: BaseException | None) -> None:
        if exc is not None:
            log.error("event=bridge_lost cluster=%s reason=%s", self.cluster_id, exc)

    def _answer_delivery(self, msg: Delivery, payload: Payload) -> None:
        """Apply one delivery and tell the daemon: it acks the sender only on ``ok``."""
        retry = False
        try:
            applied = self._on_delivery(msg, payload)
            ok, reason = True, "" if applied is not False else "duplicate"
        except DeliveryNotReady as exc:
            ok, reason, retry = False, str(exc), True
        except Exception as exc:  # a bad update must not stop the reader; its sender learns why
            ok, reason = False, f"{type(exc).__name__}: {exc}"
        if ok:
            log.debug("event=delivery_accepted message=%s %s", msg.message_id, reason)
        else:
            log.error("event=delivery_rejected message=%s retry=%s reason=%s",
                      msg.message_id, retry, reason)
        answer = DeliveryResult(message_id=msg.message_id, source_cluster=msg.source_cluster,
                                ok=ok, reason=reason[:1000], retry=retry)
        try:
            self._conn.send(answer)
        except OSError as exc:  # the daemon is gone: the reader notices next
            log.error("event=delivery_answer_lost message=%s reason=%s", msg.message_id, exc)

    def _answer(self, msg: ControlDelivery) -> None:
        try:
            ok, body, reason = self._on_control(msg)
        except Exception as exc:  # reported to the scheduler, which fails the job clearly
            log.exception("event=control_failed request=%s", msg.request_id)
            ok, body, reason = False, {}, f"{type(exc).__name__}: {exc}"
        try:
            reply = ControlReply(request_id=msg.request_id, ok=ok, body=body, reason=reason[:1000])
            self._conn.send(reply)
        except ProtocolError as exc:  # e.g. a reply over the frame limit: say so at once
            log.error("event=control_reply_refused request=%s reason=%s", msg.request_id, exc)
            try:
                self._conn.send(ControlReply(
                    request_id=msg.request_id, ok=False, body={},
                    reason=f"the executor could not send its reply: {exc}"[:1000]))
            except (OSError, ProtocolError) as again:
                log.error("event=control_reply_lost request=%s reason=%s", msg.request_id, again)
        except OSError as exc:
            log.error("event=control_reply_lost request=%s reason=%s", msg.request_id, exc)
        if self._on_replied is not None:
            self._on_replied(msg)

    def wait_closed(self, timeout: float | None = None) -> bool:
        return self._conn.closed.wait(timeout)

    def close(self) -> None:
        """Close the bridge (joining its reader) and drop control requests not yet started."""
        self._conn.close()
        self._control_pool.shutdown(wait=False, cancel_futures=True)
