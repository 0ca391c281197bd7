"""A gateway's data-plane splices (fabricd/_splice.py), on socket pairs: grants, joining,
tokens that do not match, halves that wait alone, and the limits. Real daemons splicing a
private member's update: tests/fabricd/test_relay.py."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import pytest
import trio

from fabricd import _splice
from fabricd._splice import SpliceService
from fabricd.config import Relay
from proto.messages import DataPlaneOffer, SpliceRequest

MEMBER = "QmMember"
SENDER = "QmSender"
#: the sender's first frame: its ticket's tag
TAG = b"FPDP" + b"g" * 16


def _tls(payload: bytes) -> bytes:
    """A frame as a TLS record looks on the wire (handshake type, version, length)."""
    return b"\x16\x03\x03" + len(payload).to_bytes(2, "big") + payload


def _record(payload: bytes) -> bytes:
    """A frame as a data-plane record looks on the wire (4-byte length, the ciphertext -
    here the payload as it is - and a 16-byte tag)."""
    return len(payload).to_bytes(4, "big") + payload + b"t" * 16


def _service(cfg: Relay | None = None, reserved: Callable[[str], bool] = lambda peer: True) -> SpliceService:
    return SpliceService(None, cfg or Relay(), lambda: 4242, reserved)  # type: ignore[arg-type]


def _grant(svc: SpliceService, member: str = MEMBER) -> tuple[bytes, bytes]:
    grant = svc.grant(member, SpliceRequest(peer=SENDER))
    assert grant.port == 4242 and grant.reason == "", grant
    return grant.listen_token, grant.dial_token


async def _send_all(sock: Any, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[await sock.send(view):]


async def _recv_all(sock: Any, n: int) -> bytes:
    got = b""
    with trio.fail_after(10):
        while len(got) < n:
            more = await sock.recv(n - len(got))
            if not more:
                break
            got += more
    return got


async def _eof(sock: Any) -> bool:
    with trio.fail_after(10):
        try:
            while await sock.recv(65536):
                pass
        except ConnectionResetError:
            pass
    return True


def test_grants_are_refused_with_the_reason() -> None:
    assert "no relay reservation" in _service(reserved=lambda peer: False).grant(
        MEMBER, SpliceRequest(peer=SENDER)).reason
    svc = _service(Relay(max_circuits=3))
    for _ in range(_splice.PENDING_PER_SENDER):
        _grant(svc)
    refused = svc.grant(MEMBER, SpliceRequest(peer=SENDER))  # a sender holds no more of them
    assert refused.port == 0 and not refused.listen_token and f"sender {SENDER}" in refused.reason, refused
    for n in range(_splice.PER_CIRCUIT * 3 - _splice.PENDING_PER_SENDER):
        assert svc.grant(MEMBER, SpliceRequest(peer="QmSender" + "abcdefghijkmnopqrstuvwxyz"[n])).port
    refused = svc.grant(MEMBER, SpliceRequest(peer="QmAnother"))
    assert refused.port == 0 and "x network.relay_max_circuits" in refused.reason, refused
    _grant(svc, "QmOther")  # the limits are per member
    assert "expected SpliceRequest" in svc.grant(MEMBER, DataPlaneOffer(certificate=b"c")).reason
    idle = SpliceService(None, Relay(), lambda: 0, lambda peer: True)  # type: ignore[arg-type]
    assert "not listening" in idle.grant(MEMBER, SpliceRequest(peer=SENDER)).reason
    assert svc.counts["splices_refused"] == 3 and svc.counts["splices_granted"] == 3 * _splice.PER_CIRCUIT + 1


@pytest.mark.trio
async def test_two_halves_are_joined_and_bytes_pass_unchanged_both_ways() -> None:
    svc = _service()
    listen, dial = _grant(svc)
    receiver, receiver_gw = trio.socket.socketpair()
    sender, sender_gw = trio.socket.socketpair()
    data = TAG + _tls(b"client hello" * 100) + _record(secrets.token_bytes(3 << 20)) + _record(b"")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(svc.take, listen, receiver_gw, "receiver")
        await trio.sleep(0.05)
        assert svc.status()["splices_pending"] == 1
        nursery.start_soon(svc.take, dial, sender_gw, "sender")
        nursery.start_soon(_send_all, sender, data)
        assert await _recv_all(receiver, len(data)) == data
        ack = _tls(b"server hello") + _record(b"ack")
        await _send_all(receiver, ack)
        assert await _recv_all(sender, len(ack)) == ack
        assert svc.status()["splices_open"] == 1
        sender.close()  # a half-close passes on: the receiver sees the end
        assert await _eof(receiver)
        receiver.close()
    status = svc.status()
    assert status["splices_joined"] == 1 and status["bytes_spliced"] == len(data) + len(ack), status
    assert status["splices_open"] == 0 and status["splices_pending"] == 0 and not svc.tokens, status


@pytest.mark.trio
async def test_unknown_used_or_expired_tokens_get_a_closed_connection() -> None:
    svc = _service()
    listen, dial = _grant(svc)
    for token in (secrets.token_bytes(32), b"short"):
        app, gw = trio.socket.socketpair()
        await svc.take(token, gw, "stranger")
        assert await _eof(app)
    assert svc.counts["splices_unknown_token"] == 2
    assert len(svc.tokens) == 2  # a stranger's guess spends nobody's tokens
    for rv in svc.tokens.values():
        rv.expires -= 60
    app, gw = trio.socket.socketpair()
    await svc.take(dial, gw, "late")
    assert await _eof(app)
    assert not svc.tokens and svc.status()["splices_open"] == 0  # both halves void, the member's count freed
    app, gw = trio.socket.socketpair()
    await svc.take(listen, gw, "late too")
    assert await _eof(app)
    assert svc.counts["splices_unknown_token"] == 4 and svc.counts["splices_joined"] == 0


@pytest.mark.trio
async def test_a_half_whose_other_half_never_comes_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_splice, "SPLICE_SECONDS", 0.3)
    svc = _service()
    listen, dial = _grant(svc)
    app, gw = trio.socket.socketpair()
    with trio.fail_after(10):
        await svc.take(listen, gw, "alone")
    assert await _eof(app)
    assert not svc.tokens and svc.status()["splices_open"] == 0
    app, gw = trio.socket.socketpair()
    await svc.take(dial, gw, "too late")
    assert await _eof(app)


@pytest.mark.trio
@pytest.mark.parametrize("limit", ["idle", "drip", "not the data plane", "bytes", "frames with pauses"])
async def test_a_joined_splice_is_cut_at_its_limits(limit: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut: idle past SPLICE_IDLE_SECONDS; a frame begun and then dripped (a byte every
    0.1 s) past its grace; bytes that are no data-plane frame; past circuit_bytes. Whole
    frames with pauses between them are not cut (the splice stays until its ends close it)."""
    monkeypatch.setattr(_splice, "SPLICE_IDLE_SECONDS", 0.5 if limit == "idle" else 60.0)
    monkeypatch.setattr(_splice, "SPLICE_GRACE", 0.5)
    monkeypatch.setattr(_splice, "POLL_SECONDS", 0.1)
    svc = _service(Relay(circuit_bytes=100_000) if limit == "bytes" else Relay())
    listen, dial = _grant(svc)
    receiver, receiver_gw = trio.socket.socketpair()
    sender, sender_gw = trio.socket.socketpair()
    started = trio.current_time()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.take, listen, receiver_gw, "receiver")
            nursery.start_soon(svc.take, dial, sender_gw, "sender")
            if limit == "bytes":
                first = TAG + _record(b"x" * 60_000)
                await _send_all(sender, first)
                assert await _recv_all(receiver, len(first)) == first
                await _send_all(sender, _record(b"x" * 60_000))  # past circuit_bytes: cut
            elif limit == "drip":
                await _send_all(sender, TAG + _record(b"x" * 10)[:4])  # a record of 10 bytes begun
                with trio.move_on_after(10):
                    try:
                        while True:
                            await sender.send(b"x")
                            await trio.sleep(0.1)
                    except OSError:  # cut: the gateway closed it
                        pass
            elif limit == "not the data plane":
                await _send_all(sender, b"GET / HTTP/1.1\r\n\r\n")
            elif limit == "frames with pauses":
                await _send_all(sender, TAG)
                for _ in range(3):  # longer than the grace apart, each whole at once
                    frame = _record(b"x" * (128 << 10))
                    await _send_all(sender, frame)
                    assert await _recv_all(receiver, len(TAG) * (_ == 0) + len(frame))
                    await trio.sleep(0.8)
                assert svc.status()["splices_open"] == 1
                sender.close()
                receiver.close()
                return
            assert await _eof(receiver)
            assert await _eof(sender)
    assert trio.current_time() - started < 5
    assert svc.status()["splices_open"] == 0
