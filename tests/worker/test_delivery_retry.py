"""End-to-end delivery on the executor side: a message id is applied once however often it
arrives, a send is retried under its id while the failure may pass, and only then."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from proto.errors import ProtocolError
from tests.e2e.test_engine import Links, build, graph_of, run_round
from worker.executor import transport as transport_module
from worker.executor.mailbox import Envelope, Mailbox
from worker.executor.transport import HybridTransport, RemoteSendError


def test_the_mailbox_applies_a_message_id_once() -> None:
    box = Mailbox()
    key = (1, "up", "c0", "server")
    assert box.put(key, Envelope({"w": 1}, 1, 4, remote=True), "b/j/1/up/c0/server")
    assert not box.put(key, Envelope({"w": 2}, 2, 4, remote=True), "b/j/1/up/c0/server")
    assert box.take(key, 1).samples == 1  # the first copy, not the second
    assert not box.put(key, Envelope({"w": 3}, 3, 4, remote=True), "b/j/1/up/c0/server")
    assert len(box) == 0
    # The round is repeated (a cluster was lost): its keys may arrive anew, under the new
    # attempt's ids, while a late copy of the first attempt's id is still a duplicate.
    box.reopen_round(1)
    assert not box.put(key, Envelope({"w": 4}, 4, 4, remote=True), "b/j/1/up/c0/server")
    assert box.put(key, Envelope({"w": 5}, 5, 4, remote=True), "b/j/1/up/c0/server~1")
    assert box.take(key, 1).samples == 5
    assert box.applied("b/j/1/up/c0/server") and box.applied("b/j/1/up/c0/server~1")
    # Rounds the transport no longer accepts are forgotten, ids included.
    box.forget_before(2, ("up",))
    assert not box.applied("b/j/1/up/c0/server")


def test_a_delivered_copy_is_a_duplicate_even_after_its_message_was_taken() -> None:
    graph, _ = graph_of("star", 2)
    engines, _ = build(graph, {"server": "a", "c0": "a", "c1": "b"})
    transport = engines["a"].transport
    body = transport_module.wire.encode({"w": np.ones((2, 2), np.float32)}, kind="up", samples=2)
    fields = dict(job_id="j", round=1, source_node="c1", target_node="server",
                  source_cluster="b", payload=body, message_id="j/1/up/c1/server")
    transport.begin_round(1)
    assert transport.deliver_remote(**fields)
    transport.receive(1, "up", "c1", "server", 1)
    assert not transport.deliver_remote(**fields)  # a retry after it was applied and used
    assert len(transport._mailbox) == 0


class FlakyLinks(Links):
    """Delivers every update, then loses the ack of its first attempt (the sender hears a
    transient failure), so every update reaches its executor twice under one id."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.applied = 0

    def send_update(self, *, target_cluster: str, job_id: str, round: int, source_node: str,
                    target_node: str, message_id: str, payload: bytes) -> None:
        first = message_id not in self.calls
        self.calls.append(message_id)
        source = next(c for c, t in self.transports.items() if t.is_local(source_node))
        self.applied += self.transports[target_cluster].deliver_remote(
            job_id=job_id, round=round, source_node=source_node, target_node=target_node,
            source_cluster=source, payload=payload, message_id=message_id)
        if first:
            raise RemoteSendError(f"update {message_id}: the ack was lost", retry=True)


def test_a_round_with_lost_acks_retries_and_applies_each_update_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport_module, "RETRY_FIRST", 0.001)
    graph, _ = graph_of("star", 4)
    placement = {"server": "a", "c0": "a", "c1": "a", "c2": "b", "c3": "b"}
    engines, _ = build(graph, placement)
    clean = run_round(engines, 1)["a"].accuracy
    engines, _ = build(graph, placement)
    flaky = FlakyLinks()
    for cluster, engine in engines.items():
        flaky.transports[cluster] = engine.transport
        engine.transport._link = flaky
    assert run_round(engines, 1)["a"].accuracy == pytest.approx(clean)
    # c2 and c3 send up to a, a sends down to both: four updates, each sent twice
    assert len(flaky.calls) == 8 and len(set(flaky.calls)) == 4 and flaky.applied == 4


class ScriptedLink:
    def __init__(self, *failures: RemoteSendError) -> None:
        self.failures = list(failures)
        self.ids: list[str] = []

    def send_update(self, **kw: Any) -> None:
        self.ids.append(kw["message_id"])
        if self.failures:
            raise self.failures.pop(0)


def _transport(link: ScriptedLink) -> HybridTransport:
    return HybridTransport(job_id="j", local_cluster="a", locate=lambda n: "b", mailbox=Mailbox(),
                           resolve=lambda h: h, codec=None, link=link)  # type: ignore[arg-type]


def test_a_send_is_retried_under_one_id_only_while_it_may_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport_module, "RETRY_FIRST", 0.001)
    transient = RemoteSendError("rejected: unavailable: no executor attached", retry=True)
    link = ScriptedLink(transient, transient)
    assert _transport(link).send_to("b", 3, "up", "c1", "server", b"x" * 10) == 10
    assert link.ids == ["j/3/up/c1/server"] * 3

    final = RemoteSendError("rejected: the executor on cluster 'b' refused it: round 3")
    link = ScriptedLink(final)
    with pytest.raises(RemoteSendError, match="refused it: round 3"):
        _transport(link).send_to("b", 3, "up", "c1", "server", b"x")
    assert len(link.ids) == 1

    # the round was aborted (another cluster is gone): no more attempts
    link = ScriptedLink(transient, transient)
    sender = _transport(link)
    sender.abort_round(3, "cluster c is gone")
    with pytest.raises(RemoteSendError, match="not sent: cluster c is gone"):
        sender.send_to("b", 3, "up", "c1", "server", b"x")
    assert link.ids == []

    # the target cluster keeps saying it has no executor for the job (its daemon restarted
    # without it): given up after the grace, naming that; other transient failures in
    # between start the grace again
    monkeypatch.setattr(transport_module, "ABSENT_GRACE_SECONDS", 0.05)
    busy = RemoteSendError("rejected: busy: 2 GiB in flight", retry=True)
    link = ScriptedLink(transient, busy, *[transient] * 1000)
    with pytest.raises(RemoteSendError, match="has had no executor for job 'j' for 0 s: its "
                                              "daemon restarted without it, or it exited"):
        _transport(link).send_to("b", 3, "up", "c1", "server", b"x")
    assert 3 <= len(link.ids) < 1000 and link.failures

    # past the round's deadline: the last reason, and that it was retried
    link = ScriptedLink(transient, transient)
    sender = _transport(link)
    sender.retry_seconds = 0.0
    with pytest.raises(RemoteSendError, match="no executor attached.*deadline of 0 s passed"):
        sender.send_to("b", 3, "up", "c1", "server", b"x")
    assert len(link.ids) == 1


def test_an_abort_ends_a_sends_backoff_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lost cluster's round is aborted on the survivors while their sends to it back off;
    the scheduler re-plans once those rounds stopped, so the wait must not be slept out."""
    import threading

    monkeypatch.setattr(transport_module, "RETRY_FIRST", 60.0)  # a backoff of 30-90 s
    monkeypatch.setattr(transport_module, "RETRY_MAX", 60.0)
    transient = RemoteSendError("cannot reach cluster 'b'", retry=True)
    link = ScriptedLink(transient)
    sender = _transport(link)
    failed: list[BaseException] = []

    def send() -> None:
        try:
            sender.send_to("b", 3, "up", "c1", "server", b"x")
        except RemoteSendError as exc:
            failed.append(exc)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    while not link.ids:  # the first attempt failed: the sender backs off now
        thread.join(0.01)
    sender.abort_round(3, "round 3 is repeated without cluster(s) b")
    thread.join(60)
    assert not thread.is_alive(), "the send slept out its backoff after the round's abort"
    assert len(link.ids) == 1 and len(failed) == 1
    assert "gave up after 1 attempts" in str(failed[0]) and "without cluster(s) b" in str(failed[0])
    # another round's abort does not end the wait
    box = Mailbox()
    box.abort_round(4, "gone")
    assert box.wait_aborted(3, 0.01) is None and box.wait_aborted(4, 0) == "gone"


def test_the_executor_answers_each_delivery_and_hears_whether_a_retry_may_pass() -> None:
    """BridgeLink against a stand-in daemon on a real Unix socket."""
    import hashlib
    import os
    import socket
    import tempfile
    import threading

    from proto import bridge
    from worker.executor.bridge import BridgeLink
    from worker.executor.transport import DeliveryNotReady, DeliveryRefused

    outcomes: list[Any] = [True, False, DeliveryRefused("round 9 is not accepted"),
                           DeliveryNotReady("arrived before the job was planned")]

    def on_delivery(msg: bridge.Delivery, payload: bytes) -> bool:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return bool(outcome)

    body = b"body"
    header = dict(job_id="j", round=1, source_node="c1", target_node="server",
                  tensor_count=1, byte_length=len(body), sha256=hashlib.sha256(body).digest())
    answers: list[bridge.BridgeMessage] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "b.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)

        def daemon() -> None:
            conn, _ = listener.accept()
            with conn:
                hello, _ = bridge.recv_bridge(conn, 1 << 20)
                answers.append(hello)
                for i in range(4):
                    bridge.send_bridge(conn, bridge.Delivery(
                        message_id=f"m{i}", source_cluster="a", **header), body)
                sends = []
                for _ in range(5):  # four answers and the executor's own send, any order
                    msg, _ = bridge.recv_bridge(conn, 1 << 20)
                    (sends if isinstance(msg, bridge.SendUpdate) else answers).append(msg)
                (send,) = sends
                bridge.send_bridge(conn, bridge.SendResult(
                    message_id=send.message_id, ok=False, bytes=0, retry=True,
                    reason="rejected: unavailable: no executor attached for job 'j'"))

        thread = threading.Thread(target=daemon, daemon=True)
        thread.start()
        link = BridgeLink(path, cluster_id="b", job_id="j", on_delivery=on_delivery,
                          on_control=lambda msg: (True, {}, ""))
        payload = transport_module.wire.encode({"w": np.ones(2, np.float32)}, kind="up", samples=1)
        with pytest.raises(RemoteSendError, match="no executor attached") as failed:
            link.send_update(target_cluster="a", job_id="j", round=1, source_node="s",
                             target_node="c1", message_id="j/1/down/s/c1", payload=payload)
        thread.join(10)
        link.close()
        listener.close()
    assert failed.value.retry
    hello, *results = answers
    assert isinstance(hello, bridge.Hello) and hello.answers_deliveries
    assert [(r.message_id, r.ok, r.retry) for r in results] == [  # type: ignore[attr-defined]
        ("m0", True, False), ("m1", True, False), ("m2", False, False), ("m3", False, True)]
    assert [r.reason for r in results] == [  # type: ignore[attr-defined]
        "", "duplicate", "DeliveryRefused: round 9 is not accepted",
        "arrived before the job was planned"]


def test_an_abort_abandons_a_send_the_daemon_has_not_answered() -> None:
    """In containers a dial to a killed cluster's address gets no answer at all (no reset):
    the daemon sat 280 s in such dials with a survivor's update to the lost cluster, and
    the survivor's round, aborted, waited for it. The abort abandons the wait at once, and a
    send of the aborted round begun after it is not made."""
    import os
    import socket
    import tempfile
    import threading

    from proto import bridge
    from worker.executor.bridge import BridgeLink

    got: list[bridge.BridgeMessage] = []
    arrived = threading.Event()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "b.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)

        def daemon() -> None:  # reads every frame, answers none
            conn, _ = listener.accept()
            with conn:
                while True:
                    try:
                        msg, _ = bridge.recv_bridge(conn, 1 << 20)
                    except (OSError, ProtocolError):
                        return
                    got.append(msg)
                    if isinstance(msg, bridge.SendUpdate):
                        arrived.set()

        stand_in = threading.Thread(target=daemon, daemon=True)
        stand_in.start()
        link = BridgeLink(path, cluster_id="a", job_id="j", on_delivery=lambda m, p: True,
                          on_control=lambda msg: (True, {}, ""))
        sender = HybridTransport(job_id="j", local_cluster="a", locate=lambda n: "b",
                                 mailbox=Mailbox(), resolve=lambda h: h, codec=None,  # type: ignore[arg-type]
                                 link=link)
        failed: list[BaseException] = []
        body = transport_module.wire.encode({"w": np.ones(2, np.float32)}, kind="peer",
                                            samples=1)

        def send() -> None:
            try:
                sender.send_to("b", 3, "peer", "g:a", "g:b", body)
            except Exception as exc:  # noqa: BLE001 - asserted below
                failed.append(exc)
                arrived.set()

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        assert arrived.wait(60)
        sender.abort_round(3, "round 3 is repeated without cluster(s) b")
        thread.join(60)
        alive = thread.is_alive()
        with pytest.raises(RemoteSendError, match="not sent: round 3 is repeated"):
            sender.send_to("b", 3, "up", "c1", "g:b", body)
        link.close()
        stand_in.join(10)
        listener.close()
    assert not alive, "the aborted round still waited for the daemon's answer"
    assert len(failed) == 1 and isinstance(failed[0], RemoteSendError) and not failed[0].retry
    assert "j/3/peer/g:a/g:b was abandoned: round 3 is repeated" in str(failed[0])
    assert [m.message_id for m in got if isinstance(m, bridge.SendUpdate)] == ["j/3/peer/g:a/g:b"]
