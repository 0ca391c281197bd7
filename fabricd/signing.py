"""Signed control bodies: the sending daemon signs, the receiving daemon verifies.

Every control request a daemon relays carries `{"signed": SignedEnvelope}` whose payload
is the bridge client's body (msgpack), signed with the daemon's identity key and carrying
its membership certificate. The receiver checks the certificate against the CA and the
revocation list, that it belongs to the Noise-authenticated sender (no relaying of
someone else's envelope), and the signature. Job messages (`kind` starting with `job.`,
`round.` or `node.`) are accepted only from a `scheduler` certificate.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from proto.certs import Certificate
from proto.codec import decode, encode
from proto.errors import InvalidMessage, NotAMember, ProtocolError, WrongRole
from proto.messages import SignedEnvelope, open_envelope, sign_envelope

SIGNED_KEY = "signed"
SCHEDULER_KINDS = ("job.", "round.", "node.")
MAX_BODY_BYTES = 4 * 1024 * 1024


def is_job_message(body: dict[str, Any]) -> bool:
    kind = body.get("kind")
    return isinstance(kind, str) and kind.startswith(SCHEDULER_KINDS)


def seal(body: dict[str, Any], certificate: bytes, key: Ed25519PrivateKey) -> dict[str, Any]:
    """The body to put on the wire: the original, signed."""
    payload = msgpack.packb(body, use_bin_type=True)
    return {SIGNED_KEY: encode(sign_envelope(payload, certificate, key))}


def unseal(body: dict[str, Any], *, sender_peer: str, ca_public: Ed25519PublicKey | bytes,
           revoked: Collection[int]) -> tuple[Certificate, dict[str, Any]]:
    """Verify a sealed body from `sender_peer`; return (signer's certificate, body).

    Raises NotAMember/SignatureError/InvalidMessage (all ProtocolError) with a reason."""
    raw = body.get(SIGNED_KEY)
    if not isinstance(raw, bytes) or len(body) != 1:
        raise InvalidMessage("control body is not signed (expected a single 'signed' envelope)")
    envelope = decode(raw, max_size=MAX_BODY_BYTES + 8192)
    if not isinstance(envelope, SignedEnvelope):
        raise InvalidMessage(f"expected a SignedEnvelope, got {envelope.TYPE}")
    cert, payload = open_envelope(envelope, ca_public, now=time.time(), revoked=revoked,
                                  required_role=None)
    if cert.peer_id != sender_peer:
        raise NotAMember(f"envelope signed by {cert.peer_id} but sent by {sender_peer}")
    try:
        inner = msgpack.unpackb(payload, raw=False, strict_map_key=True,
                                max_bin_len=MAX_BODY_BYTES, max_str_len=MAX_BODY_BYTES)
    except (ValueError, TypeError, msgpack.FormatError, msgpack.StackError) as exc:
        raise InvalidMessage(f"signed control body is not msgpack: {exc}") from None
    if not isinstance(inner, dict):
        raise InvalidMessage("signed control body is not a map")
    if is_job_message(inner) and cert.role != "scheduler":
        raise WrongRole(f"{inner.get('kind')} must be signed by a scheduler certificate; "
                        f"peer {cert.peer_id} (cluster {cert.cluster_id}) has role {cert.role!r}")
    return cert, inner


__all__ = ["ProtocolError", "is_job_message", "seal", "unseal"]
