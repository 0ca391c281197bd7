"""Wire messages between daemons: membership, discovery, update streams, control, envelopes.

Every message is a frozen dataclass with `TYPE: ClassVar[str]`, its fields declared
with a schema; it is validated when constructed and when decoded (`proto.codec`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from proto._schema import (
    I64_MAX,
    U32_MAX,
    Bin,
    Bool,
    Data,
    Float,
    Int,
    ListOf,
    Schema,
    Text,
    pack,
    spec,
)
from proto.certs import (
    CLUSTER_ID_PATTERN,
    PEER_ID_PATTERN,
    Certificate,
    RevocationList,
    public_key_bytes,
    verify_certificate,
)
from proto.errors import InvalidMessage, PeerMismatch, SignatureError
from proto.ids import MAX_CERTIFICATE_BYTES, MAX_MESSAGE_BYTES

RECORD_DOMAIN = b"fedpilot-cluster-record-v1\x00"
ENVELOPE_DOMAIN = b"fedpilot-envelope-v1\x00"
UPDATE_STATUSES = ("ok", "duplicate", "rejected")
#: A rejection whose reason starts with one of these may succeed if the same update (same
#: message id) is sent again later: the receiver was busy, or its executor was not there
#: or did not answer (e.g. its daemon just restarted). Any other rejection is final.
TRANSIENT_REJECTIONS = ("busy:", "unavailable:")


#: How a daemon words "this job has no executor here" (a transient rejection, within
#: limits: an executor that stays away is gone; see worker/executor/transport.py).
NO_CONSUMER = "no executor attached"


def is_transient_rejection(reason: str) -> bool:
    """True if an UpdateAck/SendResult reason says "try again later" (see TRANSIENT_REJECTIONS)."""
    return reason.startswith(TRANSIENT_REJECTIONS)


# Reusable field schemas (also used by proto.bridge).
CLUSTER_ID = Text(64, 1, pattern=CLUSTER_ID_PATTERN)
PEER_ID = Text(128, 1, pattern=PEER_ID_PATTERN)
ADDRS = ListOf(Text(512, 1), max_items=32)
CAPACITY = Int(0, U32_MAX)
TIMESTAMP = Float(0.0, 1e12)
JOB_ID = Text(128, 1)
NODE_ID = Text(256, 1)
MESSAGE_ID = Text(256, 1)
REQUEST_ID = Text(128, 1)
REASON = Text(1024, allow_control=True)
ROUND = Int(0, U32_MAX)
TENSOR_COUNT = Int(0, 10_000_000)
BYTE_LENGTH = Int(0, I64_MAX)
#: an update's body digest: 32 bytes, or empty when the other algorithm's field carries it
DIGEST = Bin(32, exact=(0, 32))
SIGNATURE = Bin(64, exact=(64,))
CERTIFICATE = Bin(MAX_CERTIFICATE_BYTES)


class Message(Schema):
    """Base of every daemon-to-daemon message (one registry, keyed by TYPE)."""

    REGISTRY: ClassVar[dict[str, type[Schema]]] = {}


# ---- membership -------------------------------------------------------------------------

@dataclass(frozen=True)
class MemberHello(Message):
    """First message on PROTOCOL_MEMBER: the sender's membership certificate."""

    TYPE: ClassVar[str] = "MemberHello"
    certificate: bytes = spec(Bin(MAX_CERTIFICATE_BYTES, 1))


@dataclass(frozen=True)
class MemberAck(Message):
    """Reply on PROTOCOL_MEMBER: accepted or not (with reason), plus the replier's certificate."""

    TYPE: ClassVar[str] = "MemberAck"
    accepted: bool = spec(Bool())
    reason: str = spec(REASON)
    certificate: bytes = spec(CERTIFICATE)


# ---- discovery --------------------------------------------------------------------------

@dataclass(frozen=True)
class ClusterRecord(Message):
    """A cluster's DHT record, signed by its daemon's identity key (empty signature = unsigned)."""

    TYPE: ClassVar[str] = "ClusterRecord"
    cluster_id: str = spec(CLUSTER_ID)
    peer_id: str = spec(PEER_ID)
    addrs: tuple[str, ...] = spec(ADDRS)
    capacity: int = spec(CAPACITY)
    issued_at: float = spec(TIMESTAMP)
    certificate: bytes = spec(CERTIFICATE)
    signature: bytes = spec(Bin(64, exact=(0, 64)), default=b"")

    def signing_bytes(self) -> bytes:
        """The exact bytes the signature covers (every field but the signature)."""
        return RECORD_DOMAIN + pack([
            self.cluster_id, self.peer_id, list(self.addrs), self.capacity,
            self.issued_at, self.certificate,
        ])

    def sign(self, private_key: Ed25519PrivateKey) -> ClusterRecord:
        """A copy of this record signed with `private_key`."""
        return replace(self, signature=private_key.sign(self.signing_bytes()))

    def verify(self, public_key: Ed25519PublicKey | bytes) -> None:
        """Raise SignatureError unless the record is signed by `public_key`."""
        if not self.signature:
            raise SignatureError(f"cluster record for {self.cluster_id!r} is not signed")
        key = public_key if isinstance(public_key, Ed25519PublicKey) else \
            Ed25519PublicKey.from_public_bytes(public_key_bytes(public_key))
        try:
            key.verify(self.signature, self.signing_bytes())
        except InvalidSignature:
            raise SignatureError(
                f"cluster record for {self.cluster_id!r} (peer {self.peer_id}) has a bad signature"
            ) from None

    def verify_member(
        self,
        ca_public: Ed25519PublicKey | bytes,
        *,
        now: float,
        revoked: Collection[int] | RevocationList = (),
    ) -> Certificate:
        """Check the embedded certificate (CA, validity, revocation, role "cluster"), that it
        names this record's peer and cluster, and the signature with the certificate's key.
        Returns the certificate; raises NotAMember subclasses or SignatureError."""
        cert = verify_certificate(
            self.certificate, ca_public, now=now, revoked=revoked,
            expected_peer_id=self.peer_id, required_role="cluster",
        )
        if cert.cluster_id != self.cluster_id:
            raise PeerMismatch(
                f"record claims cluster {self.cluster_id!r} but peer {self.peer_id}'s "
                f"certificate is for cluster {cert.cluster_id!r}"
            )
        self.verify(cert.public_key)
        return cert


@dataclass(frozen=True)
class Heartbeat(Message):
    """Published on TOPIC_HEARTBEAT about once a second by every daemon.

    ``certificate`` is the publisher's membership certificate: receivers count a heartbeat
    (and use its addresses as a dial hint) only if it verifies for the gossip signer.
    """

    TYPE: ClassVar[str] = "Heartbeat"
    cluster_id: str = spec(CLUSTER_ID)
    peer_id: str = spec(PEER_ID)
    addrs: tuple[str, ...] = spec(ADDRS)
    capacity: int = spec(CAPACITY)
    seq: int = spec(Int())
    sent_at: float = spec(TIMESTAMP)
    certificate: bytes = spec(CERTIFICATE, default=b"")


# ---- update streams ---------------------------------------------------------------------

@dataclass(frozen=True)
class UpdateHeader(Message):
    """First frame on PROTOCOL_UPDATE; `byte_length` raw safetensors bytes follow."""

    TYPE: ClassVar[str] = "UpdateHeader"
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


UPDATE_HEADER_FIELDS = (
    "job_id", "round", "source_node", "target_node", "message_id",
    "tensor_count", "byte_length", "sha256", "blake3",
)


def check_digest_claim(msg: Any) -> None:
    """An update's body digest is claimed with exactly one algorithm: ``blake3`` (what
    executors send: ~2.5x sha256's speed here, and the data plane's sending daemon checks it
    while it encrypts the body, so the body is hashed once per side) or ``sha256``."""
    if bool(msg.sha256) == bool(msg.blake3):
        which = "both" if msg.sha256 else "neither"
        raise InvalidMessage(f"an update claims its body's digest as exactly one of 'sha256' and "
                             f"'blake3' (32 bytes); this one sets {which}", field="sha256")


@dataclass(frozen=True)
class UpdateAck(Message):
    """The receiver's verdict on one update stream."""

    TYPE: ClassVar[str] = "UpdateAck"
    message_id: str = spec(MESSAGE_ID)
    status: str = spec(Text(16, choices=UPDATE_STATUSES))
    reason: str = spec(REASON)
    received_bytes: int = spec(BYTE_LENGTH)


# ---- control ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ControlRequest(Message):
    """A request on PROTOCOL_CONTROL; `body` is plain data (see proto._schema.Data)."""

    TYPE: ClassVar[str] = "ControlRequest"
    request_id: str = spec(REQUEST_ID)
    body: dict[str, Any] = spec(Data())


@dataclass(frozen=True)
class ControlResponse(Message):
    """The reply to a ControlRequest with the same request_id."""

    TYPE: ClassVar[str] = "ControlResponse"
    request_id: str = spec(REQUEST_ID)
    ok: bool = spec(Bool())
    body: dict[str, Any] = spec(Data())
    reason: str = spec(REASON)


# ---- signed envelopes -------------------------------------------------------------------

@dataclass(frozen=True)
class SignedEnvelope(Message):
    """`payload` signed by the holder of `certificate` (e.g. a scheduler's job or routing)."""

    TYPE: ClassVar[str] = "SignedEnvelope"
    payload: bytes = spec(Bin(MAX_MESSAGE_BYTES))
    certificate: bytes = spec(Bin(MAX_CERTIFICATE_BYTES, 1))
    signature: bytes = spec(SIGNATURE)


def sign_envelope(
    payload: bytes, certificate: bytes, private_key: Ed25519PrivateKey
) -> SignedEnvelope:
    """Sign `payload` with `private_key`, whose public key must be the certificate's."""
    return SignedEnvelope(
        payload=payload, certificate=certificate,
        signature=private_key.sign(ENVELOPE_DOMAIN + payload),
    )


def open_envelope(
    env: SignedEnvelope,
    ca_public: Ed25519PublicKey | bytes,
    *,
    now: float,
    revoked: Collection[int] | RevocationList = (),
    required_role: str | None = "scheduler",
) -> tuple[Certificate, bytes]:
    """Verify the certificate against the CA (validity, revocation, role) and the signature
    with the certificate's key; return (certificate, payload). Raises NotAMember subclasses
    or SignatureError."""
    cert = verify_certificate(
        env.certificate, ca_public, now=now, revoked=revoked, required_role=required_role
    )
    try:
        Ed25519PublicKey.from_public_bytes(cert.public_key).verify(
            env.signature, ENVELOPE_DOMAIN + env.payload
        )
    except InvalidSignature:
        raise SignatureError(
            f"envelope signature does not match the key of peer {cert.peer_id} "
            f"(certificate serial {cert.serial})"
        ) from None
    return cert, env.payload


# ---- data plane ---------------------------------------------------------------------------

@dataclass(frozen=True)
class DataPlaneOffer(Message):
    """On /fedpilot/dataplane/1.0.0: the sender's ephemeral TLS certificate (DER)."""

    TYPE: ClassVar[str] = "DataPlaneOffer"
    certificate: bytes = spec(Bin(MAX_CERTIFICATE_BYTES, 1))
    #: the sender's own data-plane port and a nonce: a receiver behind NAT that the sender
    #: reaches directly may connect there instead, opening with the nonce (0, b"": none)
    port: int = spec(Int(0, 65535), default=0)
    nonce: bytes = spec(Bin(16, exact=(0, 16)), default=b"")


@dataclass(frozen=True)
class DataPlaneTicket(Message):
    """The receiver's answer: its TLS port and ephemeral certificate, and a one-time
    ticket for the sender's certificate (port 0 and empty fields: refused, see reason)."""

    TYPE: ClassVar[str] = "DataPlaneTicket"
    port: int = spec(Int(0, 65535))
    certificate: bytes = spec(Bin(MAX_CERTIFICATE_BYTES))
    ticket: bytes = spec(Bin(32, exact=(0, 32)))
    reason: str = spec(REASON)
    #: a receiver behind NAT: connect to this gateway's data plane (``port`` is the
    #: gateway's) and open with ``splice``, the gateway joins the receiver's connection
    via: str = spec(Text(128, 0, pattern=r"[1-9A-HJ-NP-Za-km-z]*"), default="")
    splice: bytes = spec(Bin(32, exact=(0, 32)), default=b"")
    #: the receiver (behind NAT) connected to the sender's own port, with the offer's nonce:
    #: the sender runs its handshake on that connection
    reverse: bool = spec(Bool(), default=False)


@dataclass(frozen=True)
class SpliceRequest(Message):
    """On /fedpilot/dataplane-splice/1.0.0, a member behind NAT to its gateway: join one
    data-plane connection of ``peer`` (the sender it gives a ticket to) with one of mine."""

    TYPE: ClassVar[str] = "SpliceRequest"
    peer: str = spec(PEER_ID)


@dataclass(frozen=True)
class DialBackRequest(Message):
    """On /fedpilot/dialback/1.0.0: dial me back at this TCP port (of the address you see
    me at: a gateway dials nowhere else)."""

    TYPE: ClassVar[str] = "DialBackRequest"
    port: int = spec(Int(1, 65535))


@dataclass(frozen=True)
class DialBackResult(Message):
    """The gateway's answer: whether a TCP connection to ``address`` was made, and why not."""

    TYPE: ClassVar[str] = "DialBackResult"
    reachable: bool = spec(Bool())
    address: str = spec(Text(64))
    reason: str = spec(REASON)


@dataclass(frozen=True)
class SpliceGrant(Message):
    """The gateway's answer: its data-plane port and the two one-time tokens each side
    opens its connection with (port 0 and empty tokens: refused, see reason)."""

    TYPE: ClassVar[str] = "SpliceGrant"
    port: int = spec(Int(0, 65535))
    listen_token: bytes = spec(Bin(32, exact=(0, 32)))
    dial_token: bytes = spec(Bin(32, exact=(0, 32)))
    reason: str = spec(REASON)
