from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from proto import codec, messages
from proto.errors import (
    InvalidMessage,
    MalformedFrame,
    MessageTooLarge,
    ProtocolError,
    UnknownMessageType,
    UnsupportedVersion,
)
from tests.proto.samples import HEADER, MESSAGES


def _raw(msg: messages.Message, **changes: object) -> bytes:
    data = msg.to_map()
    data.update(changes)
    return msgpack.packb(data, use_bin_type=True)


def test_every_daemon_message_type_has_a_sample() -> None:
    assert {type(m).TYPE for m in MESSAGES} == set(messages.Message.REGISTRY)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).TYPE)
def test_round_trip(msg: messages.Message) -> None:
    data = codec.encode(msg)
    assert codec.decode(data) == msg
    assert msgpack.unpackb(data)["v"] == 1
    assert msgpack.unpackb(data)["type"] == msg.TYPE


def test_wrong_version_rejected_with_supported_list() -> None:
    with pytest.raises(UnsupportedVersion, match=r"version 2 .*supported: \[1\]"):
        codec.decode(_raw(MESSAGES[0], v=2))
    with pytest.raises(UnsupportedVersion):
        codec.decode(_raw(MESSAGES[0], v="1"))


def test_unknown_type_rejected() -> None:
    with pytest.raises(UnknownMessageType, match="'Nope'"):
        codec.decode(_raw(MESSAGES[0], type="Nope"))


def test_missing_field_named() -> None:
    data = messages.UpdateHeader(**HEADER).to_map()
    del data["sha256"]
    with pytest.raises(InvalidMessage, match="sha256") as info:
        codec.decode(msgpack.packb(data))
    assert info.value.field == "sha256"


def test_extra_field_named() -> None:
    with pytest.raises(InvalidMessage, match="evil") as info:
        codec.decode(_raw(messages.UpdateHeader(**HEADER), evil=1))
    assert info.value.field == "evil"


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("round", "3", "expected an integer"),
        ("round", True, "expected an integer"),
        ("round", -1, "outside"),
        ("round", 2**32, "outside"),
        ("byte_length", -5, "outside"),
        ("sha256", b"short", "length 5 bytes"),
        ("sha256", "a" * 32, "expected bytes"),
        ("job_id", "", "length 0"),
        ("job_id", "x" * 129, "length 129"),
        ("job_id", "bad\nid", "control characters"),
        ("tensor_count", 1.5, "expected an integer"),
    ],
)
def test_bad_field_values_rejected(field: str, value: object, why: str) -> None:
    with pytest.raises(InvalidMessage, match=why) as info:
        codec.decode(_raw(messages.UpdateHeader(**HEADER), **{field: value}))
    assert info.value.field == field


def test_bad_values_in_other_specs() -> None:
    record = MESSAGES[2]
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(addrs=["/ip4/x"] * 33), "33 items"),
        (dict(addrs="notalist"), "expected a list"),
        (dict(cluster_id="has space"), "does not match"),
        (dict(issued_at=float("nan")), "finite"),
        (dict(capacity=2**33), "outside"),
        (dict(signature=b"x" * 10), "allowed: \\[0, 64\\]"),
    ]
    for change, why in cases:
        with pytest.raises(InvalidMessage, match=why):
            codec.decode(_raw(record, **change))
    ack = MESSAGES[5]
    with pytest.raises(InvalidMessage, match="not one of"):
        codec.decode(_raw(ack, status="maybe"))
    ctrl = MESSAGES[6]
    with pytest.raises(InvalidMessage, match="not plain data|map keys"):
        codec.decode(_raw(ctrl, body={"k": msgpack.ExtType(5, b"x")}))
    deep: object = 1
    for _ in range(40):
        deep = [deep]
    with pytest.raises(InvalidMessage, match="nesting"):
        codec.decode(_raw(ctrl, body={"d": deep}))


def test_construction_validates_too() -> None:
    with pytest.raises(InvalidMessage, match="round"):
        messages.UpdateHeader(**{**HEADER, "round": -1})


def test_not_a_map_and_garbage() -> None:
    with pytest.raises(MalformedFrame, match="map"):
        codec.decode(msgpack.packb([1, 2]))
    with pytest.raises(MalformedFrame, match="truncated"):
        codec.decode(codec.encode(MESSAGES[0])[:-3])
    with pytest.raises(MalformedFrame, match="trailing"):
        codec.decode(codec.encode(MESSAGES[0]) + b"\x00")
    with pytest.raises(MalformedFrame):
        codec.decode(b"\xc1")
    with pytest.raises(MalformedFrame, match="empty"):
        codec.decode(b"")
    with pytest.raises(MalformedFrame):  # map with an int key: strict_map_key
        codec.decode(msgpack.packb({1: 2}))


def test_oversized_message_rejected_before_unpacking() -> None:
    data = codec.encode(MESSAGES[0])
    with pytest.raises(MessageTooLarge, match=f"{len(data)} bytes exceeds the limit of 10"):
        codec.decode(data, max_size=10)
    with pytest.raises(MessageTooLarge):
        codec.encode(messages.MemberHello(certificate=b"x" * 100), max_size=50)


def test_small_frame_cannot_claim_huge_containers() -> None:
    # A bin32 header claiming 4 GiB and an array32 header claiming 2**32-1 items.
    for data in (b"\xc6\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff"):
        with pytest.raises(MalformedFrame):
            codec.decode(data)


def test_frame_layout() -> None:
    framed = codec.frame(MESSAGES[0])
    (length,) = struct.unpack(">I", framed[:4])
    assert length == len(framed) - 4
    assert codec.decode(framed[4:]) == MESSAGES[0]


def _reader(data: bytes):  # type: ignore[no-untyped-def]
    pos = 0
    reads: list[int] = []

    async def read_exactly(n: int) -> bytes:
        nonlocal pos
        reads.append(n)
        out = data[pos:pos + n]
        pos += n
        return out

    return read_exactly, reads


@pytest.mark.trio
async def test_read_frame_round_trip_and_eof() -> None:
    read, _ = _reader(codec.frame(MESSAGES[4]) + codec.frame(MESSAGES[5]))
    assert await codec.read_frame(read, 1 << 20) == MESSAGES[4]
    assert await codec.read_frame(read, 1 << 20) == MESSAGES[5]
    with pytest.raises(EOFError):
        await codec.read_frame(read, 1 << 20)


@pytest.mark.trio
async def test_read_frame_rejects_oversized_prefix_before_reading_body() -> None:
    read, reads = _reader(struct.pack(">I", 1 << 30) + b"x" * 100)
    with pytest.raises(MessageTooLarge, match="1073741824"):
        await codec.read_frame(read, 1 << 20)
    assert reads == [4]


@pytest.mark.trio
async def test_read_frame_truncated() -> None:
    framed = codec.frame(MESSAGES[0])
    read, _ = _reader(framed[:-1])
    with pytest.raises(MalformedFrame, match="truncated frame"):
        await codec.read_frame(read, 1 << 20)
    read, _ = _reader(framed[:2])
    with pytest.raises(MalformedFrame, match="length prefix"):
        await codec.read_frame(read, 1 << 20)


@pytest.mark.trio
async def test_exact_reader_over_a_trio_stream() -> None:
    send, recv = trio.testing.memory_stream_pair()
    reader = codec.ExactReader(recv.receive_some, chunk=3)
    payload = codec.frame(MESSAGES[6]) * 2
    await send.send_all(payload)
    await send.aclose()
    assert await codec.read_frame(reader.read_exactly) == MESSAGES[6]
    assert await codec.read_frame(reader.read_exactly) == MESSAGES[6]
    with pytest.raises(EOFError):
        await codec.read_frame(reader.read_exactly)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_decode_arbitrary_bytes_only_raises_protocol_errors(data: bytes) -> None:
    try:
        msg = codec.decode(data)
    except ProtocolError:
        return
    assert codec.decode(codec.encode(msg)) == msg


_plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.one_of(st.text(max_size=6), st.integers()), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(MESSAGES),
    st.dictionaries(st.text(max_size=12), _plain, max_size=4),
)
def test_decode_mutated_messages_only_raises_protocol_errors(
    base: messages.Message, changes: dict[str, object]
) -> None:
    data = base.to_map()
    for key, value in changes.items():
        target = key if key in data or len(key) % 2 else list(data)[len(key) % len(data)]
        data[target] = value
    raw = msgpack.packb(data, use_bin_type=True) if _packable(data) else b"\xc1"
    try:
        msg = codec.decode(raw)
    except ProtocolError:
        return
    assert codec.decode(codec.encode(msg)) == msg


def _packable(obj: object) -> bool:
    try:
        msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):
        return False
    return True


@pytest.mark.trio
async def test_exact_reader_read_some_serves_buffer_first() -> None:
    send, recv = trio.testing.memory_stream_pair()
    reader = codec.ExactReader(recv.receive_some)
    await send.send_all(b"abcdefgh")
    assert await reader.read_exactly(3) == b"abc"
    assert await reader.read_some(2) == b"de"
    assert await reader.read_some(100) == b"fgh"
    await send.aclose()
    assert await reader.read_some(100) == b""
    assert reader.eof
