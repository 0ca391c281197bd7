from __future__ import annotations

import hashlib

import blake3
import pytest

from proto.bridge import Delivery, SendUpdate
from proto.codec import decode, frame
from proto.errors import DigestMismatch, InvalidMessage, LengthMismatch, MessageTooLarge
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


def test_a_blake3_claim_is_verified_as_blake3() -> None:
    body = bytes(range(256)) * 300
    rx = UpdateReceiver(_header(body, sha256=b"", blake3=blake3.blake3(body).digest()), max_bytes=len(body))
    rx.feed(body)
    assert rx.finish() == body
    rx = UpdateReceiver(_header(body, sha256=b"", blake3=blake3.blake3(body[1:]).digest()), max_bytes=len(body))
    rx.feed(body)
    with pytest.raises(DigestMismatch, match="blake3 of the body is .* header says"):
        rx.finish()


@pytest.mark.parametrize("claim", [{"sha256": b"", "blake3": b""},
                                   {"sha256": b"\1" * 32, "blake3": b"\2" * 32},
                                   {"sha256": b"", "blake3": b"\2" * 31}])
def test_an_update_claims_exactly_one_digest(claim: dict[str, bytes]) -> None:
    with pytest.raises(InvalidMessage):
        _header(b"abc", **claim)
    for cls in (SendUpdate, Delivery):
        fields = dict(job_id="j", round=0, source_node="a", target_node="b", message_id="m1",
                      tensor_count=1, byte_length=3, **claim)
        if cls is SendUpdate:
            fields["target_cluster"] = "b"
        with pytest.raises(InvalidMessage):
            cls(**fields)  # type: ignore[arg-type]


def test_a_blake3_header_crosses_the_wire_and_executors_claim_blake3() -> None:
    header = _header(b"abc", sha256=b"", blake3=blake3.blake3(b"abc").digest())
    assert decode(frame(header)[4:]) == header
    payload = _safetensors()
    msg = SendUpdate.for_payload(payload, target_cluster="b", job_id="j", round=1, source_node="a",
                                 target_node="b", message_id="m")
    assert msg.blake3 == blake3.blake3(payload).digest() and msg.sha256 == b""
    assert Delivery.from_header(msg.header()).blake3 == msg.blake3


def _safetensors() -> bytes:
    import torch
    from safetensors.torch import save

    return save({"w": torch.zeros(4)})


def test_iter_chunks_sizes_and_limits() -> None:
    body = b"x" * (9 * MIB + 1)
    sizes = [len(c) for c in iter_chunks(body)]
    assert sizes == [4 * MIB, 4 * MIB, MIB + 1]
    assert b"".join(iter_chunks(body, 7 * MIB)) == body
    with pytest.raises(ValueError, match="chunk_size"):
        list(iter_chunks(body, 16 * MIB))
    with pytest.raises(ValueError):
        list(iter_chunks(body, 0))


