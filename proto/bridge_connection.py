"""One connection to fabricd's bridge with many requests in flight (scheduler, executor).

A Unix socket and a reader thread this object owns: `exchange` sends a request and waits
for the reply carrying its id (a ControlResult by request_id, a SendResult by message_id);
every other frame goes to `on_message`, on the reader thread. When the socket ends, the
requests still waiting fail with StreamClosed naming the socket; `close()` shuts it and
joins the reader. (`proto.bridge.BridgeClient` is the lock-step client of the CLI and the
tests: one frame back per frame sent, no thread.)
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
    Hello,
    SendResult,
    recv_bridge,
    send_bridge,
    tune_socket,
)
from proto.errors import ProtocolError, StreamClosed

#: How long `close()` waits for the reader; it ends once the socket is shut, unless
#: `on_message` is still busy with the last frame.
READER_JOIN_SECONDS = 10.0

Reply = TypeVar("Reply", ControlResult, SendResult)


def _reply_key(msg: BridgeMessage) -> tuple[type, str] | None:
    if isinstance(msg, ControlResult):
        return ControlResult, msg.request_id
    if isinstance(msg, SendResult):
        return SendResult, msg.message_id
    return None


class BridgeConnection:
    """Connected and introduced (`hello`) on return, ConnectionError naming `path` if not;
    reading starts with `start()`, once the callbacks can use this object.

    `on_closed(exc)` runs once on the reader when the connection ends: `exc` says why the
    socket failed, or is None after `close()`.
    """

    def __init__(self, path: str, hello: Hello, *, max_payload: int,
                 on_message: Callable[[BridgeMessage, bytes], None],
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
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tune_socket(self._sock)
        try:
            self._sock.connect(path)
            send_bridge(self._sock, hello)
        except OSError as exc:
            self._sock.close()
            raise ConnectionError(f"cannot connect to the fabricd bridge at {path}: {exc}") from exc
        self._reader = threading.Thread(target=self._read_loop, name=name, daemon=True)

    def start(self) -> None:
        """Start the reader thread (`close()` joins it)."""
        self._reader.start()

    def send(self, msg: BridgeMessage, payload: bytes = b"") -> None:
        """Write one frame (frames from several threads never interleave); OSError if the
        socket fails."""
        with self._write:
            send_bridge(self._sock, msg, payload)

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

    def _read_loop(self) -> None:
        why: BaseException = StreamClosed("its reader stopped")  # unless the socket says
        try:
            while True:
                msg, payload = recv_bridge(self._sock, self._max_payload)
                key = _reply_key(msg)
                if key is None:
                    self._on_message(msg, payload)
                    continue
                with self._lock:
                    fut = self._waiting.get(key)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except (OSError, ProtocolError) as exc:
            why = exc
        finally:
            with self._lock:
                self._lost = f"bridge to fabricd at {self.path} closed: {why}"
                waiting = list(self._waiting.values())
            for fut in waiting:
                if not fut.done():
                    fut.set_exception(StreamClosed(self._lost))
            self.closed.set()
            if self._on_closed is not None:
                self._on_closed(None if self._closing else why)

    def close(self, timeout: float = READER_JOIN_SECONDS) -> None:
        """Shut the socket (waiting requests fail) and join the reader for up to `timeout` s."""
        self._closing = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self._reader.ident is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout)
        self._sock.close()
        self.closed.set()
