"""The wire contract of fedpilot-fabric: IDs, messages, codec, streams, bridge, certificates.

Imports nothing from fabricd, worker or scheduler, and never libp2p, torch or ray.
"""

from proto.errors import (
    CertificateExpired,
    CertificateRevoked,
    ControlMessageError,
    DigestMismatch,
    ForeignCertificate,
    InvalidMessage,
    LengthMismatch,
    MalformedFrame,
    MessageTooLarge,
    NotAMember,
    PeerMismatch,
    ProtocolError,
    SignatureError,
    StreamClosed,
    UnknownMessageType,
    UnsupportedVersion,
    WrongRole,
)

__all__ = [
    "CertificateExpired",
    "CertificateRevoked",
    "ControlMessageError",
    "DigestMismatch",
    "ForeignCertificate",
    "InvalidMessage",
    "LengthMismatch",
    "MalformedFrame",
    "MessageTooLarge",
    "NotAMember",
    "PeerMismatch",
    "ProtocolError",
    "SignatureError",
    "StreamClosed",
    "UnknownMessageType",
    "UnsupportedVersion",
    "WrongRole",
]
