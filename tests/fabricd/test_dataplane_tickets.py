"""Data-plane tickets against a real TLS listener on 127.0.0.1 (fabricd/_dataplane.py, in
one process): a ticket is issued over a (fake) authenticated stream, works once, for the
certificate it names, for a peer that is still a member; everything else is refused."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID

from fabricd._dataplane import (
    TICKET_BYTES,
    DataPlane,
    TlsStream,
    _context,
    _Identity,
    _make_identity,
    dial,
)
from proto.codec import decode, frame
from proto.messages import DataPlaneOffer, DataPlaneTicket
from tests.fabricd._hostile import MemoryStream


def _peer() -> ID:
    return ID.from_pubkey(create_new_key_pair().public_key)


class _Host:
    def __init__(self) -> None:
        self.peer = _peer()

    def get_id(self) -> ID:
        return self.peer


async def _ticket(plane: DataPlane, peer: ID, client: _Identity) -> DataPlaneTicket:
    stream = MemoryStream(peer, frame(DataPlaneOffer(certificate=client.der)))
    await plane._issue(stream)  # type: ignore[arg-type]
    answer = decode(bytes(stream.written[4:]))
    assert isinstance(answer, DataPlaneTicket), answer
    return answer


def _identity(name: str, directory: Path) -> _Identity:
    directory.mkdir()
    return _make_identity(name, directory)


def _connect(port: int, client: _Identity, server_der: bytes, ticket: bytes) -> str:
    """'served' if the server accepted the connection and echoed, 'refused' if it closed it."""
    ctx = _context(client, server=False, pinned=server_der)
    try:
        # TLS 1.3: the server checks the client certificate after the client finished, so
        # a refusal may surface at any of these calls (dial waits for the acceptance)
        records = dial("127.0.0.1", port, ctx, ticket)
    except (ssl.SSLError, OSError):
        return "refused"
    try:
        records.send(b"ping")
        data = records.recv(lambda: None)
    except (ssl.SSLError, OSError, StreamEOF):
        return "refused"
    finally:
        records.sock.close()
    return "served" if data == b"pong" else "refused"


@pytest.mark.trio
async def test_tickets_are_single_use_bound_to_peer_and_certificate(tmp_path: Path) -> None:
    members: set[str] = set()
    served: list[str] = []

    async def serve(stream: TlsStream) -> None:
        served.append(str(stream.muxed_conn.peer_id))
        assert await stream.read(4) == b"ping"
        await stream.write(b"pong")

    plane = DataPlane(_Host(), listen_ip="127.0.0.1", is_member=lambda p: p in members,  # type: ignore[arg-type]
                      serve=serve, state_dir=tmp_path)
    alice, mallory = _peer(), _peer()
    members |= {str(alice), str(mallory)}
    alice_tls = _identity(str(alice), tmp_path / "alice")
    mallory_tls = _identity(str(mallory), tmp_path / "mallory")

    async def attempt(client: _Identity, answer: DataPlaneTicket, ticket: bytes | None = None) -> str:
        return await trio.to_thread.run_sync(
            _connect, plane.port, client, answer.certificate, answer.ticket if ticket is None else ticket)

    async with trio.open_nursery() as nursery:
        await nursery.start(plane.run)
        good = await _ticket(plane, alice, alice_tls)
        assert good.port == plane.port and len(good.ticket) == TICKET_BYTES, good
        assert await attempt(alice_tls, good) == "served"
        assert served == [str(alice)]
        # replayed
        assert await attempt(alice_tls, good) == "refused"
        # forged
        assert await attempt(alice_tls, good, bytes(TICKET_BYTES)) == "refused"
        # another member's (trusted) certificate with alice's ticket
        await _ticket(plane, mallory, mallory_tls)
        stolen = await _ticket(plane, alice, alice_tls)
        assert await attempt(mallory_tls, stolen) == "refused"
        # alice's ticket was spent by that attempt, even though it failed
        assert await attempt(alice_tls, stolen) == "refused"
        # a ticket whose peer stopped being a member
        late = await _ticket(plane, alice, alice_tls)
        members.discard(str(alice))
        assert await attempt(alice_tls, late) == "refused"
        members.add(str(alice))
        # a member's certificate it never offered (not in the trust store): TLS fails
        stranger_tls = _identity("stranger", tmp_path / "stranger")
        fresh = await _ticket(plane, alice, alice_tls)
        assert await attempt(stranger_tls, fresh) == "refused"
        assert served == [str(alice)]
        with trio.move_on_after(5):  # the server may count the last refusal after the client saw it
            while plane.refused < 6:
                await trio.sleep(0.01)
        assert plane.refused == 6 and plane.accepted == 1, plane.status()
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_member_that_offers_nothing_gets_no_ticket_and_crashes_nothing(
        tmp_path: Path, autojump_clock: Any) -> None:
    plane = DataPlane(_Host(), listen_ip="127.0.0.1", is_member=lambda p: True,  # type: ignore[arg-type]
                      serve=lambda s: trio.sleep(0), state_dir=tmp_path)  # type: ignore[arg-type,return-value]
    plane.port = 1
    stream = MemoryStream(_peer(), b"", silent=True)
    with trio.fail_after(60):
        await plane._issue(stream)  # type: ignore[arg-type]  # returns after its 5 s, no exception
    assert not plane.tickets and not stream.written
