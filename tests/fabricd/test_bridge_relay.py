"""The bridge API the worker and scheduler build on: updates to executors, control relay, counters."""

from __future__ import annotations

import hashlib
import socket
import threading

import pytest

from proto.bridge import (
    BridgeClient,
    ControlDelivery,
    ControlReply,
    ControlResult,
    ControlSend,
    Delivery,
    SendResult,
    SendUpdate,
)
from tests.fabricd._harness import bridge_status, connected_fast, wait_until

pytestmark = pytest.mark.slow


def _client(node, role: str, job_id: str = "") -> BridgeClient:
    path = node.bridge_socket
    return BridgeClient(path, role=role, cluster_id=node.name, job_id=job_id, timeout=30)


def _update(target: str, job: str, mid: str, payload: bytes) -> SendUpdate:
    return SendUpdate(target_cluster=target, job_id=job, round=3, source_node="node-a1",
                      target_node="node-b7", message_id=mid, tensor_count=2,
                      byte_length=len(payload), sha256=hashlib.sha256(payload).digest())


def test_update_reaches_the_executor_once_and_counts_bytes(mesh) -> None:
    a, b = mesh.nodes["a"], mesh.nodes["b"]
    wait_until(lambda: "b" in connected_fast(a), timeout=30)
    payload = bytes(range(256)) * 4096  # 1 MiB
    with _client(b, "executor", "j1") as executor, _client(a, "executor", "j1") as sender:
        wait_until(lambda: any(c["role"] == "executor" for c in bridge_status(b)["bridge_clients"]), 10)
        received: list[tuple[object, bytes]] = []
        # The executor must read while the update is in flight (the daemon waits for it).
        reader = threading.Thread(target=lambda: received.append(executor.recv()), daemon=True)
        reader.start()
        reply, _ = sender.request(_update("b", "j1", "msg-1", payload), payload)
        assert isinstance(reply, SendResult) and reply.ok and reply.bytes == len(payload), reply
        reader.join(10)
        delivery, body = received[0]
        assert isinstance(delivery, Delivery)
        assert body == payload and delivery.source_cluster == "a"
        assert (delivery.job_id, delivery.round, delivery.target_node, delivery.message_id) == \
            ("j1", 3, "node-b7", "msg-1")

        # The same message id again: acknowledged as a duplicate, not delivered twice.
        reply, _ = sender.request(_update("b", "j1", "msg-1", payload), payload)
        assert isinstance(reply, SendResult) and reply.ok and "duplicate" in reply.reason
        executor.sock.settimeout(1.0)
        with pytest.raises(socket.timeout):
            executor.recv()

        # No executor for this job on b: a clear refusal, never a silent drop.
        reply, _ = sender.request(_update("b", "j-nobody", "msg-2", payload), payload)
        assert isinstance(reply, SendResult) and not reply.ok
        assert "no executor attached for job 'j-nobody' on cluster 'b'" in reply.reason

    jobs_a, jobs_b = bridge_status(a)["jobs"], bridge_status(b)["jobs"]
    assert jobs_a["j1"]["sent_bytes"] == len(payload) and jobs_a["j1"]["sent_updates"] == 1
    assert jobs_b["j1"]["received_bytes"] == len(payload) and jobs_b["j1"]["received_updates"] == 1
    assert jobs_b["j1"]["duplicates"] == 1
    assert jobs_b["j-nobody"]["rejected"] == 1


def test_control_request_is_relayed_to_the_remote_executor_and_back(mesh) -> None:
    a, b = mesh.nodes["a"], mesh.nodes["b"]
    a_peer = bridge_status(a)["peer_id"]
    seen: list[ControlDelivery] = []

    with _client(b, "executor", "j1") as executor:
        wait_until(lambda: any(c["job_id"] == "j1" for c in bridge_status(b)["bridge_clients"]), 10)

        def serve_one() -> None:
            msg, _ = executor.recv()
            assert isinstance(msg, ControlDelivery)
            seen.append(msg)
            executor.send(ControlReply(request_id=msg.request_id, ok=True,
                                       body={"pong": msg.body["n"] + 1}, reason=""))

        thread = threading.Thread(target=serve_one, daemon=True)
        thread.start()
        with _client(a, "scheduler") as sender:
            reply, _ = sender.request(ControlSend(request_id="req-1", target_cluster="b",
                                                  body={"job_id": "j1", "n": 41}))
            thread.join(10)
            assert isinstance(reply, ControlResult) and reply.ok, reply
            assert reply.body == {"pong": 42} and reply.request_id == "req-1"
            # Nobody attached for that job on b: refused with the reason.
            reply, _ = sender.request(ControlSend(request_id="req-2", target_cluster="b",
                                                  body={"job_id": "j-none"}))
            assert isinstance(reply, ControlResult) and not reply.ok
            assert "no executor attached for job 'j-none'" in reply.reason
    assert seen and (seen[0].from_cluster, seen[0].from_peer, seen[0].from_role) == ("a", a_peer, "cluster")
