"""One exception hierarchy for bad input on any wire, bridge or certificate.

Callers catch `ProtocolError` (or a subclass), never `Exception`. Every message says
what was wrong and what is allowed.
"""

from __future__ import annotations


class FabricError(Exception):
    """The root of every error this project raises on purpose (each package's own root
    derives from it: ProtocolError here, FabricdError, WorkerError, SchedulerError,
    DatasetError, and JobSpecError for job files), so `except FabricError` catches all of
    them and nothing else."""


class ProtocolError(FabricError):
    """Base of every rejection of bad input from a peer, a bridge client or a file."""


class StreamClosed(FabricError, ConnectionError, EOFError):
    """The stream or socket ended cleanly before the first byte of a frame (not bad input).

    Both an EOFError and a ConnectionError, so either `except` clause catches it.
    """


class MalformedFrame(ProtocolError):
    """The bytes are not a well-formed frame (truncated, not msgpack, trailing data)."""


class MessageTooLarge(ProtocolError):
    """A frame, header, body or length prefix exceeds its limit."""


class UnknownMessageType(ProtocolError):
    """The `type` field names no message this side knows."""


class UnsupportedVersion(ProtocolError):
    """The `v` field is a schema version this side does not speak."""


class InvalidMessage(ProtocolError):
    """A field is missing, extra, of the wrong type or out of range (the message names it)."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ControlMessageError(InvalidMessage):
    """A scheduler -> executor control body (`proto.control`) is malformed: `kind` is its
    kind, `field` the dotted field at fault (e.g. ``client_samples[3]``)."""

    def __init__(self, kind: str, field: str | None, message: str) -> None:
        super().__init__(f"{kind}: {message}", field=field)
        self.kind = kind


class LengthMismatch(ProtocolError):
    """An update body is longer or shorter than its header's byte_length."""


class DigestMismatch(ProtocolError):
    """An update body's sha256 differs from its header's."""


class SignatureError(ProtocolError):
    """A signature does not verify with the expected key."""


class NotAMember(ProtocolError):
    """The peer has no valid membership certificate (base of all membership rejections)."""


class CertificateExpired(NotAMember):
    """The certificate is outside its validity window (expired or not yet valid)."""


class CertificateRevoked(NotAMember):
    """The certificate's serial is on the revocation list."""


class ForeignCertificate(NotAMember):
    """The certificate was not signed by this federation's CA."""


class PeerMismatch(NotAMember):
    """The certificate is for another peer ID, or its key does not hash to its peer ID."""


class WrongRole(NotAMember):
    """The certificate's role is not the one this operation requires."""
