from __future__ import annotations

import os
import stat
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from proto import certs
from proto.certs import RevocationList, issue_certificate, verify_certificate
from proto.codec import decode, encode
from proto.errors import (
    CertificateExpired,
    CertificateRevoked,
    ForeignCertificate,
    NotAMember,
    PeerMismatch,
    SignatureError,
    WrongRole,
)
from proto.messages import ClusterRecord, SignedEnvelope, open_envelope, sign_envelope

NOW = 1_800_000_000


@pytest.fixture(scope="module")
def ca() -> Ed25519PrivateKey:
    return certs.generate_ca()


@pytest.fixture(scope="module")
def member() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def _issue(ca: Ed25519PrivateKey, key: Ed25519PrivateKey, cluster_id: str = "lab-a",
           **kw: Any) -> bytes:
    args: dict[str, Any] = dict(not_before=NOW - 10, not_after=NOW + 3600, serial=42)
    args.update(kw)
    return issue_certificate(ca, key.public_key(), cluster_id, **args)


def test_peer_id_matches_libp2p() -> None:
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    for _ in range(5):
        pair = create_new_key_pair()
        raw = pair.public_key.to_bytes()
        expected = ID.from_pubkey(pair.public_key).to_base58()
        assert certs.peer_id_from_ed25519_public(raw) == expected
        assert certs.ed25519_public_from_peer_id(expected) == raw
        # a libp2p private key converts to a cryptography key with the same public key
        converted = Ed25519PrivateKey.from_private_bytes(pair.private_key.to_bytes())
        assert certs.public_key_bytes(converted) == raw


def test_issue_and_verify(ca: Ed25519PrivateKey, member: Ed25519PrivateKey) -> None:
    data = _issue(ca, member)
    cert = verify_certificate(data, ca.public_key(), now=NOW, revoked=(),
                              expected_peer_id=certs.peer_id_from_ed25519_public(
                                  certs.public_key_bytes(member)),
                              required_role="cluster")
    assert cert.cluster_id == "lab-a" and cert.role == "cluster" and cert.serial == 42
    assert cert.public_key == certs.public_key_bytes(member)
    assert certs.parse_certificate(data) == cert


def test_foreign_ca(ca: Ed25519PrivateKey, member: Ed25519PrivateKey) -> None:
    other = certs.generate_ca()
    with pytest.raises(ForeignCertificate, match="not signed by this federation's CA"):
        verify_certificate(_issue(other, member), ca.public_key(), now=NOW)


def test_expired_and_not_yet_valid(ca: Ed25519PrivateKey, member: Ed25519PrivateKey) -> None:
    data = _issue(ca, member)
    with pytest.raises(CertificateExpired, match="expired at"):
        verify_certificate(data, ca.public_key(), now=NOW + 3601)
    with pytest.raises(CertificateExpired, match="not valid before"):
        verify_certificate(data, ca.public_key(), now=NOW - 11)


def test_revoked(ca: Ed25519PrivateKey, member: Ed25519PrivateKey, tmp_path: Path) -> None:
    data = _issue(ca, member, serial=7)
    path = tmp_path / "revoked.txt"
    assert len(RevocationList.load(path)) == 0  # missing file = nothing revoked
    verify_certificate(data, ca.public_key(), now=NOW, revoked=RevocationList.load(path))
    path.write_text("# revoked serials\n\n123  # old\n")
    RevocationList.append(path, 7, comment="lab-a compromised")
    revoked = RevocationList.load(path)
    assert set(revoked) == {7, 123}
    with pytest.raises(CertificateRevoked, match="serial 7"):
        verify_certificate(data, ca.public_key(), now=NOW, revoked=revoked)


def test_revocation_list_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "revoked.txt"
    path.write_text("12\nnot-a-serial\n")
    with pytest.raises(ValueError, match=r"revoked.txt:2: 'not-a-serial'"):
        RevocationList.load(path)


def test_peer_mismatch(ca: Ed25519PrivateKey, member: Ed25519PrivateKey) -> None:
    data = _issue(ca, member)
    with pytest.raises(PeerMismatch, match="presented by 12D3KooWother"):
        verify_certificate(data, ca.public_key(), now=NOW, expected_peer_id="12D3KooWother")
    # a CA-signed certificate whose key does not hash to its peer id
    other = Ed25519PrivateKey.generate()
    cert = certs.Certificate(
        peer_id=certs.peer_id_from_ed25519_public(certs.public_key_bytes(other)),
        cluster_id="lab-a", role="cluster", not_before=0, not_after=NOW * 2, serial=1,
        public_key=certs.public_key_bytes(member),
    )
    tbs = msgpack.packb(cert.to_map(), use_bin_type=True)
    forged = msgpack.packb({"v": 1, "type": "SignedCertificate", "tbs": tbs,
                            "signature": ca.sign(certs.CERT_DOMAIN + tbs)}, use_bin_type=True)
    with pytest.raises(PeerMismatch, match="does not hash"):
        verify_certificate(forged, ca.public_key(), now=NOW)


def test_wrong_role(ca: Ed25519PrivateKey, member: Ed25519PrivateKey) -> None:
    data = _issue(ca, member)
    with pytest.raises(WrongRole, match="needs role 'scheduler'"):
        verify_certificate(data, ca.public_key(), now=NOW, required_role="scheduler")
    with pytest.raises(Exception, match="not one of"):
        _issue(ca, member, role="admin")


def test_garbage_certificate_is_not_a_member(ca: Ed25519PrivateKey) -> None:
    for data in (b"", b"\xc1garbage", msgpack.packb({"v": 1, "type": "Certificate"})):
        with pytest.raises(NotAMember, match="malformed"):
            verify_certificate(data, ca.public_key(), now=NOW)


def test_save_and_load_ca(tmp_path: Path) -> None:
    key = certs.save_ca(tmp_path / "ca")
    assert stat.S_IMODE(os.stat(tmp_path / "ca" / "ca.key").st_mode) == 0o600
    loaded = certs.load_ca_private(tmp_path / "ca")
    assert certs.public_key_bytes(loaded) == certs.public_key_bytes(key)
    assert certs.public_key_bytes(certs.load_ca_public(tmp_path / "ca" / "ca.pub")) == \
        certs.public_key_bytes(key)
    with pytest.raises(FileExistsError):
        certs.save_ca(tmp_path / "ca")
    (tmp_path / "bad.pub").write_text("nope")
    with pytest.raises(ValueError, match="bad.pub"):
        certs.load_ca_public(tmp_path / "bad.pub")


def test_cluster_record_sign_verify(ca: Ed25519PrivateKey, member: Ed25519PrivateKey) -> None:
    peer = certs.peer_id_from_ed25519_public(certs.public_key_bytes(member))
    record = ClusterRecord(cluster_id="lab-a", peer_id=peer, addrs=("/ip4/127.0.0.1/tcp/1",),
                           capacity=4, issued_at=NOW, certificate=_issue(ca, member))
    with pytest.raises(SignatureError, match="not signed"):
        record.verify(member.public_key())
    signed = record.sign(member)
    signed.verify(member.public_key())
    assert decode(encode(signed)) == signed
    assert signed.verify_member(ca.public_key(), now=NOW).peer_id == peer
    tampered = replace(signed, capacity=5)
    with pytest.raises(SignatureError, match="bad signature"):
        tampered.verify_member(ca.public_key(), now=NOW)
    wrong_cluster = replace(record, cluster_id="lab-b").sign(member)
    with pytest.raises(PeerMismatch, match="lab-b"):
        wrong_cluster.verify_member(ca.public_key(), now=NOW)
    with pytest.raises(CertificateRevoked):
        signed.verify_member(ca.public_key(), now=NOW, revoked={42})


def test_signed_envelope(ca: Ed25519PrivateKey, member: Ed25519PrivateKey) -> None:
    sched_cert = _issue(ca, member, role="scheduler", cluster_id="scheduler")
    env = sign_envelope(b"routing-matrix", sched_cert, member)
    decoded = decode(encode(env))
    assert decoded == env and isinstance(decoded, SignedEnvelope)
    cert, payload = open_envelope(env, ca.public_key(), now=NOW, revoked=(),
                                  required_role="scheduler")
    assert payload == b"routing-matrix" and cert.role == "scheduler"
    # signed with a key other than the certificate's
    forged = sign_envelope(b"routing-matrix", sched_cert, Ed25519PrivateKey.generate())
    with pytest.raises(SignatureError, match="does not match the key"):
        open_envelope(forged, ca.public_key(), now=NOW, revoked=(), required_role="scheduler")
    # a cluster certificate cannot sign scheduler messages
    cluster_env = sign_envelope(b"x", _issue(ca, member), member)
    with pytest.raises(WrongRole):
        open_envelope(cluster_env, ca.public_key(), now=NOW, revoked=(),
                      required_role="scheduler")
    with pytest.raises(ForeignCertificate):
        open_envelope(env, certs.generate_ca().public_key(), now=NOW, revoked=(),
                      required_role="scheduler")


def test_revocation_watcher_rereads_and_survives_typos(tmp_path: Path) -> None:
    path = tmp_path / "revoked.txt"
    watcher = certs.RevocationWatcher(path)
    assert 5 not in watcher.current()
    certs.RevocationList.append(path, 5)
    assert 5 in watcher.current()
    path.write_text("5\n6\nbroken line\n")
    assert 5 in watcher.current() and 6 not in watcher.current()  # previous list kept
    path.write_text("6\n")
    os.utime(path, ns=(1, 1))  # a different mtime even on coarse-timestamp filesystems
    assert set(watcher.current()) == {6}
