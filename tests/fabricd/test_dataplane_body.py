"""A body on the data plane (fabricd/_dataplane.py TlsStream.receive_body) against a real
data-plane listener on 127.0.0.1, in one process: read in place or through the hashing ring, the
sha256 of exactly the bytes sent, and a dripping sender cut by the rate floor; records
that were altered, replayed, reordered, dropped or too long do not open."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import pytest
import trio
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID

from fabricd import _dataplane as dataplane
from fabricd._dataplane import (
    KEY_BYTES,
    RECORD_BYTES,
    TAG_BYTES,
    BodyTooSlow,
    DataPlane,
    RecordRefused,
    Records,
    TlsStream,
    dial,
)
from fabricd.admission import RateFloor
from tests.fabricd.test_dataplane_tickets import _context, _Host, _identity, _peer, _ticket

BODY = os.urandom(3 * RECORD_BYTES + 12_345)


def _send(port: int, client: object, server_der: bytes, ticket: bytes, mode: bytes, drip: bool) -> bytes:
    """Send ``mode`` and the body (or, dripping, 10 bytes of it and then nothing); the
    server's last word (b"" once it closed)."""
    ctx = _context(client, server=False, pinned=server_der)  # type: ignore[arg-type]
    records = dial("127.0.0.1", port, ctx, ticket)
    try:
        records.send(mode)
        records.send(BODY[:10] if drip else BODY)
        return records.recv(lambda: None)
    finally:
        records.sock.close()


@pytest.mark.trio
async def test_body_lands_in_place_hashed_and_a_drip_is_cut_by_the_floor(tmp_path: Path) -> None:
    outcomes: list[tuple[str, object]] = []

    async def serve(stream: TlsStream) -> None:
        mode = await stream.read(1)
        digest = hashlib.sha256()
        into = bytearray(len(BODY)) if mode == b"k" else None
        floor = RateFloor(1024 * 1024, grace=0.5)
        try:
            got = await stream.receive_body(len(BODY), into, digest, floor, idle=20.0)
        except BodyTooSlow as exc:
            outcomes.append(("too_slow", str(exc)))
            await stream.write(b"cut")
            return
        outcomes.append((mode.decode(), (got, digest.digest(), bytes(into) if into is not None else None)))
        await stream.write(b"ok")

    alice = _peer()
    plane = DataPlane(_Host(), listen_ip="127.0.0.1", is_member=lambda p: p == str(alice),  # type: ignore[arg-type]
                      serve=serve, state_dir=tmp_path)
    alice_tls = _identity(str(alice), tmp_path / "alice")

    async def send(mode: bytes, drip: bool = False) -> bytes:
        answer = await _ticket(plane, alice, alice_tls)
        return await trio.to_thread.run_sync(
            _send, plane.port, alice_tls, answer.certificate, answer.ticket, mode, drip)

    async with trio.open_nursery() as nursery:
        await nursery.start(plane.run)
        assert await send(b"k") == b"ok"
        assert await send(b"p") == b"ok"
        assert await send(b"k", drip=True) == b"cut"
        nursery.cancel_scope.cancel()
    want = hashlib.sha256(BODY).digest()
    assert outcomes[0] == ("k", (len(BODY), want, BODY))
    assert outcomes[1] == ("p", (len(BODY), want, None))
    kind, reason = outcomes[2]
    # cut by the floor after its grace, not by the 20 s idle limit (that says "no body data")
    assert kind == "too_slow" and "too slow: 10 bytes" in str(reason), outcomes[2]


KEYS = os.urandom(2 * KEY_BYTES)


def _wire(records: list[bytes]) -> list[bytes]:
    """What Records.send puts on the wire for each of ``records`` (captured off a socketpair)."""
    left, right = socket.socketpair()
    keys = KEYS
    sender = Records(left, keys[:KEY_BYTES], keys[KEY_BYTES:])
    out = []
    for plain in records:
        sender.send(plain)
        want = 4 + len(plain) + TAG_BYTES
        got = b""
        while len(got) < want:
            got += right.recv(want - len(got))
        out.append(got)
    left.close()
    right.close()
    return out


def _open(wire: list[bytes]) -> list[bytes | str]:
    """What a receiver holding the keys makes of ``wire``: each record's plaintext, then
    the error that ended it (if any)."""
    keys = KEYS
    left, right = socket.socketpair()
    receiver = Records(right, keys[KEY_BYTES:], keys[:KEY_BYTES])
    left.sendall(b"".join(wire))
    left.close()
    seen: list[bytes | str] = []
    try:
        while True:
            seen.append(receiver.recv(lambda: None))
    except (RecordRefused, StreamEOF) as exc:
        seen.append(type(exc).__name__)
    finally:
        right.close()
    return seen


def test_records_open_only_in_order_and_untouched() -> None:
    first, second, third = _wire([b"header", os.urandom(5000), b"ack"])
    assert _open([first, second, third]) == [b"header", _open([first, second])[1], b"ack", "StreamEOF"]
    tampered = bytearray(second)
    tampered[100] ^= 1
    assert _open([first, bytes(tampered), third]) == [b"header", "RecordRefused"]
    assert _open([first, first]) == [b"header", "RecordRefused"]  # replayed
    assert _open([second, first]) == ["RecordRefused"]  # reordered
    assert _open([first, third]) == [b"header", "RecordRefused"]  # one dropped
    too_long = (RECORD_BYTES + 1).to_bytes(4, "big") + bytes(16)
    assert _open([too_long]) == ["RecordRefused"]


@pytest.mark.trio
async def test_work_cancelled_before_a_thread_took_it_never_runs_and_closes_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A write cancelled while it waits for one of the data plane's threads (all busy) never
    runs, and its connection is closed at once. It waited WRITE_SECONDS (30 s) for a thread
    that would never take it, with its bridge client's budget booked (the CI failure of
    test_a_client_that_leaves_mid_payload_delivers_nothing_and_frees_its_budget), and then
    left the socket open (the thread "had not let go")."""
    monkeypatch.setattr(dataplane, "WRITE_SECONDS", 3.0)  # the old code's wait, made short
    left, right = socket.socketpair()
    limiter = trio.CapacityLimiter(1)
    stream = TlsStream(Records(left, KEYS[:KEY_BYTES], KEYS[KEY_BYTES:]),
                       ID.from_base58("12D3KooWJ9E8H78YqyCWnVhxU1ur4ZfMnSQnXrZhaSLtcdapbU82"), limiter)
    ran: list[bool] = []
    try:
        async with limiter:  # every data-plane thread busy
            with trio.move_on_after(0.2) as cancelled:
                await stream._in_thread(lambda stop: ran.append(True))
        await trio.sleep(0.2)  # a thread that took it late would have run it by now
        assert cancelled.cancelled_caught and not ran
        assert stream.closed and left.fileno() == -1  # closed, not left to a thread
    finally:
        left.close()
        right.close()
