"""The executor's bridge link passes large bodies as sealed memfds both ways: a 2 MiB
update goes out as a descriptor the daemon can check and map, and a delivery that comes
as one is decoded straight from its read-only mapping, its descriptor closed."""

from __future__ import annotations

import hashlib
import mmap
import os
import socket
import tempfile
import threading

import blake3
import numpy as np
import pytest

from proto import bridge
from proto._bridge_fds import FdQueue, SpareMemfds
from worker import payload as wire
from worker.executor.bridge import BridgeLink


def test_large_bodies_cross_as_memfds_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    # this process's descriptors are counted: no spare memfd made for a next payload
    monkeypatch.setattr(bridge, "SEND_SPARES", SpareMemfds(0))
    weights = {"w": np.arange(512 * 1024, dtype=np.float32)}  # 2 MiB
    body = wire.encode(weights, kind="up", samples=3)
    seen: list[tuple[bool, int, float]] = []

    def on_delivery(msg: bridge.Delivery, payload: bridge.Payload) -> bool:
        decoded = wire.decode(payload, source="test")
        seen.append((isinstance(payload, mmap.mmap), decoded.samples, float(decoded.tensors["w"][-1])))
        return True

    got: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "b.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)

        def daemon() -> None:
            conn, _ = listener.accept()
            fds = FdQueue()
            with conn:
                hello, _ = bridge.recv_bridge(conn, 1 << 30)
                got["hello"] = hello
                delivery = bridge.Delivery(job_id="j", round=1, source_node="c1", target_node="s",
                                           message_id="m1", tensor_count=1, byte_length=len(body),
                                           sha256=hashlib.sha256(body).digest(), source_cluster="a")
                bridge.send_payload(conn, delivery, body)
                for _ in range(2):  # the DeliveryResult and the executor's SendUpdate, any order
                    msg, payload = bridge.recv_bridge(conn, 1 << 30, fds=fds)
                    if isinstance(msg, bridge.SendUpdate):
                        got["sent_as_fd"] = isinstance(payload, mmap.mmap)
                        got["sent_digest"] = (msg.blake3, msg.sha256) == (blake3.blake3(payload).digest(), b"")
                        bridge.send_bridge(conn, bridge.SendResult(message_id=msg.message_id,
                                                                   ok=True, reason="", bytes=len(payload)))
                    else:
                        got["answer"] = msg

        thread = threading.Thread(target=daemon, daemon=True)
        thread.start()
        before = len(os.listdir("/proc/self/fd"))
        link = BridgeLink(path, cluster_id="b", job_id="j", on_delivery=on_delivery,
                          on_control=lambda msg: (True, {}, ""))
        link.send_update(target_cluster="a", job_id="j", round=1, source_node="s",
                         target_node="c1", message_id="j/1/down/s/c1", payload=body)
        thread.join(10)
        link.close()
        listener.close()
        after = len(os.listdir("/proc/self/fd"))
    hello = got["hello"]
    assert isinstance(hello, bridge.Hello) and hello.accepts_fds and hello.answers_deliveries
    assert got["sent_as_fd"] is True and got["sent_digest"] is True
    answer = got["answer"]
    assert isinstance(answer, bridge.DeliveryResult) and answer.ok, answer
    assert seen == [(True, 3, float(512 * 1024 - 1))]
    assert after <= before  # the executor's memfd and the delivery's descriptor are closed

