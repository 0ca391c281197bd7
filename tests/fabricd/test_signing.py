"""Signed control bodies (fabricd.signing): what a receiving daemon accepts and refuses."""

from __future__ import annotations

import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fabricd.control import JobOwners
from fabricd.signing import ReplayWindow, unseal
from fabricd.signing import seal as _seal
from proto.certs import generate_ca, issue_certificate, parse_certificate, public_key_bytes
from proto.errors import InvalidMessage, NotAMember, ProtocolError, WrongRole

CA = generate_ca()
NOW = int(time.time()) - 60


def member(role: str, ca: Ed25519PrivateKey = CA) -> tuple[Ed25519PrivateKey, bytes, str]:
    key = Ed25519PrivateKey.generate()
    cert = issue_certificate(ca, key.public_key(), f"{role}-x", role, not_before=NOW)
    return key, cert, parse_certificate(cert).peer_id


JOB = {"kind": "job.start", "job_id": "j", "clients": [1, 2]}


def seal(body: dict, cert: bytes, key: Ed25519PrivateKey, audience: str = "b", **kw) -> dict:
    return _seal(body, cert, key, audience=audience, **kw)


def check(body: dict, sender: str, revoked: tuple[int, ...] = (), audience: str = "b", **kw) -> tuple:
    return unseal(body, sender_peer=sender, ca_public=public_key_bytes(CA), revoked=revoked,
                  audience=audience, **kw)


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


def test_re_targeted_expired_and_replayed_envelopes_are_refused() -> None:
    key, cert, peer = member("scheduler")
    with pytest.raises(InvalidMessage, match="addressed to cluster 'c', not 'b'"):
        check(seal(JOB, cert, key, audience="c"), peer)
    old = seal(JOB, cert, key, now=time.time() - 300)
    with pytest.raises(InvalidMessage, match="expired"):
        check(old, peer)
    with pytest.raises(InvalidMessage, match="not acceptable"):
        check(seal(JOB, cert, key, ttl=3600), peer)
    window = ReplayWindow()
    fresh = seal(JOB, cert, key)
    assert check(fresh, peer, replay=window)[1] == JOB
    with pytest.raises(InvalidMessage, match="replayed"):
        check(fresh, peer, replay=window)
    # Genuine traffic still flows: a new envelope for the same body is accepted.
    assert check(seal(JOB, cert, key), peer, replay=window)[1] == JOB


def test_a_full_replay_window_refuses_what_it_forgot() -> None:
    key, cert, peer = member("scheduler")
    window = ReplayWindow(limit=3)
    t0 = time.time()
    first = seal(JOB, cert, key, now=t0)
    check(first, peer, replay=window)
    for i in range(1, 4):
        check(seal(JOB, cert, key, now=t0 + i), peer, replay=window)
    assert len(window) == 3
    with pytest.raises(InvalidMessage, match="older than the replay window"):
        check(first, peer, replay=window)


def test_only_the_scheduler_that_started_a_job_may_steer_it() -> None:
    _, cert1, _ = member("scheduler")
    _, cert2, _ = member("scheduler")
    owner, other = parse_certificate(cert1), parse_certificate(cert2)
    owners = JobOwners()
    owners.check({"kind": "job.start", "job_id": "j"}, owner)
    for kind in ("job.stop", "job.plan", "job.plan.part", "job.profile", "round.run",
                 "node.export", "job.start"):
        with pytest.raises(WrongRole, match="is owned by scheduler peer"):
            owners.check({"kind": kind, "job_id": "j"}, other)
        owners.check({"kind": kind, "job_id": "j"}, owner)
    owners.check({"kind": "hello"}, other)  # not a job message: no owner involved
