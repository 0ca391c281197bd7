"""The local bridge: a Unix socket (mode 0600) for executors, schedulers and the CLI.

Every client first sends ``Hello(role, cluster_id, job_id)`` (no reply). Then:

- ``StatusRequest`` -> ``StatusReply``; ``ProbeRequest`` -> ``ProbeReply`` or ``Error``.
- ``SendUpdate`` + payload -> the update is streamed to ``target_cluster`` -> ``SendResult``.
  The payload may come as a sealed memfd with the frame (proto.bridge ``payload_fd``): it
  is checked (sealed against write/grow/shrink, exactly ``byte_length`` bytes), mapped
  read-only and sent from the mapping; a descriptor that fails the check is closed and
  the update refused (``SendResult`` not ok, the reason names the problem), nothing sent.
- ``ControlSend`` -> relayed to ``target_cluster`` -> ``ControlResult``.
- A client with role ``executor`` (or ``scheduler``) and a ``job_id`` (``*`` = every job)
  receives ``Delivery`` + payload for that job's updates (as a memfd if its Hello says
  ``accepts_fds`` and the body is at least ``FD_MIN_BYTES``: the buffer the data plane
  received it into, sealed against further writes, so the bytes are not streamed again) and ``ControlDelivery`` for
  control requests addressed to it, and answers the latter with ``ControlReply``.
- A consumer whose Hello says ``answers_deliveries`` answers each ``Delivery`` with
  ``DeliveryResult``; the update is acknowledged to its sender only when that answer
  says ``ok`` (end to end: the executor accepted it). A rejection goes back to the
  sender with the executor's reason; no answer within ``delivery_timeout`` is a
  transient failure (the sender may retry under the same message id).

Requests are served concurrently, so replies can come in a different order than the
requests; match them by message_id / request_id. A malformed frame gets ``Error(reason)``
and the connection is closed (its framing is lost); the daemon keeps serving.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import trio

from fabricd._sender import ByteBudget, FillingBuffer
from fabricd.config import ensure_private_dir
from fabricd.errors import FabricdError
from fabricd.executors import ExecutorLauncher
from fabricd.updates import DeliveryError
from fedcore.logs import get_logger
from proto._bridge_fds import FD_MIN_BYTES, FdRefused, SharedMapping, take_checked, unmap_quietly
from proto.bridge import (
    BridgeMessage,
    BridgeStream,
    ControlDelivery,
    ControlReply,
    ControlResult,
    ControlSend,
    Delivery,
    DeliveryResult,
    Error,
    Hello,
    ProbeReply,
    ProbeRequest,
    SendResult,
    SendUpdate,
    StatusReply,
    StatusRequest,
    tune_socket,
)
from proto.errors import ProtocolError
from proto.messages import NO_CONSUMER, UpdateHeader

log = get_logger("fabricd.bridge")

CONSUMER_ROLES = ("executor", "scheduler")
#: SendUpdate payloads at least this large start streaming before they have fully arrived.
CUT_THROUGH_BYTES = 4 * 1024 * 1024


def _nothing() -> None:
    return None


class BridgeBackend(Protocol):
    def status(self) -> dict[str, Any]: ...

    async def probe(self, cluster_id: str, nbytes: int) -> ProbeReply: ...

    async def send_update(self, target_cluster: str, header: UpdateHeader,
                          payload: bytes | bytearray | memoryview | FillingBuffer) -> SendResult: ...

    async def send_control(self, target_cluster: str, request_id: str, body: dict[str, Any]) -> ControlResult: ...


class RequestFailed(FabricdError):
    """A bridge request that could not be served; the message goes back as Error(reason)."""


@dataclass(eq=False)
class BridgeClient:
    """One connected bridge client."""

    stream: BridgeStream
    number: int
    role: str = ""
    cluster_id: str = ""
    job_id: str = ""
    send_lock: trio.Lock = field(default_factory=trio.Lock)
    pending: dict[str, trio.MemorySendChannel[ControlReply]] = field(default_factory=dict)
    answers_deliveries: bool = False
    accepts_fds: bool = False
    #: Deliveries waiting for this client's DeliveryResult, by (source cluster, message id)
    deliveries: dict[tuple[str, str], trio.MemorySendChannel[DeliveryResult]] = field(
        default_factory=dict)
    connected_at: float = field(default_factory=time.time)

    async def send(self, msg: BridgeMessage, payload: bytes | bytearray | memoryview = b"",
                   *, fd: int | None = None) -> None:
        async with self.send_lock:
            await self.stream.send(msg, payload, fd=fd)

    def takes_job(self, job_id: str) -> bool:
        return self.role in CONSUMER_ROLES and self.job_id in (job_id, "*")


class _Unmapping:
    """Releases a SendUpdate's memfd payload: its mapping (``unmap``: no event loop needed,
    so it may run in a worker thread; again is a no-op) and then its share of the outgoing
    budget (calling the object: on the event loop)."""

    def __init__(self, view: memoryview, mapping: mmap.mmap, release: Callable[[], None]) -> None:
        self.view, self.mapping, self.release = view, mapping, release

    def unmap(self) -> None:
        self.view.release()
        unmap_quietly(self.mapping)

    def __call__(self) -> None:
        self.unmap()
        self.release()


class BridgeServer:
    """Serves the bridge socket; also the local consumer of updates and control requests."""

    def __init__(self, path: Path, backend: BridgeBackend, *, cluster_id: str,
                 max_payload: int, control_timeout: float = 30.0,
                 delivery_timeout: float = 30.0,
                 launcher: ExecutorLauncher | None = None,
                 max_outgoing_bytes: int = 2 << 30) -> None:
        self.path = path
        # Payloads read from clients and not yet sent: bounded, so a client that writes
        # faster than the network drains waits on its socket instead of growing our RSS.
        self.outgoing = ByteBudget(max_outgoing_bytes)
        self.launcher = launcher
        self.backend = backend
        self.cluster_id = cluster_id
        self.max_payload = max_payload
        self.control_timeout = control_timeout
        self.delivery_timeout = delivery_timeout
        self.clients: list[BridgeClient] = []
        self._numbers = 0
        self._deliveries = 0
        self.rejected_frames = 0
        #: called with a job id when its last executor/scheduler client left
        self.on_job_left: Callable[[str], None] | None = None

    # ---- server ------------------------------------------------------------------------

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on the socket (mode 0600) until cancelled; removes the socket file on exit."""
        if len(str(self.path)) >= 100:
            raise OSError(f"bridge socket path {self.path} is {len(str(self.path))} characters; "
                          "Unix sockets allow fewer than 100 - set bridge.socket to a shorter path")
        ensure_private_dir(self.path.parent)
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            await sock.bind(str(self.path))
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        sock.listen(64)
        listener = trio.SocketListener(sock)
        log.info("bridge.listening", path=self.path)
        try:
            async with trio.open_nursery() as nursery:
                task_status.started()
                await trio.serve_listeners(self._serve_client, [listener], handler_nursery=nursery)
        finally:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    async def _serve_client(self, stream: trio.SocketStream) -> None:
        self._numbers += 1
        tune_socket(stream.socket)
        client = BridgeClient(BridgeStream(stream, self.max_payload), self._numbers)
        try:
            async with trio.open_nursery() as nursery:
                await self._read_loop(client, nursery)
                nursery.cancel_scope.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception as exc:  # noqa: BLE001 - one client's failure must not stop the bridge
            log.warning("bridge.client_error", client=client.number, role=client.role or "?",
                        reason=f"{type(exc).__name__}: {exc}")
        finally:
            if client in self.clients:
                self.clients.remove(client)
                log.info("bridge.client_left", client=client.number, role=client.role, job=client.job_id)
                job = client.job_id
                if (self.on_job_left is not None and client.role in CONSUMER_ROLES
                        and job not in ("", "*")
                        and not any(c.job_id == job and c.role in CONSUMER_ROLES
                                    for c in self.clients)):
                    self.on_job_left(job)
            for channel in client.pending.values():
                channel.close()
            for waiting in client.deliveries.values():
                waiting.close()
            client.stream.close_fds()
            await stream.aclose()

    async def _read_loop(self, client: BridgeClient, nursery: trio.Nursery) -> None:
        while True:
            try:
                msg, payload, release = await self._next_frame(client, nursery)
            except EOFError:
                return
            except ProtocolError as exc:
                self.rejected_frames += 1
                reason = f"{type(exc).__name__}: {exc}"
                log.warning("bridge.rejected", client=client.number, role=client.role or "?", reason=reason)
                try:
                    await client.send(Error(reason=f"rejected frame: {reason}"))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                return
            if msg is None:
                continue  # a large SendUpdate, already being served while it arrived
            if not client.role:
                release()
                if not isinstance(msg, Hello):
                    self.rejected_frames += 1
                    reason = f"the first frame must be Hello, got {msg.TYPE}"
                    log.warning("bridge.rejected", client=client.number, reason=reason)
                    await client.send(Error(reason=reason))
                    return
                client.role, client.cluster_id, client.job_id = msg.role, msg.cluster_id, msg.job_id
                client.answers_deliveries = msg.answers_deliveries
                client.accepts_fds = msg.accepts_fds
                self.clients.append(client)
                log.info("bridge.client_joined", client=client.number, role=msg.role, job=msg.job_id or "-")
                continue
            if isinstance(msg, ControlReply):
                release()
                channel = client.pending.pop(msg.request_id, None)
                if channel is None:
                    log.warning("bridge.rejected", client=client.number,
                                reason=f"ControlReply for unknown request {msg.request_id!r}")
                    continue
                channel.send_nowait(msg)
                continue
            if isinstance(msg, DeliveryResult):
                release()
                # Only the client the Delivery went to can answer it (per-client table).
                waiting = client.deliveries.pop((msg.source_cluster, msg.message_id), None)
                if waiting is None:
                    log.warning("bridge.rejected", client=client.number,
                                reason=f"DeliveryResult for unknown delivery {msg.message_id!r} "
                                       f"from {msg.source_cluster!r} (answered too late?)")
                    continue
                waiting.send_nowait(msg)
                continue
            if isinstance(msg, StatusRequest) and client.role not in CONSUMER_ROLES:
                # Answered right here, not queued behind a new task: status must stay
                # quick while transfers keep the event loop busy (nothing is pushed to a
                # cli client, so its socket is free).
                release()
                await client.send(StatusReply(status=self.backend.status()))
                continue
            # Slow work (network) runs in its own task, so this loop keeps reading.
            nursery.start_soon(self._serve_request, client, msg, payload, release)

    async def _next_frame(self, client: BridgeClient, nursery: trio.Nursery
                          ) -> tuple[BridgeMessage | None, bytes | bytearray | memoryview, Callable[[], None]]:
        """The next frame: (message, payload, release its share of the outgoing budget).

        A payload waits for room in the budget before it is read (backpressure). A large
        SendUpdate is served while its payload still arrives (cut-through: the network send
        starts at once); then the message returned is None.
        """
        head = await client.stream.recv_frame_header()
        msg, length = head.msg, head.length
        if head.in_fd:
            return await self._fd_frame(client, msg, length)
        if not length:
            return msg, b"", _nothing
        await self.outgoing.acquire(length)
        release = self._releaser(length, 1)
        try:
            if length < CUT_THROUGH_BYTES or not client.role or not isinstance(msg, SendUpdate):
                payload = await client.stream.recv_payload(msg, length)
                assert isinstance(payload, bytearray)  # no ``into``: a fresh bytearray
                return msg, payload, release
            # Anonymous memory: the kernel zeroes its pages as recv_into first touches them
            # (bytearray(n) would memset all of it up front, holding the GIL).
            body = FillingBuffer(memoryview(mmap.mmap(-1, length)))
            release = self._releaser(length, 2)  # the sender task holds it too
            nursery.start_soon(self._serve_request, client, msg, body, release)
            try:
                await client.stream.recv_payload(msg, length, into=body.buf, progress=body.advance)
            except BaseException as exc:
                body.fail(f"{type(exc).__name__}: {exc}")
                raise
            release()
            return None, b"", _nothing
        except BaseException:
            release()
            raise

    async def _fd_frame(self, client: BridgeClient, msg: BridgeMessage, length: int
                        ) -> tuple[BridgeMessage | None, bytes | bytearray | memoryview, Callable[[], None]]:
        """A SendUpdate whose payload is the memfd that came with it: checked, mapped
        read-only (counted against the outgoing budget like bytes read) and its descriptor
        closed. A bad descriptor is closed and the update refused right here (message None);
        the connection stays (no payload bytes follow, so the framing is intact)."""
        if not isinstance(msg, SendUpdate) or not client.role:
            raise FdRefused(f"only a SendUpdate after Hello may pass its payload in a file "
                            f"descriptor, not {msg.TYPE}")  # its fd: closed with the connection
        await self.outgoing.acquire(length)
        # taken only now: while it waits for the budget it stays in the connection's queue,
        # which is closed however the connection ends
        fd = client.stream.take_fd()
        if fd is None:
            self.outgoing.release(length)
            reason = ("bridge: the SendUpdate says its payload is in a file descriptor, but none "
                      "came with the frame (send it with SCM_RIGHTS on the frame's first byte); "
                      "nothing was sent")
            await self._refuse_update(client, msg, reason)
            return None, b"", _nothing
        try:
            mapping = take_checked(fd, length)  # closes fd on every path
        except FdRefused as exc:
            self.outgoing.release(length)
            await self._refuse_update(client, msg, f"bridge: {exc}; nothing was sent")
            return None, b"", _nothing
        except BaseException:
            self.outgoing.release(length)
            raise
        view = memoryview(mapping)
        return msg, view, _Unmapping(view, mapping, self._releaser(length, 1))

    async def _refuse_update(self, client: BridgeClient, msg: SendUpdate, reason: str) -> None:
        self.rejected_frames += 1
        log.warning("bridge.rejected", client=client.number, role=client.role or "?",
                    message_id=msg.message_id, reason=reason)
        try:
            await client.send(SendResult(message_id=msg.message_id, ok=False, reason=reason[:1000],
                                         bytes=0))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def _releaser(self, nbytes: int, holders: int) -> Callable[[], None]:
        left = [holders]

        def release() -> None:
            left[0] -= 1
            if left[0] == 0:
                self.outgoing.release(nbytes)

        return release

    async def _serve_request(self, client: BridgeClient, msg: BridgeMessage,
                             payload: bytes | bytearray | memoryview | FillingBuffer,
                             release: Callable[[], None] = lambda: None) -> None:
        try:
            try:
                reply, reply_payload = await self._dispatch(msg, payload)
            except RequestFailed as exc:
                reply, reply_payload = Error(reason=str(exc)), b""
            finally:
                del payload
            try:
                await client.send(reply, reply_payload)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                log.info("bridge.client_gone", client=client.number, reply=reply.TYPE)
        finally:
            # after the reply: unmapping a large payload takes milliseconds (10-20 ms for
            # 64 MiB here), in a worker thread so that this loop goes on meanwhile
            if isinstance(release, _Unmapping):
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(release.unmap)
            release()

    async def _dispatch(self, msg: BridgeMessage, payload: bytes | bytearray | memoryview | FillingBuffer
                        ) -> tuple[BridgeMessage, bytes]:
        if isinstance(msg, StatusRequest):
            return StatusReply(status=self.backend.status()), b""
        if isinstance(msg, ProbeRequest):
            return await self.backend.probe(msg.cluster_id, msg.bytes), b""
        if isinstance(msg, SendUpdate):
            return await self.backend.send_update(msg.target_cluster, msg.header(), payload), b""
        if isinstance(msg, ControlSend):
            return await self.backend.send_control(msg.target_cluster, msg.request_id, msg.body), b""
        raise RequestFailed(f"a client may not send {msg.TYPE} on the bridge")

    # ---- local consumer (updates and control) -----------------------------------------

    def _consumers(self, job_id: str, role: str | None = None) -> list[BridgeClient]:
        found = [c for c in self.clients if c.takes_job(job_id)]
        exact = [c for c in found if c.job_id == job_id] or found
        if role:
            exact = [c for c in exact if c.role == role]
        return exact

    def update_consumer(self, job_id: str) -> BridgeClient | None:
        """The client that takes ``job_id``'s updates: an executor if one is attached, else a
        scheduler (the final model of a job reaches the scheduler as an update); within a
        role a client of exactly this job before a ``*`` one, the newest first."""
        found = [c for c in self.clients if c.takes_job(job_id)]
        for role in CONSUMER_ROLES:
            of_role = [c for c in found if c.role == role]
            exact = [c for c in of_role if c.job_id == job_id] or of_role
            if exact:
                return exact[-1]
        return None

    def consumer_for(self, job_id: str) -> str | None:
        if self.update_consumer(job_id) is not None:
            return None
        return self._no_consumer(job_id)

    def _no_consumer(self, job_id: str) -> str:
        # transient: a restarting executor (or daemon) attaches again within seconds
        return (f"unavailable: {NO_CONSUMER} for job {job_id!r} on cluster {self.cluster_id!r} "
                "(nor a scheduler client for it)")

    async def deliver(self, header: UpdateHeader, payload: bytes | bytearray | memoryview,
                      source_cluster: str) -> None:
        """Hand a verified update to the job's consumer; returns once it accepted it.

        DeliveryError (its reason goes back to the sender) if there is no consumer, it went
        away, refused the update, or (``answers_deliveries``) did not answer within
        ``delivery_timeout``; reasons of failures that may pass on a retry start with
        ``unavailable:``.
        """
        client = self.update_consumer(header.job_id)
        if client is None:
            raise DeliveryError(self._no_consumer(header.job_id))
        gone = f"unavailable: the {client.role} for job {header.job_id!r} went away"
        fd = _delivery_fd(payload) if client.accepts_fds else None
        if fd is not None:
            payload = b""
        if not client.answers_deliveries:
            try:
                await client.send(Delivery.from_header(header, source_cluster), payload, fd=fd)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise DeliveryError(f"{gone}: {exc}") from None
            return
        key = (source_cluster, header.message_id)
        if key in client.deliveries:  # UpdateService lets one copy of an id through at a time
            raise DeliveryError(f"busy: update {header.message_id!r} is being delivered; retry later")
        send, receive = trio.open_memory_channel[DeliveryResult](1)
        client.deliveries[key] = send
        try:
            await client.send(Delivery.from_header(header, source_cluster), payload, fd=fd)
            with trio.move_on_after(self.delivery_timeout):
                try:
                    answer = await receive.receive()
                except trio.EndOfChannel:
                    raise DeliveryError(f"{gone} before it answered") from None
                if answer.ok:
                    return
                prefix = "unavailable: " if answer.retry else ""
                raise DeliveryError(f"{prefix}the {client.role} on cluster {self.cluster_id!r} "
                                    f"refused it: {answer.reason}"[:1000])
            raise DeliveryError(f"unavailable: the {client.role} for job {header.job_id!r} did "
                                f"not answer the delivery within {self.delivery_timeout:.0f} s")
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise DeliveryError(f"{gone}: {exc}") from None
        finally:
            client.deliveries.pop(key, None)

    async def control(self, request_id: str, from_cluster: str, from_peer: str, from_role: str,
                      body: dict[str, Any]) -> tuple[bool, dict[str, Any], str]:
        job_id = body.get("job_id") if isinstance(body.get("job_id"), str) else None
        to_role = body.get("to_role") if isinstance(body.get("to_role"), str) else None
        if job_id:
            targets = self._consumers(job_id, to_role)
            if (not targets and self.launcher is not None and from_role == "scheduler"
                    and body.get("kind") == "job.start"):
                # a job reached this cluster: start its executor and wait until it attaches
                reason = await self.launcher.ensure(
                    job_id, lambda: bool(self._consumers(job_id, "executor")))
                if reason is not None:
                    return False, {}, reason
                targets = self._consumers(job_id, to_role)
        else:
            targets = [c for c in self.clients if c.role in CONSUMER_ROLES
                       and (to_role is None or c.role == to_role)]
        if not targets:
            what = f"job {job_id!r}" if job_id else "control requests"
            return False, {}, (f"no {to_role or 'executor'} attached for {what} on cluster "
                               f"{self.cluster_id!r}")
        client = targets[-1]
        send, receive = trio.open_memory_channel[ControlReply](1)
        # The id the local client answers to is ours, not the remote's: a peer reusing
        # another's request id can neither steal nor drop that reply.
        self._deliveries += 1
        key = f"{self._deliveries}:{request_id}"[:128]
        client.pending[key] = send
        try:
            await client.send(ControlDelivery(request_id=key, from_cluster=from_cluster,
                                              from_peer=from_peer, from_role=from_role, body=body))
            with trio.move_on_after(self.control_timeout):
                try:
                    reply = await receive.receive()
                except trio.EndOfChannel:
                    return False, {}, f"the {client.role} on cluster {self.cluster_id!r} went away"
                return reply.ok, reply.body, reply.reason
            return False, {}, f"the {client.role} did not reply within {self.control_timeout:.0f} s"
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False, {}, f"the {client.role} on cluster {self.cluster_id!r} went away"
        finally:
            client.pending.pop(key, None)

    def describe(self) -> list[dict[str, Any]]:
        return [{"client": c.number, "role": c.role, "job_id": c.job_id, "cluster_id": c.cluster_id}
                for c in self.clients]



def _delivery_fd(payload: bytes | bytearray | memoryview) -> int | None:
    """The memfd behind ``payload`` if it is a large enough shared mapping (the data plane
    received the body into one), sealed against new writes; None: send the bytes."""
    mapping = payload.obj if isinstance(payload, memoryview) else None
    if not isinstance(mapping, SharedMapping) or len(payload) < FD_MIN_BYTES:
        return None
    if len(payload) != len(mapping):
        return None  # a part of a mapping: the descriptor would hand over more than the body
    try:
        return mapping.seal_for_reading()
    except OSError as exc:  # e.g. a kernel before 5.1 (no F_SEAL_FUTURE_WRITE): send bytes
        log.info("bridge.delivery_as_bytes", reason=f"cannot seal the delivery's memfd: {exc}")
        return None
