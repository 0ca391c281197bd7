"""The Kademlia namespace validator: only CA-certified, self-signed ClusterRecords are stored."""

from __future__ import annotations

import time
from types import SimpleNamespace

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
