from __future__ import annotations

import hashlib
import os
import socket
import struct
import tempfile
import threading

import msgpack
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from proto import bridge
from proto.errors import (
    InvalidMessage,
    MalformedFrame,
    MessageTooLarge,
    ProtocolError,
    StreamClosed,
    UnknownMessageType,
)
from tests.proto.samples import BODY, BRIDGE, HEADER

LIMIT = 1 << 20


def test_every_bridge_type_has_a_sample() -> None:
    assert {type(m).TYPE for m, _ in BRIDGE} == set(bridge.BridgeMessage.REGISTRY)


def test_sync_round_trip_of_every_type() -> None:
    a, b = socket.socketpair()
    with a, b:
        for msg, payload in BRIDGE:
            bridge.send_bridge(a, msg, payload)
            assert bridge.recv_bridge(b, LIMIT) == (msg, payload)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(StreamClosed) as info:
            bridge.recv_bridge(b, LIMIT)
        assert isinstance(info.value, EOFError) and isinstance(info.value, ConnectionError)


@pytest.mark.trio
async def test_trio_round_trip_of_every_type() -> None:
    left, right = trio.testing.memory_stream_pair()
    tx = bridge.BridgeStream(left, LIMIT)
    rx = bridge.BridgeStream(right, LIMIT)
    for msg, payload in BRIDGE:
        await tx.send(msg, payload)
        assert await rx.recv() == (msg, payload)
    await left.aclose()
    with pytest.raises(StreamClosed):
        await rx.recv()


def test_update_header_conversions() -> None:
    send = bridge.SendUpdate(target_cluster="lab-b", **HEADER)
    header = send.header()
    assert bridge.SendUpdate.from_header("lab-b", header) == send
    assert bridge.Delivery.from_header(header, "lab-a").header() == header


def _frame(header: dict[str, object], payload: bytes = b"") -> bytes:
    raw = msgpack.packb(header, use_bin_type=True)
    return struct.pack(">I", len(raw)) + raw + payload


def _recv(data: bytes, max_payload: int = LIMIT, **kw: int) -> tuple[bridge.BridgeMessage, bytes]:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        return bridge.recv_bridge(b, max_payload, **kw)


def test_rejects_oversized_header_prefix_before_reading() -> None:
    with pytest.raises(MessageTooLarge, match="over the limit of 65536"):
        _recv(struct.pack(">I", 1 << 31), max_header=65536)


def test_rejects_oversized_payload() -> None:
    header = {**bridge.SendUpdate(target_cluster="x", **HEADER).to_map(),
              "payload_length": len(BODY)}
    with pytest.raises(MessageTooLarge, match="payload of 170 bytes"):
        _recv(_frame(header, BODY), max_payload=100)


def test_rejects_payload_length_mismatches() -> None:
    header = {**bridge.SendUpdate(target_cluster="x", **HEADER).to_map(), "payload_length": 3}
    with pytest.raises(InvalidMessage, match="differs from byte_length"):
        _recv(_frame(header, b"abc"))
    header = {**bridge.Error(reason="x").to_map(), "payload_length": 3}
    with pytest.raises(InvalidMessage, match="carries no payload"):
        _recv(_frame(header, b"abc"))
    header = bridge.Error(reason="x").to_map()
    with pytest.raises(InvalidMessage, match="payload_length"):
        _recv(_frame(header))


def test_rejects_truncated_payload_and_header() -> None:
    full = bridge.bridge_header(bridge.SendUpdate(target_cluster="x", **HEADER), len(BODY)) + BODY
    with pytest.raises(MalformedFrame, match="payload ended"):
        _recv(full[:-1])
    with pytest.raises(MalformedFrame):
        _recv(full[:10])
    with pytest.raises(MalformedFrame, match="prefix"):
        _recv(full[:2])


def test_rejects_unknown_type_and_daemon_messages() -> None:
    with pytest.raises(UnknownMessageType):
        _recv(_frame({"v": 1, "type": "UpdateHeader", "payload_length": 0}))


def test_bridge_client_over_unix_socket() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bridge.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(1)
        seen: list[bridge.BridgeMessage] = []

        def serve() -> None:
            conn, _ = server.accept()
            with conn:
                seen.append(bridge.recv_bridge(conn, LIMIT)[0])
                msg, _ = bridge.recv_bridge(conn, LIMIT)
                seen.append(msg)
                bridge.send_bridge(conn, bridge.StatusReply(status={"cluster_id": "lab-a"}))

        thread = threading.Thread(target=serve)
        thread.start()
        with bridge.BridgeClient(path, role="cli", timeout=10) as client:
            reply, payload = client.request(bridge.StatusRequest())
        thread.join(10)
        server.close()
        assert reply == bridge.StatusReply(status={"cluster_id": "lab-a"})
        assert seen == [bridge.Hello(role="cli"), bridge.StatusRequest()]
        with pytest.raises(ConnectionError, match="is fabricd running"):
            bridge.BridgeClient(os.path.join(tmp, "missing.sock"), role="cli")


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(BRIDGE), st.binary(max_size=8), st.integers(0, 400))
def test_decode_bridge_header_only_raises_protocol_errors(
    sample: tuple[bridge.BridgeMessage, bytes], noise: bytes, pos: int
) -> None:
    header = bridge.bridge_header(sample[0], len(sample[1]))[4:]
    pos = min(pos, len(header))
    data = header[:pos] + noise + header[pos + len(noise) // 2:]
    try:
        msg, length = bridge.decode_bridge_header(data, LIMIT)
    except ProtocolError:
        return
    assert bridge.decode_bridge_header(bridge.bridge_header(msg, length)[4:], LIMIT) == (
        msg, length)


def test_delivery_result_refuses_bad_fields() -> None:
    good = bridge.DeliveryResult(message_id="j/1/up/c0/s", source_cluster="lab-a", ok=False,
                                 reason="round 1 is over", retry=True)
    base = {**good.to_map(), "payload_length": 0}
    assert _recv(_frame(base)) == (good, b"")
    for field, value, match in (
        ("ok", 1, "expected true/false"),
        ("retry", "yes", "expected true/false"),
        ("message_id", "", "length 0"),
        ("message_id", 7, "expected a string"),
        ("source_cluster", "lab a/../x", "does not match"),
        ("reason", "x" * 1025, "length 1025"),
    ):
        with pytest.raises(InvalidMessage, match=match):
            _recv(_frame({**base, field: value}))
    for field in ("ok", "retry", "message_id"):
        with pytest.raises(InvalidMessage, match=f"missing field.*{field}"):
            _recv(_frame({k: v for k, v in base.items() if k != field}))
    with pytest.raises(InvalidMessage, match="unexpected field"):
        _recv(_frame({**base, "applied_twice": True}))
    with pytest.raises(InvalidMessage, match="carries no payload"):
        _recv(_frame({**base, "payload_length": 3}, b"abc"))
    with pytest.raises(InvalidMessage, match="expected true/false"):
        _recv(_frame({**bridge.Hello(role="executor").to_map(), "payload_length": 0,
                      "answers_deliveries": "please"}))


def _update_frame(body: bytes) -> bytes:
    header = HEADER | {"byte_length": len(body), "sha256": hashlib.sha256(body).digest()}
    return bridge.bridge_header(bridge.SendUpdate(target_cluster="x", **header), len(body)) + body


@pytest.mark.parametrize("timeout", [None, 10.0])
def test_a_payload_arriving_in_pieces_is_read_whole_as_bytes(timeout: float | None) -> None:
    # blocking sockets take the one-recv path (MSG_WAITALL), sockets with a timeout return
    # short reads and continue into a buffer: both give the exact bytes, as ``bytes``
    body = os.urandom(3 * 1024 * 1024 + 7)
    frame = _update_frame(body)
    ours, theirs = socket.socketpair()
    ours.settimeout(timeout)

    def write() -> None:
        for start in range(0, len(frame), 256 * 1024):
            theirs.sendall(frame[start:start + 256 * 1024])
        theirs.close()

    writer = threading.Thread(target=write)
    writer.start()
    try:
        msg, payload = bridge.recv_bridge(ours, len(body))
    finally:
        writer.join(10)
        ours.close()
    assert type(payload) is bytes and payload == body
    assert isinstance(msg, bridge.SendUpdate) and msg.byte_length == len(body)


@pytest.mark.parametrize("timeout", [None, 10.0])
def test_a_payload_cut_short_by_the_peer_is_a_malformed_frame(timeout: float | None) -> None:
    body = os.urandom(1024 * 1024)
    frame = _update_frame(body)
    ours, theirs = socket.socketpair()
    ours.settimeout(timeout)

    def write() -> None:
        theirs.sendall(frame[:-1000])
        theirs.close()

    writer = threading.Thread(target=write)
    writer.start()
    try:
        with pytest.raises(MalformedFrame, match=f"payload ended after {len(body) - 1000} of"):
            bridge.recv_bridge(ours, len(body))
    finally:
        writer.join(10)
        ours.close()
