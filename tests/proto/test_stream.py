from __future__ import annotations

import hashlib

import pytest

from proto.errors import DigestMismatch, LengthMismatch, MessageTooLarge
from proto.ids import MIB
from proto.messages import UpdateHeader
from proto.stream import UpdateReceiver, iter_chunks, sha256


def _header(body: bytes, **changes: object) -> UpdateHeader:
    fields: dict[str, object] = dict(
        job_id="j", round=0, source_node="a", target_node="b", message_id="m1",
        tensor_count=1, byte_length=len(body), sha256=hashlib.sha256(body).digest(),
    )
    fields.update(changes)
    return UpdateHeader(**fields)  # type: ignore[arg-type]


def test_receive_in_chunks_and_verify() -> None:
    body = bytes(range(256)) * 1000
    rx = UpdateReceiver(_header(body), max_bytes=len(body))
    for chunk in iter_chunks(body, 999):
        rx.feed(chunk)
    assert rx.remaining == 0
    assert rx.finish() == body


def test_empty_body() -> None:
    rx = UpdateReceiver(_header(b""), max_bytes=0)
    assert list(iter_chunks(b"")) == []
    assert rx.finish() == b""


def test_oversized_byte_length_rejected_up_front() -> None:
    body = b"x" * 100
    with pytest.raises(MessageTooLarge, match="announces 100 bytes, over the limit of 99"):
        UpdateReceiver(_header(body), max_bytes=99)


def test_overrun_raises_length_mismatch() -> None:
    body = b"abcdef"
    rx = UpdateReceiver(_header(body), max_bytes=1 << 20)
    rx.feed(b"abc")
    with pytest.raises(LengthMismatch, match="runs past its byte_length 6"):
        rx.feed(b"defg")


def test_underrun_raises_length_mismatch() -> None:
    body = b"abcdef"
    rx = UpdateReceiver(_header(body), max_bytes=1 << 20)
    rx.feed(b"abc")
    with pytest.raises(LengthMismatch, match="after 3 of 6 bytes"):
        rx.finish()


def test_wrong_digest() -> None:
    rx = UpdateReceiver(_header(b"abcdef", sha256=sha256(b"abcdeg")), max_bytes=100)
    rx.feed(b"abcdef")
    with pytest.raises(DigestMismatch, match="header says"):
        rx.finish()


def test_iter_chunks_sizes_and_limits() -> None:
    body = b"x" * (9 * MIB + 1)
    sizes = [len(c) for c in iter_chunks(body)]
    assert sizes == [4 * MIB, 4 * MIB, MIB + 1]
    assert b"".join(iter_chunks(body, 7 * MIB)) == body
    with pytest.raises(ValueError, match="chunk_size"):
        list(iter_chunks(body, 16 * MIB))
    with pytest.raises(ValueError):
        list(iter_chunks(body, 0))


