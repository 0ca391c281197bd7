"""Signed control bodies (fabricd.signing): what a receiving daemon accepts and refuses."""

from __future__ import annotations

import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fabricd.signing import seal, unseal
from proto.certs import generate_ca, issue_certificate, parse_certificate, public_key_bytes
from proto.errors import InvalidMessage, NotAMember, ProtocolError, WrongRole

CA = generate_ca()
NOW = int(time.time()) - 60


def member(role: str, ca: Ed25519PrivateKey = CA) -> tuple[Ed25519PrivateKey, bytes, str]:
    key = Ed25519PrivateKey.generate()
    cert = issue_certificate(ca, key.public_key(), f"{role}-x", role, not_before=NOW)
    return key, cert, parse_certificate(cert).peer_id


JOB = {"kind": "job.start", "job_id": "j", "clients": [1, 2]}


def check(body: dict, sender: str, revoked: tuple[int, ...] = ()) -> tuple:
    return unseal(body, sender_peer=sender, ca_public=public_key_bytes(CA), revoked=revoked)


def test_a_scheduler_signed_job_message_opens_to_the_original_body() -> None:
    key, cert, peer = member("scheduler")
    signer, body = check(seal(JOB, cert, key), peer)
    assert body == JOB and signer.role == "scheduler" and signer.peer_id == peer


def test_a_cluster_may_send_other_control_but_not_job_messages() -> None:
    key, cert, peer = member("cluster")
    assert check(seal({"kind": "hello"}, cert, key), peer)[1] == {"kind": "hello"}
    for kind in ("job.start", "round.run", "node.export"):
        with pytest.raises(WrongRole, match="must be signed by a scheduler certificate"):
            check(seal({**JOB, "kind": kind}, cert, key), peer)


def test_unsigned_relayed_and_tampered_bodies_are_refused() -> None:
    key, cert, peer = member("scheduler")
    with pytest.raises(InvalidMessage, match="not signed"):
        check(JOB, peer)
    _, _, other_peer = member("cluster")
    with pytest.raises(NotAMember, match="sent by"):
        check(seal(JOB, cert, key), other_peer)  # someone else relays the scheduler's envelope
    sealed = seal(JOB, cert, key)
    tampered = {"signed": sealed["signed"][:-3] + b"xyz"}
    with pytest.raises(ProtocolError):
        check(tampered, peer)


def test_foreign_ca_and_revoked_signers_are_refused() -> None:
    key, cert, peer = member("scheduler", ca=generate_ca())
    with pytest.raises(NotAMember):
        check(seal(JOB, cert, key), peer)
    key, cert, peer = member("scheduler")
    with pytest.raises(NotAMember):
        check(seal(JOB, cert, key), peer, revoked=(parse_certificate(cert).serial,))
