"""Must-show 4: bad input to every protocol and to the bridge is rejected, logged, and survived.

A raw libp2p peer (in this test process) with a valid certificate joins the mesh, then
sends malformed frames, a wrong schema version, an oversized header and a wrong digest
on /fedpilot/update, /fedpilot/control and /fedpilot/member; a raw Unix-socket client
does the same on the bridge. After each batch the daemon must still serve.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import struct
import time

import msgpack
import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr

from fabricd._host import build_host
from fabricd._streams import read_message_exact
from proto.bridge import (
    Error,
    Hello,
    SendResult,
    SendUpdate,
    bridge_header,
    recv_bridge,
    send_bridge,
)
from proto.certs import issue_certificate, load_ca_private
from proto.codec import frame
from proto.ids import PROTOCOL_CONTROL, PROTOCOL_MEMBER, PROTOCOL_UPDATE
from proto.messages import ControlResponse, MemberAck, MemberHello, UpdateAck, UpdateHeader
from tests.fabricd._harness import bridge_status, wait_until

pytestmark = pytest.mark.slow


def _prefixed(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


GARBAGE = _prefixed(b"\xc1\xc1 this is not msgpack")
OVERSIZED = struct.pack(">I", 200 * 1024 * 1024)  # a length prefix far over any limit


def _wrong_version(msg_type: str, **fields: object) -> bytes:
    return _prefixed(msgpack.packb({"v": 99, "type": msg_type, **fields}, use_bin_type=True))


def _header(body: bytes, *, sha: bytes | None = None, job: str = "_probe", mid: str = "m1") -> UpdateHeader:
    return UpdateHeader(job_id=job, round=0, source_node="raw", target_node="a", message_id=mid,
                        tensor_count=0, byte_length=len(body), sha256=sha or hashlib.sha256(body).digest())


async def _exchange(host, peer: ID, proto: str, payload: bytes, read_reply: bool = True):
    stream = await host.new_stream(peer, [proto])
    await stream.write(payload)
    if not read_reply:
        await stream.close()
        return None
    with trio.fail_after(15):
        reply = await read_message_exact(stream, 1 << 20)
    await stream.close()
    return reply


@pytest.mark.trio
async def test_bad_frames_on_every_protocol_are_rejected_and_survived(mesh) -> None:
    a = mesh.nodes["a"]
    a_info = info_from_p2p_addr(multiaddr.Multiaddr(a.addr()))
    key_pair = create_new_key_pair()
    cert = issue_certificate(load_ca_private(mesh.ca), key_pair.public_key.to_bytes(), "raw",
                             not_before=int(time.time()) - 60)
    host = build_host(key_pair)
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        await host.connect(a_info)
        ack = await _exchange(host, a_info.peer_id, PROTOCOL_MEMBER, frame(MemberHello(certificate=cert)))
        assert isinstance(ack, MemberAck) and ack.accepted, ack

        # /fedpilot/update: each case gets a rejected UpdateAck with a reason.
        body = b"x" * 1000
        cases = {
            "malformed": GARBAGE,
            "wrong version": _wrong_version("UpdateHeader", job_id="j"),
            "oversized header": OVERSIZED,
            "wrong digest": frame(_header(body, sha=b"\0" * 32)) + body,
        }
        for name, payload in cases.items():
            reply = await _exchange(host, a_info.peer_id, PROTOCOL_UPDATE, payload)
            assert isinstance(reply, UpdateAck) and reply.status == "rejected", (name, reply)
            assert reply.reason, name
        assert "DigestMismatch" in reply.reason

        # /fedpilot/control: rejected ControlResponse with a reason.
        cases = {
            "malformed": GARBAGE,
            "wrong version": _wrong_version("ControlRequest", request_id="r", body={}),
            "oversized header": OVERSIZED,
            "wrong type": frame(_header(b"")),
        }
        for name, payload in cases.items():
            reply = await _exchange(host, a_info.peer_id, PROTOCOL_CONTROL, payload)
            assert isinstance(reply, ControlResponse) and not reply.ok and reply.reason, (name, reply)

        # /fedpilot/member: a refusal with a reason; a tampered certificate is "not a member".
        tampered = bytearray(cert)
        tampered[-5] ^= 0xFF
        cases = {
            "malformed": GARBAGE,
            "wrong version": _wrong_version("MemberHello", certificate=cert),
            "oversized header": OVERSIZED,
            "wrong digest (tampered certificate)": frame(MemberHello(certificate=bytes(tampered))),
        }
        for name, payload in cases.items():
            reply = await _exchange(host, a_info.peer_id, PROTOCOL_MEMBER, payload)
            assert isinstance(reply, MemberAck) and not reply.accepted and reply.reason, (name, reply)
        assert "not a member" in reply.reason

    log = a.log()
    assert len(re.findall(r"event=update\.rejected", log)) >= 4
    assert re.search(r"event=update\.rejected .*reason=.*(UnsupportedVersion|version)", log)
    assert re.search(r"event=update\.rejected .*reason=.*MessageTooLarge", log)
    assert re.search(r"event=update\.rejected .*reason=.*DigestMismatch", log)
    assert len(re.findall(r"event=control\.rejected", log)) >= 4
    assert len(re.findall(r"event=member\.bad_frame", log)) >= 3
    assert re.search(r"event=member\.rejected .*claimed_cluster=raw", log)
    # Still serving: a fresh probe succeeds and status answers.
    out = json.loads(a.probe("b", 1024 * 1024).stdout)
    assert out["bytes"] == 1024 * 1024
    assert a.proc.poll() is None


def _raw_bridge(node) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(15)
    sock.connect(node.bridge_socket)
    return sock


def test_bad_frames_on_the_bridge_are_rejected_and_survived(mesh) -> None:
    a = mesh.nodes["a"]
    before = bridge_status(a)["bridge_rejected_frames"]
    hello = Hello(role="executor", cluster_id="a", job_id="j-bad")
    wrong_version = msgpack.packb({"v": 99, "type": "StatusRequest", "payload_length": 0})
    for name, raw in {
        "malformed": _prefixed(b"\xc1 not msgpack"),
        "wrong version": _prefixed(wrong_version),
        "oversized header": OVERSIZED,
    }.items():
        with _raw_bridge(a) as sock:
            send_bridge(sock, hello)
            sock.sendall(raw)
            reply, _ = recv_bridge(sock, 1 << 20)
            assert isinstance(reply, Error) and reply.reason, (name, reply)
            assert sock.recv(1) == b"", f"{name}: the daemon should close a connection whose framing is lost"
    # A first frame that is not Hello.
    with _raw_bridge(a) as sock:
        sock.sendall(bridge_header(SendResult(message_id="m", ok=True, reason="", bytes=0), 0))
        reply, _ = recv_bridge(sock, 1 << 20)
        assert isinstance(reply, Error) and "Hello" in reply.reason
    # Wrong digest: the payload does not match the header's sha256 -> refused, nothing sent.
    payload = b"y" * 4096
    bad = SendUpdate(target_cluster="b", job_id="j-bad", round=1, source_node="n1", target_node="n2",
                     message_id="bad-digest", tensor_count=1, byte_length=len(payload),
                     sha256=hashlib.sha256(b"other").digest())
    with _raw_bridge(a) as sock:
        send_bridge(sock, hello)
        send_bridge(sock, bad, payload)
        reply, _ = recv_bridge(sock, 1 << 20)
        assert isinstance(reply, SendResult) and not reply.ok and "sha256" in reply.reason
    log = a.log()
    assert re.search(r"event=bridge\.rejected .*MalformedFrame|event=bridge\.rejected .*msgpack", log)
    assert re.search(r"event=bridge\.rejected .*UnsupportedVersion", log)
    assert re.search(r"event=bridge\.rejected .*MessageTooLarge", log)
    assert re.search(r"event=bridge\.rejected .*sha256", log)
    assert bridge_status(a)["bridge_rejected_frames"] >= before + 4
    wait_until(lambda: {"b", "c"} <= {c["cluster_id"] for c in bridge_status(a)["clusters"] if c["connected"]},
               timeout=10)
    assert json.loads(a.probe("c", 65536).stdout)["bytes"] == 65536
