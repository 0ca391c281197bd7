"""One connection to fabricd's bridge with many requests in flight (scheduler, executor).

The object owns its Unix socket and reader thread: `exchange` sends a request and waits
for the reply carrying its id (ControlResult by request_id, SendResult by message_id);
other frames go to `on_message` on the reader. When the socket ends, waiting requests
fail with StreamClosed naming it; `close()` shuts it and joins the reader.
(`proto.bridge.BridgeClient` is the lock-step client: one frame back per frame sent.)
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from proto.bridge import (
    BridgeMessage,
    ControlResult,
    FdQueue,
    Hello,
    Payload,
    SendResult,
    connect_bridge,
    recv_bridge,
    send_payload,
)
from proto.errors import ProtocolError, StreamClosed

Reply = TypeVar("Reply", ControlResult, SendResult)


class BridgeConnection:
    """Connected and introduced (`hello`) on return, ConnectionError naming `path` if not;
    reading starts with `start()`, once the callbacks can use this object.
    `on_closed(exc)` runs once on the reader at the end: why the socket failed, or None
    after `close()`."""

    def __init__(self, path: str, hello: Hello, *, max_payload: int,
                 on_message: Callable[[BridgeMessage, bytes], None] | Callable[[BridgeMessage, Payload], None],
                 on_closed: Callable[[BaseException | None], None] | None = None,
                 name: str = "bridge-reader") -> None:
        self.path = path
        self._max_payload = max_payload
        self._on_message = on_message
        self._on_closed = on_closed
        self._write = threading.Lock()
        self._lock = threading.Lock()
        self._waiting: dict[tuple[type, str], Future[BridgeMessage]] = {}
        self._lost = ""  # why the socket ended, once it has
        self._closing = False
        self.closed = threading.Event()
        #: descriptors received (Deliveries as memfds, if ``hello.accepts_fds``)
        self._fds = FdQueue() if hello.accepts_fds else None
        self._sock = connect_bridge(path, hello)
        self._reader = threading.Thread(target=self._read_loop, name=name, daemon=True)

    def start(self) -> None:
        self._reader.start()

    def send(self, msg: BridgeMessage, payload: bytes = b"") -> None:
        """Write one frame (never interleaved with another thread's); OSError if it fails.
        A payload of at least FD_MIN_BYTES goes as a sealed memfd (proto.bridge.send_payload)."""
        with self._write:
            send_payload(self._sock, msg, payload)

    def exchange(self, msg: BridgeMessage, reply: type[Reply], reply_id: str, timeout: float,
                 payload: bytes = b"") -> Reply:
        """Send `msg` and return the `reply` carrying `reply_id`: TimeoutError after
        `timeout` s, StreamClosed if the bridge ends first, OSError if the write fails."""
        key = (reply, reply_id)
        fut: Future[BridgeMessage] = Future()
        with self._lock:
            if self._lost:
                raise StreamClosed(self._lost)
            self._waiting[key] = fut
        try:
            self.send(msg, payload)
            answer = fut.result(timeout=timeout)
        finally:
            with self._lock:
                self._waiting.pop(key, None)
        assert isinstance(answer, reply)
        return answer

    def abandon(self, reply: type[Reply], reply_id: str, why: BaseException) -> None:
        """Stop waiting for that reply: its `exchange` raises `why` now (if still waiting)."""
        with self._lock:
            fut = self._waiting.get((reply, reply_id))
            if fut is not None and not fut.done():
                fut.set_exception(why)

    def _read_loop(self) -> None:
        why: BaseException = StreamClosed("its reader stopped")  # unless the socket says
        try:
            while True:
                msg, payload = recv_bridge(self._sock, self._max_payload, fds=self._fds)
                if isinstance(msg, ControlResult | SendResult):
                    rid = msg.request_id if isinstance(msg, ControlResult) else msg.message_id
                    with self._lock:  # settled under the lock: `abandon` may race it
                        fut = self._waiting.get((type(msg), rid))
                        if fut is not None and not fut.done():
                            fut.set_result(msg)
                else:
                    # a mapping comes only if the Hello said accepts_fds, i.e. to an
                    # on_message that takes Payload
                    self._on_message(msg, payload)  # type: ignore[arg-type]
        except (OSError, ProtocolError) as exc:
            why = exc
        finally:
            with self._lock:
                self._lost = f"bridge to fabricd at {self.path} closed: {why}"
                for fut in self._waiting.values():
                    if not fut.done():
                        fut.set_exception(StreamClosed(self._lost))
            if self._fds is not None:
                self._fds.close_all()
            self.closed.set()
            if self._on_closed is not None:
                self._on_closed(None if self._closing else why)

    def close(self, timeout: float = 10.0) -> None:
        """Shut the socket (waiting requests fail) and join the reader for up to `timeout` s
        (it ends at once unless `on_message` is busy)."""
        self._closing = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self._reader.ident is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout)
        self._sock.close()
        self.closed.set()
