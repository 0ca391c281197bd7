"""The data plane's digest contract, in one process against a real listener on 127.0.0.1
(fabricd/updates.py serving fabricd/_dataplane.py connections): a receiver with
``limits.dataplane_digest = "blake3"`` answers ``go blake3`` and verifies the body against
the BLAKE3 trailer the sender writes after it; a wrong trailer is refused, not acked. A
header that claims a BLAKE3 (what executors send) gets a plain go and is verified against
that claim, and the sending daemon does not hash the body at all (the executor did). A small body in its header's
record must be all of that record and match the header's claim."""

from __future__ import annotations

import hashlib
import os
import types
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import blake3
import pytest
import trio

from fabricd import _sender
from fabricd._dataplane import DataPlane, TlsStream, dial
from fabricd._sender import (
    GO,
    GO_BLAKE3,
    BodyRefused,
    DigestGate,
    exchange_half_duplex,
    exchange_inline,
)
from fabricd._streams import read_message_exact
from fabricd.updates import UpdateService
from proto.codec import frame
from proto.ids import PROBE_JOB_ID
from proto.messages import UpdateAck, UpdateHeader
from tests.fabricd.test_dataplane_tickets import _context, _Host, _identity, _peer, _ticket

BODY = os.urandom(3 * 1024 * 1024 + 77)


@dataclass
class _Cert:
    cluster_id: str


class _Members:
    def __init__(self, peer: str) -> None:
        self.peer = peer

    def member_certificate(self, peer: str) -> _Cert | None:
        return _Cert("a") if peer == self.peer else None


def _header(**claim: bytes) -> UpdateHeader:
    return UpdateHeader(job_id=PROBE_JOB_ID, round=0, source_node="a", target_node="b",
                        message_id=os.urandom(8).hex(), tensor_count=0, byte_length=len(BODY),
                        **(claim or {"sha256": hashlib.sha256(BODY).digest()}))


def _receiver(tmp_path: Path, min_bytes: int) -> tuple[UpdateService, DataPlane, Callable[[], Awaitable[TlsStream]]]:
    """Cluster b's update service and data plane (digest blake3, large bodies from
    ``min_bytes``), and how alice, its one member, opens a connection to it."""
    alice = _peer()
    host = _Host()
    service = UpdateService(host, _Members(str(alice)), None, cluster_id="b",  # type: ignore[arg-type]
                            max_update_bytes=1 << 30, max_inflight_bytes=1 << 30)
    plane = DataPlane(host, listen_ip="127.0.0.1", is_member=lambda p: p == str(alice),  # type: ignore[arg-type]
                      serve=service.serve_dataplane, state_dir=tmp_path)
    service.use_dataplane(plane, min_bytes, "blake3")
    alice_tls = _identity(str(alice), tmp_path / "alice")

    async def connect() -> TlsStream:
        answer = await _ticket(plane, alice, alice_tls)
        ctx = _context(alice_tls, server=False, pinned=answer.certificate)
        records = await trio.to_thread.run_sync(dial, "127.0.0.1", plane.port, ctx, answer.ticket)
        return TlsStream(records, alice, plane.limiter)

    return service, plane, connect


@pytest.mark.trio
async def test_blake3_receiver_checks_the_senders_trailer(tmp_path: Path) -> None:
    service, plane, connect = _receiver(tmp_path, 1)

    async with trio.open_nursery() as nursery:
        await nursery.start(plane.run)
        # an honest sender: told "go blake3", it sends the trailer and the body is acked
        stream = await connect()
        ack, completed = await exchange_half_duplex(stream, _header(), BODY, 1024 * 1024, 10, 30)
        assert completed and ack.status == "ok", ack
        await stream.close()
        # a sender whose trailer does not match the body: refused, naming blake3
        stream = await connect()
        await stream.write(frame(_header()))
        go = await read_message_exact(stream, 65536)
        assert isinstance(go, UpdateAck) and go.reason == GO_BLAKE3, go
        await stream.write_many([memoryview(BODY)])
        await stream.write(blake3.blake3(BODY[:-1]).digest())
        final = await read_message_exact(stream, 65536)
        assert isinstance(final, UpdateAck) and final.status == "rejected", final
        assert "blake3 of the body" in final.reason and "the sender's trailer" in final.reason, final.reason
        await stream.close()
        nursery.cancel_scope.cancel()
    assert service.jobs[PROBE_JOB_ID].received_updates == 1


@pytest.mark.trio
async def test_a_blake3_claim_is_verified_by_the_receiver_and_not_hashed_by_the_sending_daemon(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    service, plane, connect = _receiver(tmp_path, 1)
    hashed: list[int] = []  # bodies the sending daemon hashed (gate or streaming digest)
    body_digest = _sender.body_digest
    monkeypatch.setattr(_sender, "body_digest", lambda h, d: hashed.append(len(d)) or body_digest(h, d))
    real_blake3 = blake3.blake3

    class Counted:
        def __init__(self) -> None:
            hashed.append(-1)
            self._h = real_blake3()

        def update(self, data: object) -> None:
            self._h.update(data)

        def digest(self) -> bytes:
            return bytes(self._h.digest())

    monkeypatch.setattr(_sender, "blake3", types.SimpleNamespace(blake3=Counted))  # the sender's only
    claim = real_blake3(BODY).digest()
    wrong = real_blake3(BODY[1:]).digest()

    async with trio.open_nursery() as nursery:
        await nursery.start(plane.run)
        stream = await connect()
        for digest, delivered in ((claim, True), (wrong, False)):
            async with trio.open_nursery() as gates:
                gate = DigestGate(BODY, _header(blake3=digest), gates)
                ack, completed = await exchange_half_duplex(stream, _header(blake3=digest), BODY, 1024 * 1024,
                                                            10, 30, gate)
                gates.cancel_scope.cancel()  # as the daemon does: a gate nobody asked for
            if delivered:
                assert completed and ack.status == "ok", ack
            else:  # refused against the header's claim; nothing delivered
                assert ack.status == "rejected", ack
                assert "blake3 of the body" in ack.reason and "the header says" in ack.reason, ack.reason
            assert hashed == [], "the sending daemon hashed a body whose BLAKE3 claim the receiver checks"
            stream = await connect()
        # the receiver's go for a BLAKE3 claim is a plain go (no trailer expected)
        await stream.write(frame(_header(blake3=claim)))
        go = await read_message_exact(stream, 65536)
        assert isinstance(go, UpdateAck) and go.reason == GO, go
        await stream.close()
        nursery.cancel_scope.cancel()
    assert service.jobs[PROBE_JOB_ID].received_updates == 1


@pytest.mark.trio
async def test_a_sha256_claim_is_hashed_by_the_gate_while_the_body_goes_out(tmp_path: Path) -> None:
    """The path of a client that claims sha256: the gate hashes the body in a thread of
    its own (the receiver asks for the trailer) and refuses a mismatch before the last chunk."""
    service, plane, connect = _receiver(tmp_path, 1)
    async with trio.open_nursery() as nursery:
        await nursery.start(plane.run)
        for digest, delivered in ((hashlib.sha256(BODY).digest(), True), (hashlib.sha256(b"x").digest(), False)):
            stream = await connect()
            async with trio.open_nursery() as gates:
                gate = DigestGate(BODY, _header(sha256=digest), gates)
                assert not gate.streams_blake3
                if delivered:
                    ack, completed = await exchange_half_duplex(stream, _header(sha256=digest), BODY,
                                                                1024 * 1024, 10, 30, gate)
                    assert completed and ack.status == "ok", ack
                else:
                    with pytest.raises(BodyRefused, match="payload sha256 .* does not match"):
                        await exchange_half_duplex(stream, _header(sha256=digest), BODY, 1024 * 1024, 10, 30, gate)
            await stream.close()
        nursery.cancel_scope.cancel()
    assert service.jobs[PROBE_JOB_ID].received_updates == 1


@pytest.mark.trio
async def test_an_inline_body_is_all_of_its_record_and_checked_against_the_header(tmp_path: Path) -> None:
    service, plane, connect = _receiver(tmp_path, 1 << 20)
    small = os.urandom(3000)

    def header(length: int, digest: bytes) -> UpdateHeader:
        return UpdateHeader(job_id=PROBE_JOB_ID, round=0, source_node="a", target_node="b",
                            message_id=os.urandom(8).hex(), tensor_count=0, byte_length=length, sha256=digest)

    async with trio.open_nursery() as nursery:
        await nursery.start(plane.run)
        # honest: header and body in one record, one ack (no go), and the next one on it
        stream = await connect()
        for _ in range(2):
            ack, completed = await exchange_inline(stream, header(len(small), hashlib.sha256(small).digest()),
                                                   small, 30)
            assert completed and ack.status == "ok" and ack.reason == "", ack
        await stream.close()
        # the record holds less than the header declares: refused, not waited for
        stream = await connect()
        ack, _ = await exchange_inline(stream, header(len(small) + 1, hashlib.sha256(small).digest()), small, 30)
        assert ack.status == "rejected" and "followed the header" in ack.reason, ack
        await stream.close()
        # a body that does not match the header's sha256: refused
        stream = await connect()
        ack, _ = await exchange_inline(stream, header(len(small), hashlib.sha256(b"other").digest()), small, 30)
        assert ack.status == "rejected" and "sha256 of the body" in ack.reason, ack
        await stream.close()
        nursery.cancel_scope.cancel()
    assert service.jobs[PROBE_JOB_ID].received_updates == 2
