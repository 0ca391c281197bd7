"""The shared bridge connection against a stand-in daemon on a real Unix socket."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator

import pytest

from proto import bridge
from proto.bridge_connection import BridgeConnection
from proto.errors import StreamClosed


@pytest.fixture
def socket_path() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as tmp:
        yield os.path.join(tmp, "fabricd.sock")


def _daemon(path: str, serve: Callable[[socket.socket], None]) -> threading.Thread:
    """Accept one client on `path`, read its Hello, then `serve` it and hang up."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def run() -> None:
        conn, _ = listener.accept()
        listener.close()
        with conn:
            hello, _ = bridge.recv_bridge(conn, 0)
            assert isinstance(hello, bridge.Hello)
            serve(conn)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _until_hung_up(conn: socket.socket) -> None:
    with pytest.raises(StreamClosed):
        bridge.recv_bridge(conn, 0)


def _connect(path: str, seen: list[bridge.BridgeMessage]) -> BridgeConnection:
    conn = BridgeConnection(path, bridge.Hello(role="scheduler"), max_payload=1 << 20,
                            on_message=lambda msg, _payload: seen.append(msg), name="test-reader")
    conn.start()
    return conn


def _readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "test-reader"]


def test_replies_find_their_requests_by_id_and_other_frames_go_to_on_message(
        socket_path: str) -> None:
    def serve(conn: socket.socket) -> None:
        first, _ = bridge.recv_bridge(conn, 0)
        second, _ = bridge.recv_bridge(conn, 0)
        bridge.send_bridge(conn, bridge.Error(reason="just news"))
        for req in (second, first):  # answered in the other order
            assert isinstance(req, bridge.ControlSend)
            bridge.send_bridge(conn, bridge.ControlResult(
                request_id=req.request_id, ok=True, body={"to": req.request_id}, reason=""))
        _until_hung_up(conn)

    daemon = _daemon(socket_path, serve)
    seen: list[bridge.BridgeMessage] = []
    conn = _connect(socket_path, seen)
    results: dict[str, bridge.ControlResult] = {}

    def ask(rid: str) -> None:
        results[rid] = conn.exchange(bridge.ControlSend(request_id=rid, target_cluster="a",
                                                        body={}), bridge.ControlResult, rid, 30)

    asking = [threading.Thread(target=ask, args=(rid,)) for rid in ("r1", "r2")]
    for t in asking:
        t.start()
    for t in asking:
        t.join(30)
    conn.close()
    daemon.join(30)
    assert {rid: dict(r.body) for rid, r in results.items()} == {"r1": {"to": "r1"},
                                                                  "r2": {"to": "r2"}}
    assert [type(m) for m in seen] == [bridge.Error]


def test_a_waiting_request_fails_naming_the_socket_when_the_daemon_hangs_up(
        socket_path: str) -> None:
    closed: list[BaseException | None] = []
    daemon = _daemon(socket_path, lambda conn: bridge.recv_bridge(conn, 0))
    conn = BridgeConnection(socket_path, bridge.Hello(role="executor"), max_payload=1 << 20,
                            on_message=lambda *_: None, on_closed=closed.append)
    conn.start()
    with pytest.raises(StreamClosed, match=f"bridge to fabricd at {socket_path} closed"):
        conn.exchange(bridge.ControlSend(request_id="r1", target_cluster="a", body={}),
                      bridge.ControlResult, "r1", 30)
    assert conn.closed.wait(30)
    with pytest.raises(StreamClosed, match=socket_path):  # and later ones fail at once
        conn.exchange(bridge.ControlSend(request_id="r2", target_cluster="a", body={}),
                      bridge.ControlResult, "r2", 30)
    conn.close()
    daemon.join(30)
    assert len(closed) == 1 and isinstance(closed[0], StreamClosed)


def test_close_joins_the_reader_thread(socket_path: str) -> None:
    daemon = _daemon(socket_path, _until_hung_up)
    conn = _connect(socket_path, [])
    assert len(_readers()) == 1
    conn.close()
    assert _readers() == []  # joined by close itself, not just asked to stop
    daemon.join(30)


def test_connecting_to_no_daemon_names_the_socket(socket_path: str) -> None:
    with pytest.raises(ConnectionError, match=f"fabricd bridge at {socket_path}"):
        BridgeConnection(socket_path, bridge.Hello(role="cli"), max_payload=0,
                         on_message=lambda *_: None)
