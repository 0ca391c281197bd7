"""One valid instance of every daemon and bridge message, for round-trip tests."""

from __future__ import annotations

import hashlib
from typing import Any

from proto import bridge as b
from proto import messages as m

PEER = "12D3KooWEhZHdc82hu9e62Xuy8tMhEG8XHCiDaYrG7nGAdRrZYRw"
BODY = b"safetensors-bytes" * 10
DIGEST = hashlib.sha256(BODY).digest()
HEADER: dict[str, Any] = dict(job_id="job-1", round=3, source_node="client-1", target_node="client-7",
              message_id="job-1/3/client-1->client-7", tensor_count=4,
              byte_length=len(BODY), sha256=DIGEST)
NESTED = {"kind": "plan", "clients": [1, 2, 3], "weights": [0.5, -1.25], "blob": b"\x00\x01",
          "nested": {"deep": [None, True, {"x": "y"}]}, "big": 2**63}

MESSAGES: list[m.Message] = [
    m.MemberHello(certificate=b"c" * 200),
    m.MemberAck(accepted=False, reason="not a member: foreign CA", certificate=b""),
    m.ClusterRecord(cluster_id="lab-a", peer_id=PEER, addrs=("/ip4/127.0.0.1/tcp/4001",),
                    capacity=8, issued_at=1_700_000_000.5, certificate=b"c" * 100),
    m.Heartbeat(cluster_id="lab-a", peer_id=PEER, addrs=(), capacity=0, seq=2**64 - 1,
                sent_at=1.0),
    m.UpdateHeader(**HEADER),
    m.UpdateAck(message_id="m-1", status="duplicate", reason="", received_bytes=0),
    m.ControlRequest(request_id="r1", body=NESTED),
    m.ControlResponse(request_id="r1", ok=True, body={}, reason=""),
    m.SignedEnvelope(payload=b"routing", certificate=b"c" * 10, signature=b"s" * 64),
    m.DataPlaneOffer(certificate=b"c" * 300),
    m.DataPlaneOffer(certificate=b"c" * 300, port=40004, nonce=b"n" * 16),
    m.DataPlaneTicket(port=0, certificate=b"c" * 300, ticket=b"t" * 32, reason="", reverse=True),
    m.DataPlaneTicket(port=40001, certificate=b"c" * 300, ticket=b"t" * 32, reason=""),
    m.DataPlaneTicket(port=40002, certificate=b"c" * 300, ticket=b"t" * 32, reason="", via=PEER, splice=b"s" * 32),
    m.SpliceRequest(peer=PEER),
    m.DialBackRequest(port=4001),
    m.DialBackResult(reachable=False, address="198.51.100.7:4001", reason="ConnectionRefusedError"),
    m.SpliceGrant(port=40003, listen_token=b"l" * 32, dial_token=b"d" * 32, reason=""),
    m.SpliceGrant(port=0, listen_token=b"", dial_token=b"", reason="busy: retry later"),
]

BRIDGE: list[tuple[b.BridgeMessage, bytes]] = [
    (b.Hello(role="executor", cluster_id="lab-a", job_id="job-1", answers_deliveries=True), b""),
    (b.StatusRequest(), b""),
    (b.StatusReply(status={"cluster_id": "lab-a", "clusters": [{"connected": True}]}), b""),
    (b.ProbeRequest(cluster_id="lab-b", bytes=1 << 20), b""),
    (b.ProbeReply(cluster_id="lab-b", rtt_ms=0.4, bytes=10, seconds=0.1, throughput_mb_s=9.5,
                  path="dataplane_relayed"),
     b""),
    (b.SendUpdate(target_cluster="lab-b", **HEADER), BODY),
    (b.SendResult(message_id="m", ok=True, reason="", bytes=len(BODY)), b""),
    (b.SendResult(message_id="m", ok=False, reason="unavailable: x", bytes=0, retry=True), b""),
    (b.Delivery(source_cluster="lab-a", **HEADER), BODY),
    (b.DeliveryResult(message_id="m", source_cluster="lab-a", ok=False,
                      reason="round 9 is not accepted", retry=False), b""),
    (b.ControlSend(request_id="r", target_cluster="lab-b", body=NESTED), b""),
    (b.ControlDelivery(request_id="r", from_cluster="lab-a", from_peer=PEER,
                       from_role="scheduler", body={}), b""),
    (b.ControlReply(request_id="r", ok=False, body={}, reason="no such job"), b""),
    (b.ControlResult(request_id="r", ok=True, body={"a": 1}, reason=""), b""),
    (b.Error(reason="bad frame"), b""),
]
