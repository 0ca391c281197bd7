"""The Kademlia namespace validator: only CA-certified, self-signed ClusterRecords are stored."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fabricd.discovery import ClusterRecordValidator
from proto.certs import generate_ca, issue_certificate, public_key_bytes
from proto.codec import encode
from proto.ids import dht_key
from proto.messages import ClusterRecord


def _record(ca: Ed25519PrivateKey, key: Ed25519PrivateKey, cluster: str, issued_at: float,
            role: str = "cluster") -> ClusterRecord:
    cert = issue_certificate(ca, key.public_key(), cluster, role, not_before=int(time.time()) - 60)
    from proto.certs import peer_id_from_ed25519_public

    peer = peer_id_from_ed25519_public(public_key_bytes(key.public_key()))
    return ClusterRecord(cluster_id=cluster, peer_id=peer, addrs=("/ip4/127.0.0.1/tcp/1",),
                         capacity=3, issued_at=issued_at, certificate=cert)


@asynccontextmanager
async def _linked_stacks(membership: SimpleNamespace) -> AsyncIterator[tuple[Any, Any, Any]]:
    """Two host stacks on 127.0.0.1 with the record validator, b connected to a and each
    in the other's DHT routing table: (a, b, a's key pair)."""
    import multiaddr
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.peerinfo import info_from_p2p_addr

    from fabricd._host import open_host_stack

    kp_a = create_new_key_pair()
    async with (
        open_host_stack(kp_a, ["/ip4/127.0.0.1/tcp/0"], None, 1.0) as a,
        open_host_stack(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"], None, 1.0) as b,
    ):
        for stack in (a, b):
            stack.dht.register_validator(ClusterRecordValidator.namespace, ClusterRecordValidator(membership))
        addr = f"{a.host.get_addrs()[0]}"
        addr = addr if "/p2p/" in addr else f"{addr}/p2p/{a.host.get_id()}"
        await b.host.connect(info_from_p2p_addr(multiaddr.Multiaddr(addr)))
        await b.dht.add_peer(a.host.get_id())
        await a.dht.add_peer(b.host.get_id())
        yield a, b, kp_a


@pytest.fixture
def setup():
    ca = generate_ca()
    membership = SimpleNamespace(ca_public=public_key_bytes(ca.public_key()), revoked=frozenset())
    return ca, membership, ClusterRecordValidator(membership)


def test_valid_record_is_accepted_and_newest_selected(setup) -> None:
    ca, _, validator = setup
    key = Ed25519PrivateKey.generate()
    old = encode(_record(ca, key, "a", 100.0).sign(key))
    new = encode(_record(ca, key, "a", 200.0).sign(key))
    validator.validate(dht_key("a"), old)
    assert validator.select(dht_key("a"), [old, new]) == 1


@pytest.mark.parametrize("case", ["unsigned", "wrong signer", "foreign CA", "wrong key", "garbage",
                                  "revoked", "scheduler role"])
def test_bad_records_are_refused(setup, case: str) -> None:
    ca, membership, validator = setup
    key = Ed25519PrivateKey.generate()
    record = _record(ca, key, "a", 100.0)
    key_name = dht_key("a")
    if case == "unsigned":
        value = encode(record)
    elif case == "wrong signer":
        value = encode(record.sign(Ed25519PrivateKey.generate()))
    elif case == "foreign CA":
        value = encode(_record(generate_ca(), key, "a", 100.0).sign(key))
    elif case == "wrong key":
        value, key_name = encode(record.sign(key)), dht_key("b")
    elif case == "garbage":
        value = b"\x93not a record"
    elif case == "revoked":
        from proto.certs import parse_certificate

        membership.revoked = frozenset({parse_certificate(record.certificate).serial})
        value = encode(record.sign(key))
    else:
        value = encode(_record(ca, key, "a", 100.0, role="scheduler").sign(key))
    with pytest.raises(ValueError):
        validator.validate(key_name, value)


@pytest.mark.trio
async def test_record_put_by_one_daemon_is_found_by_another() -> None:
    import trio

    from fabricd.identity import raw_private_key
    from proto.codec import decode

    ca = generate_ca()
    membership = SimpleNamespace(ca_public=public_key_bytes(ca.public_key()), revoked=frozenset())
    async with _linked_stacks(membership) as (a, b, kp_a):
        key_a = Ed25519PrivateKey.from_private_bytes(raw_private_key(kp_a))
        assert public_key_bytes(key_a.public_key()) == kp_a.public_key.to_bytes()
        record = _record(ca, key_a, "a", time.time()).sign(key_a)
        with trio.fail_after(30):
            await a.dht.put_value(dht_key("a"), encode(record))
            value = await b.dht.get_value(dht_key("a"))
        assert value is not None and decode(value) == record
        # A forged record (signed by the wrong key) is refused locally before it is stored.
        forged = _record(ca, key_a, "a", time.time() + 10).sign(Ed25519PrivateKey.generate())
        with pytest.raises(Exception):  # noqa: B017 - the library wraps the validator's ValueError
            await a.dht.put_value(dht_key("a"), encode(forged))


@pytest.mark.trio
async def test_a_lookup_dials_no_address_a_reply_named() -> None:
    """Kademlia lookups talk to connected members only: a peer that a FIND_NODE reply named
    (here put straight into the routing table, with a bystander's address) is not dialled,
    and the record is still stored at the member this daemon is linked with."""
    import multiaddr
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import PeerInfo

    from fabricd.identity import raw_private_key

    accepted: list[int] = []

    async def bystander(stream: trio.SocketStream) -> None:
        accepted.append(1)
        await stream.aclose()

    ca = generate_ca()
    membership = SimpleNamespace(ca_public=public_key_bytes(ca.public_key()), revoked=frozenset())
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery, _linked_stacks(membership) as (a, b, kp_a):
        nursery.start_soon(trio.serve_listeners, bystander, listeners)
        key_a = Ed25519PrivateKey.from_private_bytes(raw_private_key(kp_a))
        stranger = ID.from_pubkey(create_new_key_pair().public_key)
        where = [multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")]
        a.host.get_peerstore().add_addrs(stranger, where, 3600)
        await a.dht.routing_table.add_peer(PeerInfo(stranger, where))
        with trio.fail_after(30):
            await a.dht.put_value(dht_key("a"), encode(_record(ca, key_a, "a", time.time()).sign(key_a)))
        await trio.sleep(0.5)
        assert accepted == []
        assert b.dht.value_store.get(dht_key("a").encode()) is not None
        nursery.cancel_scope.cancel()
