"""A gateway's data-plane splices (fabricd/_splice.py), on socket pairs: grants, joining,
tokens that do not match, halves that wait alone, and the limits; on a real gateway, a
member dripping into a splice of its own. Real daemons splicing a private member's
update: tests/fabricd/test_relay.py."""

from __future__ import annotations

import contextlib
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode, to_proto_status
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

from fabricd import _splice
from fabricd._relay import Bandwidth
from fabricd._splice import SPLICE_MAGIC, SpliceService
from fabricd._streams import read_message_exact
from fabricd.config import Relay
from proto.codec import frame
from proto.ids import PROTOCOL_SPLICE
from proto.messages import DataPlaneOffer, SpliceGrant, SpliceRequest
from tests.fabricd._harness import Node, bridge_status, configure, init_ca, init_node
from tests.fabricd._hostile import certificate_for, hello, peer_info, raw_host

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


@pytest.mark.trio
@pytest.mark.parametrize("dies", ["receiver", "sender"])
async def test_an_end_that_dies_mid_update_ends_the_splice(dies: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """One end's process dies while a large body is on its way (its socket closes under
    the gateway's copy): the other end sees the connection end within a poll, both
    sockets are closed and the member's splice is freed (a new one can be granted)."""
    monkeypatch.setattr(_splice, "POLL_SECONDS", 0.1)
    svc = _service(Relay(max_circuits=1))
    listen, dial = _grant(svc)
    receiver, receiver_gw = trio.socket.socketpair()
    sender, sender_gw = trio.socket.socketpair()
    body = TAG + _record(secrets.token_bytes(8 << 20))
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.take, listen, receiver_gw, "receiver")
            nursery.start_soon(svc.take, dial, sender_gw, "sender")

            async def stream() -> None:
                # the gateway closed it under the write (OSError), or this test did: the
                # sender's own death (trio's ClosedResourceError)
                with contextlib.suppress(OSError, trio.ClosedResourceError):
                    await _send_all(sender, body)
            nursery.start_soon(stream)
            assert len(await _recv_all(receiver, 1 << 20)) == 1 << 20  # mid-body
            gone, survivor = (receiver, sender) if dies == "receiver" else (sender, receiver)
            gone.close()
            assert await _eof(survivor)
            survivor.close()
    status = svc.status()
    assert status["splices_open"] == 0 and status["splices_pending"] == 0 and not svc.tokens, status
    assert 1 << 20 <= status["bytes_spliced"] <= len(body), status
    for _ in range(_splice.PER_CIRCUIT):  # the member's whole allowance is free again
        assert svc.grant(MEMBER, SpliceRequest(peer=SENDER + "x" * _)).port


def test_the_bandwidth_bucket_lets_one_second_through_then_holds_readers_to_the_rate() -> None:
    assert Bandwidth(0).delay(1 << 30) == 0.0  # unlimited
    bucket = Bandwidth(1_000_000)
    assert bucket.delay(600_000) == 0.0 and bucket.delay(400_000) == pytest.approx(0.0, abs=0.01)
    assert bucket.delay(500_000) == pytest.approx(0.5, abs=0.01)  # in debt: half a second
    assert bucket.delay(1_000_000) == pytest.approx(1.5, abs=0.01)
    assert bucket.throttled == pytest.approx(2.0, abs=0.03)


@pytest.mark.trio
async def test_a_splice_keeps_to_the_gateways_bandwidth() -> None:
    """relay.max_bytes_per_second = 1 MB/s: 3 MB through a splice take at least the two
    seconds past the bucket's first, and the held time is not the sender's (no rate cut)."""
    svc = _service(Relay(max_bytes_per_second=1_000_000))
    listen, dial = _grant(svc)
    receiver, receiver_gw = trio.socket.socketpair()
    sender, sender_gw = trio.socket.socketpair()
    data = TAG + b"".join(_record(b"x" * 500_000) for _ in range(6))
    began = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(svc.take, listen, receiver_gw, "receiver")
        nursery.start_soon(svc.take, dial, sender_gw, "sender")
        nursery.start_soon(_send_all, sender, data)
        with trio.fail_after(30):
            assert await _recv_all(receiver, len(data)) == data
        took = trio.current_time() - began
        sender.close()
        receiver.close()
    assert took >= 1.9, took
    # the bucket held the readers for most of it: the copying's own time counts against
    # the bucket's debt, so on a loaded machine it holds less (1.76 s of the 2 in a
    # clean-clone run beside two bench workers, where >= 1.9 failed)
    assert svc.bandwidth.throttled >= 1.0, (svc.bandwidth.throttled, took)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[Node, Path]]:
    ca = init_ca(tmp_path)
    g = init_node(tmp_path, "g", ca)
    configure(g, "relay_service = true")
    g.start()
    try:
        g.wait_ready()
        yield g, ca
    finally:
        g.stop()


def _drip_through(port: int, grant: SpliceGrant, every: float, timeout: float) -> float | None:
    """Both halves of ``grant`` connected; a data-plane record of 1000 bytes begun on the
    sender's and then dripped, a byte every ``every`` s: seconds from its first byte until
    the gateway ended the receiver's half, or None if it had not after ``timeout`` s."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as receiver, \
            socket.create_connection(("127.0.0.1", port), timeout=10) as sender:
        receiver.sendall(SPLICE_MAGIC + grant.listen_token)
        sender.sendall(SPLICE_MAGIC + grant.dial_token + TAG)
        time.sleep(0.5)
        began = time.monotonic()
        sender.sendall((1000).to_bytes(4, "big"))
        receiver.settimeout(0.05)
        while time.monotonic() - began < timeout:
            try:
                while receiver.recv(65536):  # what came through so far
                    pass
                return time.monotonic() - began  # the end
            except TimeoutError:
                pass
            except OSError:
                return time.monotonic() - began
            time.sleep(every)
            try:
                sender.send(b"x")
            except OSError:
                pass
    return None


@pytest.mark.trio
async def test_a_member_dripping_into_its_own_splice_is_cut_and_counted(gateway: tuple[Node, Path]) -> None:
    """A member reserves at a real gateway, is granted a splice for itself, connects both
    halves and drips a record through it (a byte every 2 s). No honest end would cut it:
    the gateway does, after the grace for the frame (not at the 300 s idle limit), and
    counts the cut."""
    g, ca = gateway
    key = create_new_key_pair()
    target = peer_info(g.addr())
    async with raw_host(key) as host:
        await host.connect(target)
        assert (await hello(host, target.peer_id, certificate_for(key, ca, "splicer"))).accepted
        stream = await host.new_stream(target.peer_id, [PROTOCOL_ID])  # type: ignore[list-item]
        await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE,
                                                     peer=CircuitPeerId(id=host.get_id().to_bytes())))
        with trio.fail_after(30):
            assert (await read_delimited_msg(stream, HopMessage)).status == to_proto_status(StatusCode.OK)
        await stream.close()
        stream = await host.new_stream(target.peer_id, [PROTOCOL_SPLICE])  # type: ignore[list-item]
        await stream.write(frame(SpliceRequest(peer=str(host.get_id()))))
        with trio.fail_after(30):
            grant = await read_message_exact(stream, 1 << 20)
        assert isinstance(grant, SpliceGrant) and grant.port, grant
        await stream.close()
        before = bridge_status(g)["streams_cut"]["relay"]
        took = await trio.to_thread.run_sync(_drip_through, grant.port, grant, 2.0, 120.0)
    print(f"a dripped splice was cut after {took} s")
    assert took is not None, "the gateway never cut the dripped splice"
    assert "event=splice.cut" in g.log() and "too slow" in g.log()
    assert bridge_status(g)["streams_cut"]["relay"] == before + 1
    assert bridge_status(g)["relay"]["service"]["splices_open"] == 0
