"""The TLS 1.3 bulk data plane between two real daemons (fabricd/_dataplane.py): large
updates go over it with their digest verified, small ones too (in their header's record),
mid-sized ones stay on libp2p, a stranger's or a thief's TLS connection changes nothing,
and a sender killed mid-body delivers nothing."""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fabricd._dataplane import KEY_BYTES, TICKET_BYTES
from proto.bridge import BridgeClient, Delivery, SendUpdate, bridge_header
from tests.fabricd._harness import (
    Node,
    bridge_status,
    start_pair,
    transfer,
    wait_linked,
    wait_until,
)
from tests.fabricd._transfer_load import blast

pytestmark = pytest.mark.slow

MIB = 1024 * 1024
MIN_BYTES = 1 * MIB


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Node]]:
    nodes = start_pair(tmp_path_factory.mktemp("dataplane"), f"dataplane_min_bytes = {MIN_BYTES}")
    yield nodes
    for node in nodes:
        node.stop()


def _dataplane_port(node: Node) -> int:
    return int(transfer(node)["dataplane_port"])


def test_large_update_goes_over_the_dataplane_verified(pair: tuple[Node, Node]) -> None:
    a, b = pair
    before_a, before_b = transfer(a), transfer(b)
    result = blast(a, b, count=3, size=8 * MIB, sockets=1)
    assert result.failed == [] and result.ok == 3, result.summary()
    assert result.delivered == 3 and result.digest_mismatch == 0, result.summary()
    after_a, after_b = transfer(a), transfer(b)
    assert after_b["dataplane_accepted"] > before_b["dataplane_accepted"], after_b
    used = (after_a["dataplane_streams_opened"] + after_a["dataplane_streams_reused"]
            - before_a["dataplane_streams_opened"] - before_a["dataplane_streams_reused"])
    assert used == 3, (before_a, after_a)
    assert after_a["dataplane_fallbacks"] == before_a["dataplane_fallbacks"], after_a
    # libp2p update streams carried none of them
    assert (after_a["streams_opened"] + after_a["streams_reused"]
            == before_a["streams_opened"] + before_a["streams_reused"]), (before_a, after_a)
    assert f"job={result.job}" in b.log() and "verified=blake3" in b.log()


def test_small_updates_ride_the_plane_and_mid_sized_ones_libp2p(pair: tuple[Node, Node]) -> None:
    a, b = pair
    before = transfer(a)
    result = blast(a, b, count=4, size=64 * 1024, sockets=1)
    assert result.failed == [] and result.delivered == 4 and result.digest_mismatch == 0, result.summary()
    after = transfer(a)
    # up to limits.dataplane_small_bytes (64 KiB): over the plane, each in its header's record
    assert (after["dataplane_streams_opened"] + after["dataplane_streams_reused"]
            - before["dataplane_streams_opened"] - before["dataplane_streams_reused"]) == 4, (before, after)
    assert (after["streams_opened"] + after["streams_reused"]
            == before["streams_opened"] + before["streams_reused"]), (before, after)
    mid = blast(a, b, count=2, size=128 * 1024, sockets=1)
    assert mid.failed == [] and mid.delivered == 2 and mid.digest_mismatch == 0, mid.summary()
    last = transfer(a)
    # above it and below limits.dataplane_min_bytes: libp2p
    assert (last["dataplane_streams_opened"] + last["dataplane_streams_reused"]
            == after["dataplane_streams_opened"] + after["dataplane_streams_reused"]), (after, last)
    assert (last["streams_opened"] + last["streams_reused"]
            - after["streams_opened"] - after["streams_reused"]) == 2, (after, last)


def _tls_client(port: int, cert: Path | None, key: Path | None, first_bytes: bytes) -> str:
    """Connect to a data-plane port as a TLS client (trusting any server), send
    ``first_bytes``; what happened: 'handshake refused', 'closed' or 'open'."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if cert is not None and key is not None:
        ctx.load_cert_chain(cert, key)
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        sock = ctx.wrap_socket(raw)
        sock.sendall(first_bytes)
        sock.settimeout(8)
        data = sock.recv(1)
    except (ssl.SSLError, ConnectionError):
        return "handshake refused"
    except TimeoutError:
        return "open"
    finally:
        raw.close()
    return "closed" if data == b"" else "open"


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stranger")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    (tmp / "s.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / "s.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return tmp / "s.crt", tmp / "s.key"


def test_strangers_and_forged_tickets_are_refused_and_change_nothing(
        pair: tuple[Node, Node], tmp_path: Path) -> None:
    a, b = pair
    # a large update first, so that b trusts a's data-plane certificate
    assert blast(a, b, count=1, size=2 * MIB, sockets=1).delivered == 1
    port = _dataplane_port(b)
    before = transfer(b)
    stranger = _self_signed(tmp_path)
    assert _tls_client(port, None, None, os.urandom(32)) == "handshake refused"
    assert _tls_client(port, *stranger, os.urandom(32)) == "handshake refused"
    # A thief holding a member's TLS key (a's, from its state directory) but no ticket:
    # a forged ticket (with keys) and a ticket-less connection are closed after TLS.
    [state] = list(a.dir.glob("fabricd-dp-*"))
    thief = (state / "dataplane.crt", state / "dataplane.key")
    assert _tls_client(port, *thief, os.urandom(TICKET_BYTES + 2 * KEY_BYTES)) == "closed"
    assert _tls_client(port, *thief, b"") == "closed"
    after = transfer(b)
    assert after["dataplane_refused"] - before["dataplane_refused"] == 4, (before, after)
    assert after["dataplane_accepted"] == before["dataplane_accepted"], after
    assert "no valid ticket" in b.log()
    # b is unharmed: the next large update still goes over the data plane
    result = blast(a, b, count=1, size=2 * MIB, sockets=1)
    assert result.delivered == 1 and result.digest_mismatch == 0, result.summary()


def test_sender_killed_mid_body_delivers_nothing_and_receiver_stays_healthy(
        pair: tuple[Node, Node]) -> None:
    a, b = pair
    job = f"kill-{uuid.uuid4().hex[:6]}"
    size = 64 * MIB
    body = os.urandom(size)
    digest = hashlib.sha256(body).digest()
    consumer = BridgeClient(b.bridge_socket, role="executor", cluster_id="b",
                            job_id=job, max_payload=size + 1, timeout=120)
    deliveries: list[str] = []

    def consume() -> None:
        try:
            while True:
                msg, _ = consumer.recv()
                if isinstance(msg, Delivery):
                    deliveries.append(msg.message_id)
        except OSError:
            pass

    threading.Thread(target=consume, daemon=True).start()
    wait_until(lambda: any(c["job_id"] == job for c in bridge_status(b)["bridge_clients"]), 30)
    sender = BridgeClient(a.bridge_socket, role="executor", cluster_id="a",
                          job_id=job, timeout=120)
    msg = SendUpdate(target_cluster="b", job_id=job, round=1, source_node="s", target_node="t",
                     message_id=f"{job}-0", tensor_count=1, byte_length=size, sha256=digest)
    before = transfer(a)
    # Half the payload: a forwards it at once (cut-through) and then waits for the rest.
    sender.sock.sendall(bridge_header(msg, size))
    sender.sock.sendall(body[: size // 2])
    wait_until(lambda: transfer(b)["inflight_in_bytes"] == size, timeout=60)
    now = transfer(a)
    assert (now["dataplane_streams_opened"] + now["dataplane_streams_reused"]
            == before["dataplane_streams_opened"] + before["dataplane_streams_reused"] + 1), (before, now)
    a.kill9()
    sender.close()
    wait_until(lambda: transfer(b)["inflight_in_bytes"] == 0, timeout=60)
    time.sleep(1.0)  # a delivery, if one were (wrongly) made, would reach the consumer now
    assert deliveries == []
    assert "body ended after" in b.log()
    # b is healthy: a restarted a delivers large and small updates through it
    a.log_path.write_bytes(b"")  # so wait_ready sees this start's ready line
    a.start()
    a.wait_ready()
    wait_linked(a, b)
    for nbytes in (4 * MIB, 4096):
        result = blast(a, b, count=2, size=nbytes, sockets=1)
        assert result.failed == [] and result.delivered == 2 and result.digest_mismatch == 0, result.summary()
    consumer.close()
