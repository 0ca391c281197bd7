"""Signed control envelopes on a real daemon: replay, re-targeting, a foreign scheduler
steering another's job, and a member reusing the scheduler's request id are refused with
a logged reason, while the genuine scheduler's traffic still flows."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from libp2p.abc import IHost
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from fabricd._streams import read_message_exact
from fabricd.identity import raw_private_key
from fabricd.signing import seal
from proto.bridge import BridgeClient, ControlDelivery, ControlReply
from proto.codec import frame
from proto.ids import PROTOCOL_CONTROL
from proto.messages import ControlRequest, ControlResponse
from tests.fabricd._harness import bridge_status, wait_until
from tests.fabricd._hostile import certificate_for, hello, peer_info, raw_host

pytestmark = pytest.mark.slow

JOB = "j-owned"


class Party:
    """An in-process peer holding a valid certificate of some role."""

    def __init__(self, ca_dir: Any, cluster: str, role: str) -> None:
        self.key_pair = create_new_key_pair()
        self.cert = certificate_for(self.key_pair, ca_dir, cluster, role)
        self.signing_key = Ed25519PrivateKey.from_private_bytes(raw_private_key(self.key_pair))
        self.host: IHost | None = None

    def seal(self, body: dict[str, Any], audience: str = "b", **kw: Any) -> dict[str, Any]:
        return seal(body, self.cert, self.signing_key, audience=audience, **kw)

    async def send(self, peer: ID, request_id: str, sealed: dict[str, Any]) -> ControlResponse:
        assert self.host is not None
        stream = await self.host.new_stream(peer, [PROTOCOL_CONTROL])  # type: ignore[list-item]
        await stream.write(frame(ControlRequest(request_id=request_id, body=sealed)))
        with trio.fail_after(60):
            reply = await read_message_exact(stream, 1 << 20)
        await stream.close()
        assert isinstance(reply, ControlResponse), reply
        return reply


def _fake_executor(node: Any, stop: threading.Event) -> BridgeClient:
    """A bridge client for every job that answers each control request after 1 s, echoing it."""
    client = BridgeClient(node.bridge_socket, role="executor",
                          cluster_id=node.name, job_id="*", timeout=0.5)
    lock = threading.Lock()

    def answer(msg: ControlDelivery) -> None:
        time.sleep(1.0)  # so that concurrent requests overlap at the daemon
        with lock:
            client.send(ControlReply(request_id=msg.request_id, ok=True,
                                     body={"kind": msg.body.get("kind"), "from": msg.from_peer}, reason=""))

    def serve() -> None:
        while not stop.is_set():
            try:
                msg, _ = client.recv()
            except (TimeoutError, OSError):
                continue
            if isinstance(msg, ControlDelivery):
                threading.Thread(target=answer, args=(msg,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return client


@pytest.mark.trio
async def test_replayed_retargeted_and_foreign_scheduler_envelopes_are_refused(mesh) -> None:
    b = mesh.nodes["b"]
    target = peer_info(b.addr())
    owner = Party(mesh.ca, "sched-1", "scheduler")
    foreign = Party(mesh.ca, "sched-2", "scheduler")
    member = Party(mesh.ca, "member-m", "cluster")
    stop = threading.Event()
    executor = _fake_executor(b, stop)
    try:
        await trio.to_thread.run_sync(lambda: wait_until(
            lambda: any(c["job_id"] == "*" for c in bridge_status(b)["bridge_clients"]), 10))
        async with raw_host(owner.key_pair) as h1, raw_host(foreign.key_pair) as h2, \
                raw_host(member.key_pair) as h3:
            for party, host in ((owner, h1), (foreign, h2), (member, h3)):
                party.host = host
                await host.connect(target)
                assert (await hello(host, target.peer_id, party.cert)).accepted
            peer = target.peer_id

            start = owner.seal({"kind": "job.start", "job_id": JOB})
            reply = await owner.send(peer, "s1", start)
            assert reply.ok and reply.body["kind"] == "job.start", reply

            refusals = {
                "replayed": await owner.send(peer, "s1", start),
                "re-targeted": await owner.send(peer, "s9", owner.seal({"kind": "job.stop", "job_id": JOB},
                                                                        audience="c")),
                "expired": await owner.send(peer, "s9", owner.seal({"kind": "job.stop", "job_id": JOB},
                                                                    now=time.time() - 600)),
                "owned by": await foreign.send(peer, "s2", foreign.seal({"kind": "job.stop", "job_id": JOB})),
                "is owned by": await foreign.send(peer, "s2", foreign.seal({"kind": "job.start", "job_id": JOB})),
            }
            for expected, resp in refusals.items():
                assert not resp.ok and expected in resp.reason, (expected, resp)

            # A member reuses the scheduler's next request id while that request is in
            # flight: each gets its own reply.
            results: dict[str, ControlResponse] = {}

            async def ask(name: str, party: Party, body: dict[str, Any]) -> None:
                results[name] = await party.send(peer, "s2", party.seal(body))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask, "owner", owner, {"kind": "round.run", "job_id": JOB, "round": 1})
                await trio.sleep(0.2)
                nursery.start_soon(ask, "member", member, {"kind": "hello", "job_id": JOB})
            assert results["owner"].ok and results["owner"].body == {"kind": "round.run", "from": str(h1.get_id())}
            assert results["member"].ok and results["member"].body == {"kind": "hello", "from": str(h3.get_id())}

            reply = await owner.send(peer, "s3", owner.seal({"kind": "job.stop", "job_id": JOB}))
            assert reply.ok and reply.body["kind"] == "job.stop", reply
    finally:
        stop.set()
        executor.close()
    log = b.log()
    for reason in ("replayed control envelope", "re-targeted", "expired", "is owned by scheduler peer"):
        assert re.search(rf"event=control\.rejected .*{reason}", log), reason
