"""End-to-end delivery between real daemons: the sender hears ``ok`` only once the target
executor accepted the update; its refusal comes back as a rejection with its reason; an
update it refused is not remembered as delivered, so the same id gets through later."""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import pytest

from proto.bridge import BridgeClient, Delivery, DeliveryResult, SendResult, SendUpdate
from tests.fabricd._harness import bridge_status, connected_fast, wait_until

pytestmark = pytest.mark.slow

JOB = "j-ack"


def _client(node: Any, job_id: str, answers: bool = False) -> BridgeClient:
    return BridgeClient(node.bridge_socket, role="executor",
                        cluster_id=node.name, job_id=job_id, timeout=60,
                        answers_deliveries=answers)


def _update(mid: str, payload: bytes) -> SendUpdate:
    return SendUpdate(target_cluster="b", job_id=JOB, round=3, source_node="node-a1",
                      target_node="node-b7", message_id=mid, tensor_count=1,
                      byte_length=len(payload), sha256=hashlib.sha256(payload).digest())


class Executor:
    """Answers each Delivery with the next scripted (ok, reason, retry); records them."""

    def __init__(self, client: BridgeClient, *script: tuple[bool, str, bool]) -> None:
        self.client = client
        self.script = list(script)
        self.seen: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.script:
            msg, _ = self.client.recv()
            assert isinstance(msg, Delivery), msg
            self.seen.append(msg.message_id)
            ok, reason, retry = self.script.pop(0)
            self.client.send(DeliveryResult(message_id=msg.message_id, ok=ok, reason=reason,
                                            source_cluster=msg.source_cluster, retry=retry))


def test_the_sender_hears_the_executors_verdict(mesh) -> None:
    a, b = mesh.nodes["a"], mesh.nodes["b"]
    wait_until(lambda: "b" in connected_fast(a), timeout=30)
    payload = b"\x01" * 100_000
    with _client(b, JOB, answers=True) as client, _client(a, JOB) as sender:
        wait_until(lambda: any(c["job_id"] == JOB for c in bridge_status(b)["bridge_clients"]), 10)
        executor = Executor(client,
                            (False, "update for round 3; this cluster accepts rounds 5 and 6", False),
                            (False, "arrived before the job was planned", True),
                            (True, "", False),
                            (True, "", False))

        # A refusal reaches the sender as one, with the executor's reason; final.
        reply, _ = sender.request(_update("m-1", payload), payload)
        assert isinstance(reply, SendResult) and not reply.ok and not reply.retry, reply
        assert reply.reason.startswith("rejected: ")
        assert "refused it: update for round 3; this cluster accepts rounds 5 and 6" in reply.reason

        # Not remembered as delivered: the same id reaches the executor again; this time
        # it is not ready, which the sender hears as worth a retry.
        reply, _ = sender.request(_update("m-1", payload), payload)
        assert isinstance(reply, SendResult) and not reply.ok and reply.retry, reply
        assert "arrived before the job was planned" in reply.reason

        # The retry is accepted: ok, with its bytes.
        reply, _ = sender.request(_update("m-1", payload), payload)
        assert isinstance(reply, SendResult) and reply.ok and reply.reason == "", reply
        assert reply.bytes == len(payload)

        # Now it is delivered: another copy is a duplicate the executor never sees (the
        # next Delivery it gets is the next update's).
        reply, _ = sender.request(_update("m-1", payload), payload)
        assert isinstance(reply, SendResult) and reply.ok and "duplicate" in reply.reason
        reply, _ = sender.request(_update("m-2", payload), payload)
        assert isinstance(reply, SendResult) and reply.ok, reply
        executor.thread.join(10)
        assert executor.seen == ["m-1", "m-1", "m-1", "m-2"]

    jobs_a, jobs_b = bridge_status(a)["jobs"][JOB], bridge_status(b)["jobs"][JOB]
    assert jobs_a["sent_updates"] == 2 and jobs_b["received_updates"] == 2
    assert jobs_b["rejected"] == 2 and jobs_b["duplicates"] == 1


def test_an_update_in_flight_when_its_daemon_restarts_is_not_lost(mesh) -> None:
    """b's daemon is killed while its executor holds an update it has not answered, and
    restarted at once: the sender is not told ``ok`` (but that a retry may pass); after the
    restart the same message id reaches b's (new) executor once and is acknowledged."""
    a, b, c = mesh.nodes["a"], mesh.nodes["b"], mesh.nodes["c"]
    wait_until(lambda: "b" in connected_fast(a), timeout=30)
    job, payload = "j-restart", b"\x02" * 300_000
    update = SendUpdate(target_cluster="b", job_id=job, round=1, source_node="node-a1",
                        target_node="node-b7", message_id="m-r", tensor_count=1,
                        byte_length=len(payload), sha256=hashlib.sha256(payload).digest())
    held: list[Delivery] = []
    replies: list[Any] = []
    with _client(b, job, answers=True) as old, _client(a, job) as sender:
        wait_until(lambda: any(c["job_id"] == job for c in bridge_status(b)["bridge_clients"]), 10)
        holder = threading.Thread(target=lambda: held.append(old.recv()[0]), daemon=True)
        holder.start()
        send = threading.Thread(target=lambda: replies.append(sender.request(update, payload)[0]),
                                daemon=True)
        send.start()
        holder.join(30)
        assert held and isinstance(held[0], Delivery) and held[0].message_id == "m-r"
        b.kill9()  # the update is in flight: delivered to b's executor, not answered
        b.start()
        send.join(120)
        reply = replies[0]
        assert isinstance(reply, SendResult) and not reply.ok and reply.retry, reply
        b.wait_ready()
        wait_until(lambda: "b" in connected_fast(a) and "a" in connected_fast(b), timeout=60)

        with _client(b, job, answers=True) as new:
            wait_until(lambda: any(c["job_id"] == job
                                   for c in bridge_status(b)["bridge_clients"]), 10)
            executor = Executor(new, (True, "", False), (True, "", False))
            reply, _ = sender.request(update, payload)
            assert isinstance(reply, SendResult) and reply.ok and reply.reason == "", reply
            reply, _ = sender.request(update, payload)  # remembered by the restarted daemon
            assert isinstance(reply, SendResult) and reply.ok and "duplicate" in reply.reason
            reply, _ = sender.request(_next(update), payload)
            assert isinstance(reply, SendResult) and reply.ok, reply
            executor.thread.join(10)
            assert executor.seen == ["m-r", "m-s"]
    wait_until(lambda: "b" in connected_fast(c), timeout=60)


def _next(update: SendUpdate) -> SendUpdate:
    return SendUpdate(target_cluster=update.target_cluster, job_id=update.job_id,
                      round=update.round, source_node=update.source_node,
                      target_node=update.target_node, message_id="m-s",
                      tensor_count=update.tensor_count, byte_length=update.byte_length,
                      sha256=update.sha256)
