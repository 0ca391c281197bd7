"""Many concurrent updates through two daemons' bridges, each body distinct and verified.

``blast(sender, receiver, count, size)`` attaches an executor for a fresh job on the
receiver, opens ``sockets`` bridge connections on the sender and writes every SendUpdate
back to back (all outstanding at once: the daemon serves them concurrently), then waits
for every SendResult and every Delivery. Each body is a shared random block with its
index in the first 16 bytes, so every update has its own sha256, which the receiving side
recomputes from the delivered bytes. Peak RSS of both daemons and bridge status latency
are sampled while it runs (used by bench/bench_transfer.py; tests check only correctness).
"""

from __future__ import annotations

import hashlib
import itertools
import mmap
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proto.bridge import BridgeClient, Delivery, SendResult, SendUpdate, bridge_header, recv_bridge
from tests.fabricd._harness import Node, bridge_status, wait_until

PREFIX = 16


@dataclass
class BlastResult:
    count: int
    size: int
    job: str = ""
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    delivered: int = 0
    digest_mismatch: int = 0
    seconds: float = 0.0
    peak_rss_sender: int = 0
    peak_rss_receiver: int = 0
    status_ms: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.status_ms)
        return {
            "count": self.count, "bytes_each": self.size, "ok": self.ok,
            "failed": len(self.failed), "first_failures": self.failed[:3],
            "delivered": self.delivered, "digest_mismatch": self.digest_mismatch,
            "seconds": round(self.seconds, 3),
            "mb_s": round(self.count * self.size / self.seconds / 1e6, 1) if self.seconds else 0.0,
            "peak_rss_mb_sender": round(self.peak_rss_sender / 1e6, 1),
            "peak_rss_mb_receiver": round(self.peak_rss_receiver / 1e6, 1),
            "status_ms_median": round(lat[len(lat) // 2], 1) if lat else None,
            "status_ms_max": round(lat[-1], 1) if lat else None,
            "status_samples": len(lat),
        }


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _body_prefix(index: int) -> bytes:
    return index.to_bytes(PREFIX, "big")


def blast(sender: Node, receiver: Node, count: int, size: int, *, sockets: int = 4,
          timeout: float = 600.0, sample_status: bool = False,
          hold_first_until: Callable[[], bool] | None = None, fds: bool = False) -> BlastResult:
    """Send ``count`` updates of ``size`` bytes from ``sender``'s executors to one on
    ``receiver``. ``hold_first_until``: the receiving executor reads nothing until it is
    true (or 30 s passed), so the receiver holds its first update meanwhile. ``fds``: both
    executors pass bodies as sealed memfds (proto.bridge), not as bytes."""
    assert size >= PREFIX
    job = f"blast-{uuid.uuid4().hex[:8]}"
    base = os.urandom(size)
    rest = memoryview(base)[PREFIX:]
    expected: dict[str, bytes] = {}
    result = BlastResult(count, size, job)
    lock = threading.Lock()
    done = threading.Event()
    stop = threading.Event()

    def mid(i: int) -> str:
        return f"{job}-{i}"

    def digest(i: int) -> bytes:
        h = hashlib.sha256(_body_prefix(i))
        h.update(rest)
        return h.digest()

    for i in range(count):
        expected[mid(i)] = digest(i)

    consumer = BridgeClient(receiver.bridge_socket, role="executor", cluster_id=receiver.name,
                            job_id=job, max_payload=size + 1, timeout=timeout, accepts_fds=fds)
    wait_until(lambda: any(c["job_id"] == job for c in bridge_status(receiver)["bridge_clients"]), 30)

    def consume() -> None:
        if hold_first_until is not None:
            held_until = time.monotonic() + 30
            while not hold_first_until() and time.monotonic() < held_until:
                time.sleep(0.05)
        try:
            while result.delivered < count:
                msg, body = consumer.recv()
                if not isinstance(msg, Delivery):
                    continue
                good = hashlib.sha256(body).digest() == expected.get(msg.message_id)
                if isinstance(body, mmap.mmap):
                    body.close()
                with lock:
                    result.delivered += 1
                    result.digest_mismatch += 0 if good else 1
        except OSError:
            pass

    clients = [BridgeClient(sender.bridge_socket, role="executor", cluster_id=sender.name, job_id=job,
                            timeout=timeout) for _ in range(sockets)]
    shares = [list(range(k, count, sockets)) for k in range(sockets)]

    def write(client: BridgeClient, share: list[int]) -> None:
        for i in share:
            msg = SendUpdate(target_cluster=receiver.name, job_id=job, round=1, source_node="s",
                             target_node="t", message_id=mid(i), tensor_count=1, byte_length=size,
                             sha256=expected[mid(i)])
            if fds:
                client.send_update(msg, _body_prefix(i) + rest)
                continue
            client.sock.sendall(bridge_header(msg, size))
            client.sock.sendall(_body_prefix(i))
            client.sock.sendall(rest)

    def read(client: BridgeClient, n: int) -> None:
        for _ in range(n):
            msg, _ = recv_bridge(client.sock, 0)
            if isinstance(msg, SendResult):
                with lock:
                    if msg.ok:
                        result.ok += 1
                    else:
                        result.failed.append(msg.reason)
        with lock:
            if result.ok + len(result.failed) >= count:
                done.set()

    def sample() -> None:
        assert sender.proc is not None and receiver.proc is not None
        # RSS every 20 ms, status every 0.2 s: the sender's event loop serves each status,
        # and 50 a second take CPU from the transfer they measure on a loaded machine
        for tick in itertools.count():
            if stop.is_set():
                break
            result.peak_rss_sender = max(result.peak_rss_sender, rss_bytes(sender.proc.pid))
            result.peak_rss_receiver = max(result.peak_rss_receiver, rss_bytes(receiver.proc.pid))
            if sample_status and tick % 10 == 0:
                t0 = time.perf_counter()
                bridge_status(sender)
                result.status_ms.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.02)

    threads = [threading.Thread(target=consume, daemon=True),
               threading.Thread(target=sample, daemon=True)]
    threads += [threading.Thread(target=read, args=(c, len(s)), daemon=True) for c, s in zip(clients, shares, strict=True)]
    start = time.perf_counter()
    threads += [threading.Thread(target=write, args=(c, s), daemon=True) for c, s in zip(clients, shares, strict=True)]
    for t in threads:
        t.start()
    try:
        done.wait(timeout)
        deadline = time.monotonic() + 60
        while result.delivered < result.ok and time.monotonic() < deadline:
            time.sleep(0.01)
        result.seconds = time.perf_counter() - start
    finally:
        stop.set()
        for c in clients:
            c.close()
        consumer.close()
    return result
