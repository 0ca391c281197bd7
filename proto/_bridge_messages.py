"""Bridge message types (re-exported by proto.bridge; see its docstring for framing)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from proto._schema import I64_MAX, Bool, Data, Float, Int, Schema, Text, spec
from proto.messages import (
    BYTE_LENGTH,
    CLUSTER_ID,
    DIGEST,
    JOB_ID,
    MESSAGE_ID,
    NODE_ID,
    REASON,
    REQUEST_ID,
    ROUND,
    TENSOR_COUNT,
    UPDATE_HEADER_FIELDS,
    UpdateHeader,
    check_digest_claim,
)

OPTIONAL_CLUSTER_ID = Text(64, 0, pattern=r"[A-Za-z0-9][A-Za-z0-9_.-]*")
ROLE = Text(32, 1, pattern=r"[A-Za-z0-9_.-]+")


class BridgeMessage(Schema):
    """Base of every bridge message (its own registry, separate from daemon messages)."""

    REGISTRY: ClassVar[dict[str, type[Schema]]] = {}
    CARRIES_PAYLOAD: ClassVar[bool] = False


@dataclass(frozen=True)
class Hello(BridgeMessage):
    """First frame from a bridge client: who it is (role e.g. "executor", "cli").

    ``answers_deliveries``: the client answers every Delivery with a DeliveryResult, and
    the daemon acknowledges an update to its sender only after that answer (accepted); a
    client without it is acknowledged as soon as the Delivery is written to it.
    ``accepts_fds``: the client reads large Delivery payloads from a sealed memfd passed
    with the frame (proto.bridge); a client without it gets every payload as bytes.
    """

    TYPE: ClassVar[str] = "Hello"
    role: str = spec(ROLE)
    cluster_id: str = spec(OPTIONAL_CLUSTER_ID, default="")
    job_id: str = spec(Text(128), default="")
    answers_deliveries: bool = spec(Bool(), default=False)
    #: Deliveries of at least FD_MIN_BYTES may come as a memfd (SCM_RIGHTS), not as bytes
    accepts_fds: bool = spec(Bool(), default=False)


@dataclass(frozen=True)
class StatusRequest(BridgeMessage):
    TYPE: ClassVar[str] = "StatusRequest"


@dataclass(frozen=True)
class StatusReply(BridgeMessage):
    """The daemon's status: cluster_id, peer_id, listen_addrs, clusters[...] (plain data)."""

    TYPE: ClassVar[str] = "StatusReply"
    status: dict[str, Any] = spec(Data())


@dataclass(frozen=True)
class ProbeRequest(BridgeMessage):
    """Ask the daemon to send `bytes` random bytes as one update stream to `cluster_id`."""

    TYPE: ClassVar[str] = "ProbeRequest"
    cluster_id: str = spec(CLUSTER_ID)
    bytes: int = spec(Int(0, 1 << 40))


@dataclass(frozen=True)
class ProbeReply(BridgeMessage):
    TYPE: ClassVar[str] = "ProbeReply"
    cluster_id: str = spec(CLUSTER_ID)
    rtt_ms: float = spec(Float(0.0))
    bytes: int = spec(Int(0, 1 << 40))
    seconds: float = spec(Float(0.0))
    throughput_mb_s: float = spec(Float(0.0))
    #: the path the body took (fabricd status transfer.bytes_by_path's keys: dataplane,
    #: dataplane_relayed, direct, relayed, upgraded); "" from a daemon that did not say
    path: str = spec(Text(32, 0, pattern=r"[a-z_]*"), default="")


@dataclass(frozen=True)
class SendUpdate(BridgeMessage):
    """Executor → daemon: stream this update (payload) to `target_cluster`."""

    TYPE: ClassVar[str] = "SendUpdate"
    CARRIES_PAYLOAD: ClassVar[bool] = True
    target_cluster: str = spec(CLUSTER_ID)
    job_id: str = spec(JOB_ID)
    round: int = spec(ROUND)
    source_node: str = spec(NODE_ID)
    target_node: str = spec(NODE_ID)
    message_id: str = spec(MESSAGE_ID)
    tensor_count: int = spec(TENSOR_COUNT)
    byte_length: int = spec(BYTE_LENGTH)
    sha256: bytes = spec(DIGEST, default=b"")
    blake3: bytes = spec(DIGEST, default=b"")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_digest_claim(self)

    def header(self) -> UpdateHeader:
        """The UpdateHeader to put on the wire."""
        return UpdateHeader(**{k: getattr(self, k) for k in UPDATE_HEADER_FIELDS})

    @classmethod
    def from_header(cls, target_cluster: str, header: UpdateHeader) -> SendUpdate:
        return cls(target_cluster=target_cluster,
                   **{k: getattr(header, k) for k in UPDATE_HEADER_FIELDS})

    @classmethod
    def for_payload(cls, payload: bytes, *, target_cluster: str, job_id: str, round: int,
                    source_node: str, target_node: str, message_id: str) -> SendUpdate:
        """The request to stream `payload` (safetensors bytes): its tensor count, length
        and BLAKE3 digest taken from the payload itself (the one place a client computes
        them)."""
        import json
        import struct

        import blake3

        (size,) = struct.unpack_from("<Q", payload)
        count = sum(1 for k in json.loads(payload[8:8 + size]) if k != "__metadata__")
        return cls(target_cluster=target_cluster, job_id=job_id, round=round,
                   source_node=source_node, target_node=target_node, message_id=message_id,
                   tensor_count=count, byte_length=len(payload),
                   blake3=blake3.blake3(payload).digest())


@dataclass(frozen=True)
class SendResult(BridgeMessage):
    """Daemon → executor: the outcome of one SendUpdate (`bytes` sent).

    ``ok``: the target cluster's executor accepted the update (or had already). ``retry``:
    it was not delivered, but sending it again later under the same message id may
    succeed (the target was unreachable, busy, or its executor absent or silent).
    """

    TYPE: ClassVar[str] = "SendResult"
    message_id: str = spec(MESSAGE_ID)
    ok: bool = spec(Bool())
    reason: str = spec(REASON)
    bytes: int = spec(Int(0, I64_MAX))
    retry: bool = spec(Bool(), default=False)


@dataclass(frozen=True)
class Delivery(BridgeMessage):
    """Daemon → executor: a verified update (payload) for a local node."""

    TYPE: ClassVar[str] = "Delivery"
    CARRIES_PAYLOAD: ClassVar[bool] = True
    job_id: str = spec(JOB_ID)
    round: int = spec(ROUND)
    source_node: str = spec(NODE_ID)
    target_node: str = spec(NODE_ID)
    message_id: str = spec(MESSAGE_ID)
    tensor_count: int = spec(TENSOR_COUNT)
    byte_length: int = spec(BYTE_LENGTH)
    sha256: bytes = spec(DIGEST, default=b"")
    blake3: bytes = spec(DIGEST, default=b"")
    source_cluster: str = spec(OPTIONAL_CLUSTER_ID, default="")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_digest_claim(self)

    def header(self) -> UpdateHeader:
        return UpdateHeader(**{k: getattr(self, k) for k in UPDATE_HEADER_FIELDS})

    @classmethod
    def from_header(cls, header: UpdateHeader, source_cluster: str = "") -> Delivery:
        return cls(source_cluster=source_cluster,
                   **{k: getattr(header, k) for k in UPDATE_HEADER_FIELDS})


@dataclass(frozen=True)
class DeliveryResult(BridgeMessage):
    """Executor → daemon: its answer to the Delivery of (`source_cluster`, `message_id`).

    ``ok``: the update was applied, or had been already (``reason`` "duplicate"); the
    daemon then acknowledges it to the sender. Otherwise ``reason`` goes back to the
    sender as a rejection, a transient one if ``retry`` (e.g. the job is not planned yet).
    """

    TYPE: ClassVar[str] = "DeliveryResult"
    message_id: str = spec(MESSAGE_ID)
    ok: bool = spec(Bool())
    reason: str = spec(REASON)
    source_cluster: str = spec(OPTIONAL_CLUSTER_ID, default="")
    retry: bool = spec(Bool(), default=False)


@dataclass(frozen=True)
class ControlSend(BridgeMessage):
    """Executor/scheduler → daemon: send a control request to `target_cluster`."""

    TYPE: ClassVar[str] = "ControlSend"
    request_id: str = spec(REQUEST_ID)
    target_cluster: str = spec(CLUSTER_ID)
    body: dict[str, Any] = spec(Data())


@dataclass(frozen=True)
class ControlDelivery(BridgeMessage):
    """Daemon → executor: a control request from a verified member."""

    TYPE: ClassVar[str] = "ControlDelivery"
    request_id: str = spec(REQUEST_ID)
    from_cluster: str = spec(CLUSTER_ID)
    from_peer: str = spec(Text(128, 1))
    from_role: str = spec(ROLE)
    body: dict[str, Any] = spec(Data())


@dataclass(frozen=True)
class ControlReply(BridgeMessage):
    """Executor → daemon: the answer to a ControlDelivery."""

    TYPE: ClassVar[str] = "ControlReply"
    request_id: str = spec(REQUEST_ID)
    ok: bool = spec(Bool())
    body: dict[str, Any] = spec(Data())
    reason: str = spec(REASON)


@dataclass(frozen=True)
class ControlResult(BridgeMessage):
    """Daemon → sender: the remote answer to a ControlSend."""

    TYPE: ClassVar[str] = "ControlResult"
    request_id: str = spec(REQUEST_ID)
    ok: bool = spec(Bool())
    body: dict[str, Any] = spec(Data())
    reason: str = spec(REASON)


@dataclass(frozen=True)
class Error(BridgeMessage):
    """Either side: the last frame was rejected (reason says why)."""

    TYPE: ClassVar[str] = "Error"
    reason: str = spec(REASON)
