"""Large bodies cross both bridges as sealed memfds (proto._bridge_fds), between real
daemons: an update passed as a descriptor arrives as one, its digest verified; a
descriptor that is not a sealed memfd of the declared size is refused with its reason
(nothing sent) and the daemon keeps serving; no descriptor or mapping is left behind."""

from __future__ import annotations

import array
import fcntl
import hashlib
import json
import mmap
import os
import socket
import struct
import threading
import uuid
from pathlib import Path

import pytest

from proto import bridge
from proto._bridge_fds import MAX_FDS_PER_READ, REQUIRED_SEALS, SpareMemfds
from proto.bridge import (
    BridgeClient,
    Delivery,
    DeliveryResult,
    Error,
    SendResult,
    SendUpdate,
    bridge_header,
)
from tests.fabricd._harness import Node, bridge_status, connected_fast, wait_until
from tests.fabricd._transfer_load import blast

pytestmark = pytest.mark.slow

MIB = 1024 * 1024
SIZE = 8 * MIB  # over the data plane's 1 MiB and the bridge's FD_MIN_BYTES


def _memfds(node: Node) -> tuple[int, int]:
    """(descriptors, mappings) of ``node``'s daemon that are fedpilot memfds, other than its
    spares (made ahead for the next large body: proto._bridge_fds.SpareMemfds, at most two;
    each one mapping and two descriptors: its memfd and the one mmap keeps)."""
    assert node.proc is not None
    pid = node.proc.pid
    spares = bridge_status(node)["transfer"]["spare_memfds"]
    assert spares <= 2, spares
    fds = -2 * spares
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        try:
            fds += os.readlink(entry).startswith("/memfd:fedpilot")
        except OSError:
            pass  # closed while listed
    maps = Path(f"/proc/{pid}/maps").read_text().count("/memfd:fedpilot") - spares
    return fds, maps


def _update(job: str, body: bytes, target: str = "b", size: int | None = None) -> SendUpdate:
    return SendUpdate(target_cluster=target, job_id=job, round=1, source_node="s", target_node="t",
                      message_id=f"{job}-{uuid.uuid4().hex[:6]}", tensor_count=1,
                      byte_length=len(body) if size is None else size,
                      sha256=hashlib.sha256(body).digest())


@pytest.fixture(autouse=True)
def _no_send_spares(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's descriptors are counted here: it makes no spare memfd for its next
    payload (proto.bridge.SEND_SPARES; tests/proto/test_bridge_fds.py tests them)."""
    monkeypatch.setattr(bridge, "SEND_SPARES", SpareMemfds(0))


def _send_with_fds(sock: socket.socket, frame: bytes, fds: list[int]) -> None:
    sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())])


class Consumer:
    """An executor on b that takes deliveries as memfds and answers each."""

    def __init__(self, b: Node, job: str) -> None:
        self.client = BridgeClient(b.bridge_socket, role="executor", cluster_id=b.name, job_id=job,
                                   answers_deliveries=True, accepts_fds=True, max_payload=1 << 30)
        self.got: list[tuple[Delivery, bool, bytes]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        wait_until(lambda: any(c["job_id"] == job for c in bridge_status(b)["bridge_clients"]), 30)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                msg, payload = self.client.recv()
                if isinstance(msg, Delivery):
                    self.got.append((msg, isinstance(payload, mmap.mmap),
                                     hashlib.sha256(payload).digest()))
                    if isinstance(payload, mmap.mmap):
                        payload.close()
                    self.client.send(DeliveryResult(message_id=msg.message_id, ok=True, reason="",
                                                    source_cluster=msg.source_cluster))
        except (OSError, EOFError):
            return

    def close(self) -> None:
        try:
            self.client.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.thread.join(10)
        self.client.close()


def test_large_update_passes_as_memfds_both_ways_verified(mesh) -> None:  # type: ignore[no-untyped-def]
    """Twice, the same size: first claiming a sha256, then a BLAKE3 (what executors claim),
    received into the spare memfd b made after the first. b is a daemon of its own: the
    mesh's b may still hold two spares of other sizes from earlier tests (freed only after
    60 s idle) and would then make none of this size."""
    a = mesh.nodes["a"]
    b = mesh.add("fdb", [a.addr()])
    wait_until(lambda: "fdb" in connected_fast(a), timeout=60)
    job = f"fd-{uuid.uuid4().hex[:6]}"
    bodies = [os.urandom(SIZE), os.urandom(SIZE)]
    try:
        _both_ways(a, b, job, bodies)
    finally:
        b.stop()
        mesh.nodes.pop(b.name)


def _both_ways(a: Node, b: Node, job: str, bodies: list[bytes]) -> None:
    consumer = Consumer(b, job)
    own_fds_before = len(os.listdir("/proc/self/fd"))
    sent: list[SendUpdate] = []
    try:
        with BridgeClient(a.bridge_socket, role="executor", cluster_id="a", job_id=job, timeout=60) as sender:
            for i, body in enumerate(bodies):
                if i:  # b made a spare of this size after the first body went through
                    # (made, not only being made: that runs beside the event loop)
                    wait_until(lambda: (bridge_status(b)["transfer"]["spare_memfd_bytes"],
                                        bridge_status(b)["transfer"]["spare_memfd_bytes_making"]) == (SIZE, 0), 30)
                    taken = bridge_status(b)["transfer"]["spare_memfds_taken"]
                sent.append(_update(job, body, b.name) if i == 0 else SendUpdate.for_payload(
                    _safetensors(body), target_cluster=b.name, job_id=job, round=1, source_node="s",
                    target_node="t", message_id=f"{job}-{i}"))
                sender.send_update(sent[-1], body if i == 0 else _safetensors(body))
                reply, _ = sender.recv()
                assert isinstance(reply, SendResult) and reply.ok, reply
        wait_until(lambda: len(consumer.got) == 2, 10)
    finally:
        consumer.close()
    assert bridge_status(b)["transfer"]["spare_memfds_taken"] == taken + 1
    for i, (msg, (delivery, as_mapping, digest)) in enumerate(zip(sent, consumer.got, strict=True)):
        assert delivery.message_id == msg.message_id and delivery.source_cluster == "a"
        assert (delivery.sha256, delivery.blake3) == (msg.sha256, msg.blake3)
        assert as_mapping, "a large delivery to a client that accepts fds came as bytes"
        assert digest == hashlib.sha256(bodies[0] if i == 0 else _safetensors(bodies[1])).digest()
        assert "verified=blake3" in b.log().split(msg.message_id, 1)[1].split("\n", 1)[0]
    assert sent[1].blake3 and not sent[1].sha256
    # every descriptor and mapping released: here, on a (sent) and on b (delivered)
    assert len(os.listdir("/proc/self/fd")) <= own_fds_before
    for node in (a, b):
        wait_until(lambda node=node: _memfds(node) == (0, 0), 10)


def _safetensors(body: bytes) -> bytes:
    """SIZE bytes shaped like a safetensors file (a length, a JSON header naming one
    tensor, then ``body``'s bytes): what SendUpdate.for_payload reads its count from."""
    data = SIZE - 8 - 128
    head = json.dumps({"w": {"dtype": "U8", "shape": [data], "data_offsets": [0, data]}}).encode()
    return struct.pack("<Q", 128) + head.ljust(128, b" ") + body[:data]


def _refused(sock: socket.socket, what: str) -> str:
    from proto.bridge import recv_bridge

    reply, _ = recv_bridge(sock, 0)
    assert isinstance(reply, SendResult) and not reply.ok and not reply.retry, (what, reply)
    assert reply.bytes == 0 and "nothing was sent" in reply.reason, (what, reply)
    return reply.reason


def test_bad_descriptors_are_refused_and_the_daemon_keeps_serving(mesh) -> None:  # type: ignore[no-untyped-def]
    a, b = mesh.nodes["a"], mesh.nodes["b"]
    assert a.proc is not None
    job = f"fdbad-{uuid.uuid4().hex[:6]}"
    body = os.urandom(2 * MIB)
    consumer = Consumer(b, job)
    try:
        with BridgeClient(a.bridge_socket, role="executor", cluster_id="a", job_id=job, timeout=30) as client:
            sock = client.sock

            def frame(msg: SendUpdate) -> bytes:
                return bridge_header(msg, msg.byte_length, in_fd=True)

            # a memfd that is not sealed: it could change while the daemon reads it
            fd = os.memfd_create("fedpilot-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.write(fd, body)
            _send_with_fds(sock, frame(_update(job, body)), [fd])
            assert "not sealed" in _refused(sock, "unsealed")
            # sealed against writes only: it could still shrink under the mapping
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
            _send_with_fds(sock, frame(_update(job, body)), [fd])
            assert "F_SEAL_SHRINK missing" in _refused(sock, "write seal only")
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
            # a size lie: the header declares one byte more than the memfd holds
            _send_with_fds(sock, frame(_update(job, body, size=len(body) + 1)), [fd])
            reason = _refused(sock, "size lie")
            assert f"holds {len(body)} bytes, the frame declares {len(body) + 1}" in reason
            os.close(fd)
            # not a memfd at all
            r, w = os.pipe()
            _send_with_fds(sock, frame(_update(job, body)), [r])
            assert "not a memfd" in _refused(sock, "pipe")
            os.close(r)
            os.close(w)
            # the header says a descriptor comes with it, but none does
            sock.sendall(frame(_update(job, body)))
            assert "none came with the frame" in _refused(sock, "missing")
            # the same connection still sends a good update
            good = _update(job, body)
            client.send_update(good, body)
            reply, _ = client.recv()
            assert isinstance(reply, SendResult) and reply.ok, reply

        # a flood of descriptors in one write: Error, the connection is closed
        with BridgeClient(a.bridge_socket, role="executor", cluster_id="a", job_id=job, timeout=30) as client:
            fds = [os.memfd_create("fedpilot-flood", os.MFD_CLOEXEC) for _ in range(MAX_FDS_PER_READ + 2)]
            _send_with_fds(client.sock, frame(_update(job, body)), fds)
            for fd in fds:
                os.close(fd)
            reply, _ = client.recv()
            assert isinstance(reply, Error) and "flood" in reply.reason, reply
            assert client.sock.recv(1) == b""  # closed
    finally:
        consumer.close()
    # only the good update went out; the daemon serves on, and holds no descriptor
    assert bridge_status(a)["cluster_id"] == "a"
    assert [m.message_id for m, _, _ in consumer.got] == [good.message_id]
    wait_until(lambda: _memfds(a) == (0, 0), 10)
    wait_until(lambda: _memfds(b) == (0, 0), 10)


def test_concurrent_memfd_updates_all_arrive_and_release_everything(mesh) -> None:  # type: ignore[no-untyped-def]
    a, b = mesh.nodes["a"], mesh.nodes["b"]
    assert a.proc is not None and b.proc is not None
    result = blast(a, b, count=12, size=4 * MIB, sockets=4, fds=True)
    assert result.failed == [] and result.ok == 12, result.summary()
    assert result.delivered == 12 and result.digest_mismatch == 0, result.summary()
    for node in (a, b):
        wait_until(lambda node=node: _memfds(node) == (0, 0), 10)
