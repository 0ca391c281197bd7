"""Strangers cannot stall, poison or reflect: pre-authentication limits on real daemons.

- Hundreds of stalled strangers (Noise-authenticated, never a valid MemberHello, streams
  held open) are disconnected after ``limits.auth_timeout``; meanwhile a new member
  still joins and a probe to it succeeds.
- Certificates that do not verify, naming a real cluster or random ones, never mark the
  real cluster "not a member" and fill only a bounded table.
- Heartbeats forged under stranger keys and forwarded by a member are refused: the
  daemon dials none of the addresses they name.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import time

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import PUBSUB_SIGNING_PREFIX

from fabricd._host import GOSSIPSUB_PROTOCOLS, open_host_stack
from fabricd._member_tables import MAX_UNVERIFIED_CLAIMS
from fabricd._preauth import MAX_PENDING_PEERS
from fabricd.discovery import _defers_to
from proto.codec import encode
from proto.ids import PROTOCOL_CONTROL, PROTOCOL_MEMBER, PROTOCOL_UPDATE, TOPIC_HEARTBEAT
from proto.messages import Heartbeat
from tests.fabricd._harness import (
    Node,
    bridge_status,
    configure,
    connected_fast,
    init_ca,
    join_and_probe,
    wait_until,
)
from tests.fabricd._hostile import certificate_for, hello, peer_info, raw_host, stalled_strangers

pytestmark = pytest.mark.slow

#: 300 is the issue's figure; lower it on a machine that cannot hold that many hosts.
STRANGERS = int(os.environ.get("FABRICD_TEST_STRANGERS", "300"))
#: limits.auth_timeout of the member the strangers stall
AUTH_TIMEOUT_S = 4


@pytest.mark.trio
async def test_stalled_strangers_are_dropped_and_a_new_member_still_joins(mesh) -> None:
    a = mesh.nodes["a"]
    t = mesh.add("t1", [a.addr()], start=False)
    # the strangers' deadline in seconds, not production's 10 (the same code path)
    configure(t, limits=f"auth_timeout = {AUTH_TIMEOUT_S}")
    await trio.to_thread.run_sync(lambda: (t.start(), t.wait_ready()))
    target = peer_info(t.addr())
    async with stalled_strangers(target, STRANGERS, [PROTOCOL_MEMBER, PROTOCOL_UPDATE, PROTOCOL_CONTROL]) \
            as (hosts, refused):
        # Connections t dropped while their connect was still finishing count as refused;
        # at least the pending bound's worth got through and stalled.
        assert len(hosts) >= MAX_PENDING_PEERS, (len(hosts), refused[:5])

        # While they hold their connections and streams, a new member joins t.
        n = await trio.to_thread.run_sync(lambda: mesh.add("n1", [t.addr()]))
        joined_and_probed, probe = await trio.to_thread.run_sync(lambda: join_and_probe(t, n))
        assert probe.returncode == 0, probe.stderr
        print(f"strangers_connected={len(hosts)} strangers_refused={len(refused)} "
              f"member_ready_to_joined_and_probed_s={joined_and_probed:.2f}")

        # Every stranger is disconnected by t (auth_timeout), none ever became a member.
        members = len(mesh.nodes)
        await trio.to_thread.run_sync(lambda: wait_until(
            lambda: bridge_status(t)["connections"] <= members, timeout=180, interval=0.5))

    status = await trio.to_thread.run_sync(lambda: bridge_status(t))
    # Most are dropped by the deadline or the pending bound; on a loaded machine libp2p
    # itself may close a few stalled connections first.
    assert status["preauth_dropped"] >= MAX_PENDING_PEERS // 2, status["preauth_dropped"]
    assert not {c["peer_id"] for c in status["clusters"]} & {str(h.get_id()) for h in hosts}
    log = t.log()
    assert re.search(r"event=member\.preauth_dropped .*reason=.*(did not complete the membership|oldest)", log)
    await trio.to_thread.run_sync(lambda: wait_until(lambda: {"a", "n1"} <= connected_fast(t), timeout=60))
    assert t.proc.poll() is None and n.proc.poll() is None
    assert (await trio.to_thread.run_sync(lambda: n.probe("t1", 65536, check=False))).returncode == 0
    await trio.to_thread.run_sync(_stop, mesh, [n, t])


@pytest.mark.trio
async def test_forged_certificates_cannot_mark_a_real_cluster_not_a_member(mesh) -> None:
    a = mesh.nodes["a"]
    target = peer_info(a.addr())
    foreign = await trio.to_thread.run_sync(lambda: init_ca(mesh.root, "forger-ca"))
    # One forger claims "late" (a real cluster that has not started yet), then many
    # claim random cluster ids.
    claims = ["late"] + [f"x{secrets.token_hex(4)}" for _ in range(MAX_UNVERIFIED_CLAIMS + 8)]
    refused: list[str] = []

    async def forge(claim: str, limiter: trio.CapacityLimiter) -> None:
        key_pair = create_new_key_pair()
        async with limiter, raw_host(key_pair) as host:
            await host.connect(target)
            ack = await hello(host, target.peer_id, certificate_for(key_pair, foreign, claim))
            if not ack.accepted:
                refused.append(claim)

    await forge("late", trio.CapacityLimiter(1))
    async with trio.open_nursery() as nursery:
        limiter = trio.CapacityLimiter(8)
        for claim in claims[1:]:
            nursery.start_soon(forge, claim, limiter)
    assert sorted(refused) == sorted(claims)
    late = await trio.to_thread.run_sync(lambda: mesh.add("late", [a.addr()]))
    await trio.to_thread.run_sync(lambda: wait_until(lambda: "late" in connected_fast(a), timeout=60))
    probe = await trio.to_thread.run_sync(lambda: a.probe("late", 4096, check=False))
    assert probe.returncode == 0, probe.stderr
    status = await trio.to_thread.run_sync(lambda: bridge_status(a))
    unverified = [r for r in status["refused"] if not r["verified"]]
    assert len(unverified) <= MAX_UNVERIFIED_CLAIMS
    assert not [r for r in status["refused"] if r["cluster_id"] == "late" and r["verified"]]
    assert re.search(r"event=member\.rejected .*claimed_cluster=late .*ForeignCertificate.*verified_claim=False",
                     a.log())
    assert late.proc.poll() is None
    await trio.to_thread.run_sync(_stop, mesh, [late])


def _stop(mesh, nodes: list[Node]) -> None:  # type: ignore[no-untyped-def]
    """Stops the daemons a test added (they would otherwise serve, gossip and take CPU
    until the session ends) and takes them out of the mesh."""
    for node in nodes:
        node.stop()
        mesh.nodes.pop(node.name)


def _dialled_at_once_by(own: str):  # type: ignore[no-untyped-def]
    """A stranger key pair whose peer id the member ``own`` would dial without waiting
    DIAL_DEFER for it to dial first (fabricd.discovery._defers_to), were its hint taken."""
    from libp2p.peer.id import ID

    while True:
        key_pair = create_new_key_pair()
        if not _defers_to(own, str(ID.from_pubkey(key_pair.public_key))):
            return key_pair


def _forged_heartbeat(key_pair, victim_port: int) -> rpc_pb2.Message:
    """A heartbeat signed (for gossip) by a stranger key, naming the victim's address."""
    from libp2p.peer.id import ID

    peer = ID.from_pubkey(key_pair.public_key)
    hb = Heartbeat(cluster_id=f"ghost{secrets.token_hex(3)}", peer_id=str(peer),
                   addrs=(f"/ip4/127.0.0.1/tcp/{victim_port}",), capacity=1, seq=1, sent_at=time.time())
    msg = rpc_pb2.Message(data=encode(hb), topicIDs=[TOPIC_HEARTBEAT], from_id=peer.to_bytes(),
                          seqno=secrets.token_bytes(8))
    msg.signature = key_pair.private_key.sign(PUBSUB_SIGNING_PREFIX.encode() + msg.SerializeToString())
    msg.key = key_pair.public_key.serialize()
    return msg


@pytest.mark.trio
async def test_forged_heartbeats_relayed_by_a_member_cause_no_dials(mesh) -> None:
    a = mesh.nodes["a"]
    target = peer_info(a.addr())
    own = str(target.peer_id)
    victim = socket.socket()
    victim.bind(("127.0.0.1", 0))
    victim.listen(512)
    victim.setblocking(False)
    victim_port = victim.getsockname()[1]
    before = (await trio.to_thread.run_sync(lambda: bridge_status(a)))["gossip"]["rejected_heartbeats"]

    key_pair = create_new_key_pair()
    cert = certificate_for(key_pair, mesh.ca, "liar")
    async with open_host_stack(key_pair, ["/ip4/127.0.0.1/tcp/0"], None, 1.0) as stack:
        await stack.host.connect(target)
        assert (await hello(stack.host, target.peer_id, cert)).accepted
        # The liar writes the forged messages on its own pubsub stream to a, as a hostile
        # forwarder would, and subscribes to nothing: a then sends it no heartbeats of its
        # own (py-libp2p 0.8.1 can raise "Nursery is closed to new arrivals" out of the
        # liar's host when one arrives while it shuts down: once in CI), and no mesh of the
        # liar's router decides whether they reach a.
        stream = await stack.host.new_stream(target.peer_id, list(GOSSIPSUB_PROTOCOLS))
        forged = 200
        for _ in range(forged // 10):
            rpc = rpc_pb2.RPC(publish=[_forged_heartbeat(_dialled_at_once_by(own), victim_port) for _ in range(10)])
            assert await stack.pubsub.write_msg(stream, rpc)
        # Wait until a has judged them: its counter rises by as many, or rises and then
        # stays put (gossipsub's peer scoring may mute the liar after a while, which is
        # fine too). Other members' rejected heartbeats count too: in the session mesh the
        # counter may never stay put. On a loaded machine the judgements can trickle in:
        # what matters is that some were judged (asserted below) and none led to a dial.
        last, stable_since = before, time.monotonic()
        with trio.move_on_after(120):
            while last - before < forged and (last == before or time.monotonic() - stable_since < 3):
                now = (await trio.to_thread.run_sync(lambda: bridge_status(a)))["gossip"]["rejected_heartbeats"]
                if now != last:
                    last, stable_since = now, time.monotonic()
                await trio.sleep(0.2)
        # The dial loop runs every 0.25 s, and dials these peers at once (not after
        # DIAL_DEFER: _dialled_at_once_by): 5 s are many rounds to (wrongly) use a hint.
        await trio.sleep(5)
    assert last > before, "the member never judged the forged heartbeats"
    dials = 0
    while True:
        try:
            conn, _ = victim.accept()
        except BlockingIOError:
            break
        conn.close()
        dials += 1
    victim.close()
    assert dials == 0, f"the daemon dialled the forged heartbeats' address {dials} times"
    status = await trio.to_thread.run_sync(lambda: bridge_status(a))
    assert status["gossip"]["dial_hints"] <= 256
    assert re.search(r"event=gossip\.rejected .*no valid member certificate", a.log())
    assert {"b", "c"} <= connected_fast(a)
