"""Opening a stream never fails an update: 200 concurrent 1 MiB updates and 40 concurrent
probes into one daemon all arrive, each verified; streams are reused across updates."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from proto.bridge import BridgeClient, Delivery, SendResult, SendUpdate, bridge_header
from tests.fabricd._harness import FABRICD, Node, bridge_status, connected_fast, wait_until
from tests.fabricd._transfer_load import blast

pytestmark = pytest.mark.slow

MIB = 1024 * 1024


def _reused_streams(node: Node) -> int:
    """Reused pooled streams: libp2p update streams and data-plane connections."""
    transfer = bridge_status(node)["transfer"]
    return int(transfer["streams_reused"]) + int(transfer["dataplane_streams_reused"])


def test_200_concurrent_1_mib_updates_all_arrive_verified(mesh) -> None:
    a, b = mesh.nodes["a"], mesh.nodes["b"]
    wait_until(lambda: "b" in connected_fast(a), timeout=30)
    before = _reused_streams(a)
    result = blast(a, b, count=200, size=MIB, sockets=4)
    assert result.failed == [] and result.ok == 200, result.summary()
    assert result.delivered == 200 and result.digest_mismatch == 0, result.summary()
    transfer = bridge_status(a)["transfer"]
    # 200 updates over a handful of streams: most of them rode a stream already open.
    assert transfer["streams_reused"] + transfer["dataplane_streams_reused"] - before >= 150, transfer
    # 1 MiB bodies go over the data plane by default (limits.dataplane_min_bytes), BLAKE3-verified
    assert transfer["dataplane_streams_reused"] > 0, transfer
    assert re.search(r"event=update\.received .*verified=blake3", b.log())


def test_40_concurrent_probes_all_succeed(mesh) -> None:
    a = mesh.nodes["a"]
    wait_until(lambda: {"b", "c"} <= connected_fast(a), timeout=30)

    def probe(i: int) -> subprocess.CompletedProcess[str]:
        target = "b" if i % 2 else "c"
        return subprocess.run([*FABRICD, "probe", "--config", a.config, "--cluster", target,
                               "--bytes", str(MIB)], capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(40) as pool:
        runs = list(pool.map(probe, range(40)))
    failed = [r.stderr[-500:] for r in runs if r.returncode != 0]
    assert failed == [], failed
    assert all(json.loads(r.stdout)["bytes"] == MIB for r in runs)


def _bridge_up(node: Node) -> bool:
    try:
        bridge_status(node)
    except OSError:
        return False
    return True


@pytest.mark.parametrize("size", [64 * 1024, 128 * 1024], ids=["dataplane-inline", "libp2p"])
def test_a_broken_pooled_stream_is_retried_transparently(mesh, size: int) -> None:
    """Kill -9 the receiver between two batches: the streams pooled to it are dead; after
    it restarts, the next updates go on fresh streams and each is delivered once. 64 KiB
    bodies ride pooled data-plane connections (limits.dataplane_small_bytes), 128 KiB
    bodies pooled libp2p streams."""
    a = mesh.nodes["a"]
    name = f"r{size // 1024}"
    r = mesh.add(name, [a.addr()])
    wait_until(lambda: name in connected_fast(a), timeout=60)
    key = "dataplane_streams" if size <= 64 * 1024 else "streams"
    before = bridge_status(a)["transfer"]
    first = blast(a, r, count=4, size=size, sockets=1)
    assert first.ok == 4 and first.delivered == 4, first.summary()
    after = bridge_status(a)["transfer"]
    assert (after[f"{key}_opened"] + after[f"{key}_reused"]
            - before[f"{key}_opened"] - before[f"{key}_reused"]) == 4, (key, before, after)
    r.kill9()
    r.start()
    wait_until(lambda: _bridge_up(r), timeout=60)
    wait_until(lambda: name in connected_fast(a), timeout=60)
    second = blast(a, r, count=4, size=size, sockets=1)
    assert second.ok == 4 and second.delivered == 4 and second.digest_mismatch == 0, second.summary()
    # The sender's own retry handled the dead streams; none of the sends failed outright.
    assert f"event=update.send_failed peer={bridge_status(r)['peer_id']} message_id={second.job}" not in a.log()
    r.stop()


def test_64_mib_updates_go_executor_to_executor_through_both_bridges(mesh) -> None:
    a, b = mesh.nodes["a"], mesh.nodes["b"]
    wait_until(lambda: "b" in connected_fast(a), timeout=30)
    result = blast(a, b, count=3, size=64 * MIB, sockets=2)
    assert result.failed == [] and result.ok == 3, result.summary()
    assert result.delivered == 3 and result.digest_mismatch == 0, result.summary()


def test_a_large_payload_that_does_not_match_its_digest_is_never_delivered(mesh) -> None:
    """Large payloads are hashed while already streaming; the last chunk waits for the hash."""
    a, b = mesh.nodes["a"], mesh.nodes["b"]
    wait_until(lambda: "b" in connected_fast(a), timeout=30)
    payload = b"z" * (9 * MIB)
    job = "gate-1"
    path_a, path_b = (n.bridge_socket for n in (a, b))
    with BridgeClient(path_b, role="executor", cluster_id="b", job_id=job, timeout=30) as executor, \
            BridgeClient(path_a, role="executor", cluster_id="a", job_id=job, timeout=60) as sender:
        wait_until(lambda: any(c["job_id"] == job for c in bridge_status(b)["bridge_clients"]), 10)
        bad = SendUpdate(target_cluster="b", job_id=job, round=1, source_node="n1", target_node="n2",
                         message_id="gate-bad", tensor_count=1, byte_length=len(payload),
                         sha256=hashlib.sha256(b"something else").digest())
        reply, _ = sender.request(bad, payload)
        assert isinstance(reply, SendResult) and not reply.ok, reply
        assert "sha256" in reply.reason and "nothing was delivered" in reply.reason, reply.reason
        executor.sock.settimeout(1.0)
        with pytest.raises(socket.timeout):
            executor.recv()
    assert "gate-bad" not in [m for m in re.findall(r"event=update\.received .*?message_id=(\S+)", b.log())]
    assert bridge_status(b)["jobs"].get(job, {}).get("received_updates", 0) == 0


def test_a_client_that_leaves_mid_payload_delivers_nothing_and_frees_its_budget(mesh) -> None:
    """Large payloads are sent while still arriving (cut-through); a client that hangs up
    halfway leaves no partial update anywhere and no bytes booked against the budget."""
    a, b = mesh.nodes["a"], mesh.nodes["b"]
    wait_until(lambda: "b" in connected_fast(a), timeout=30)
    payload = os.urandom(MIB) * 16
    job = "cut-1"
    path_a, path_b = (n.bridge_socket for n in (a, b))
    msg = SendUpdate(target_cluster="b", job_id=job, round=1, source_node="n1", target_node="n2",
                     message_id="cut-half", tensor_count=1, byte_length=len(payload),
                     sha256=hashlib.sha256(payload).digest())
    with BridgeClient(path_b, role="executor", cluster_id="b", job_id=job, timeout=30) as executor:
        wait_until(lambda: any(c["job_id"] == job for c in bridge_status(b)["bridge_clients"]), 10)
        with BridgeClient(path_a, role="executor", cluster_id="a", job_id=job, timeout=30) as quitter:
            quitter.sock.sendall(bridge_header(msg, len(payload)))
            quitter.sock.sendall(payload[: len(payload) // 2])
        try:
            wait_until(lambda: bridge_status(a)["transfer"]["outgoing_bytes"] == 0, timeout=30)
        except AssertionError as exc:  # what a's send of it did, for the next reader
            told = [line for line in a.log().splitlines() if "cut-" in line or "bridge.rejected" in line]
            raise AssertionError(f"{exc}; transfer {bridge_status(a)['transfer']}; a's log: "
                                 + "\n".join(told[-20:])) from None
        executor.sock.settimeout(2.0)
        with pytest.raises(socket.timeout):
            executor.recv()
        # The same update sent in full afterwards arrives once, intact.
        executor.sock.settimeout(60)
        got: list[tuple[object, bytes]] = []
        reader = threading.Thread(target=lambda: got.append(executor.recv()), daemon=True)
        reader.start()  # the daemon hands the update over while the sender waits for its ack
        with BridgeClient(path_a, role="executor", cluster_id="a", job_id=job, timeout=60) as sender:
            reply, _ = sender.request(msg, payload)
        assert isinstance(reply, SendResult) and reply.ok, reply
        reader.join(60)
        delivery, body = got[0]
        assert isinstance(delivery, Delivery) and delivery.message_id == "cut-half" and body == payload
