"""Signed control bodies: the sending daemon signs, the receiving daemon verifies.

Every control request a daemon relays carries `{"signed": SignedEnvelope}`. The signed
payload is a msgpack map ``{audience, nonce, issued_at, expires_at, job_id, body}``:
the bridge client's body plus the cluster it is addressed to, a random 16-byte nonce,
a validity window and the job it concerns. The receiver checks the certificate against
the CA and the revocation list, that it belongs to the Noise-authenticated sender (no
relaying of someone else's envelope), the signature, that the envelope is addressed to
THIS cluster (no re-targeting), inside its validity window (no late replays), and that
its nonce was not seen before (a bounded replay window). Job messages (`kind` starting
with `job.`, `round.` or `node.`) are accepted only from a `scheduler` certificate;
which scheduler may steer which job is fabricd.control's `JobOwners`.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
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
#: an envelope is valid this long after it was signed (it is checked on arrival only)
ENVELOPE_TTL = 120.0
#: the longest validity a receiver accepts, and how far a signer's clock may run ahead
MAX_ENVELOPE_TTL = 600.0
CLOCK_SKEW = 60.0
NONCE_BYTES = 16
#: nonces remembered; beyond this the oldest is forgotten and anything issued before it refused
REPLAY_WINDOW = 65536
_ENVELOPE_KEYS = frozenset({"audience", "nonce", "issued_at", "expires_at", "job_id", "body"})


def is_job_message(body: dict[str, Any]) -> bool:
    kind = body.get("kind")
    return isinstance(kind, str) and kind.startswith(SCHEDULER_KINDS)


def seal(body: dict[str, Any], certificate: bytes, key: Ed25519PrivateKey, *, audience: str,
         now: float | None = None, ttl: float = ENVELOPE_TTL, nonce: bytes | None = None) -> dict[str, Any]:
    """The body to put on the wire for cluster ``audience``: the original, signed."""
    issued = time.time() if now is None else now
    job_id = body.get("job_id")
    payload = msgpack.packb({
        "audience": audience, "nonce": nonce if nonce is not None else secrets.token_bytes(NONCE_BYTES),
        "issued_at": float(issued), "expires_at": float(issued + ttl),
        "job_id": job_id if isinstance(job_id, str) else "", "body": body,
    }, use_bin_type=True)
    return {SIGNED_KEY: encode(sign_envelope(payload, certificate, key))}


class ReplayWindow:
    """Nonces of accepted envelopes, kept until they expire; bounded.

    When full, the oldest nonce is forgotten and the window's floor rises to its issue
    time: from then on anything issued at or before the floor is refused, so forgetting
    never re-opens a replay.
    """

    def __init__(self, limit: int = REPLAY_WINDOW) -> None:
        self.limit = limit
        self.floor = 0.0
        self._seen: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # nonce -> (expires, issued)

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, nonce: bytes, issued_at: float, expires_at: float, now: float) -> None:
        """Remember ``nonce``; InvalidMessage if it was seen or is older than the window."""
        while self._seen:
            first = next(iter(self._seen.values()))
            if first[0] >= now:
                break
            self._seen.popitem(last=False)
        if nonce in self._seen:
            raise InvalidMessage("replayed control envelope: this nonce was already accepted")
        if issued_at <= self.floor:
            raise InvalidMessage(f"control envelope issued at {issued_at:.3f} is older than the replay "
                                 f"window (floor {self.floor:.3f}); sign a fresh one")
        while len(self._seen) >= self.limit:
            _, (_, issued) = self._seen.popitem(last=False)
            self.floor = max(self.floor, issued)
        self._seen[nonce] = (expires_at, issued_at)


def _envelope_fields(payload: bytes) -> dict[str, Any]:
    try:
        outer = msgpack.unpackb(payload, raw=False, strict_map_key=True,
                                max_bin_len=MAX_BODY_BYTES, max_str_len=MAX_BODY_BYTES)
    except (ValueError, TypeError, msgpack.FormatError, msgpack.StackError) as exc:
        raise InvalidMessage(f"signed control body is not msgpack: {exc}") from None
    if not isinstance(outer, dict) or set(outer) != _ENVELOPE_KEYS:
        raise InvalidMessage("signed control body is not an envelope with audience, nonce, issued_at, "
                             "expires_at, job_id and body (is the sender's fabricd older?)")
    types = {"audience": str, "nonce": bytes, "issued_at": float, "expires_at": float,
             "job_id": str, "body": dict}
    for name, kind in types.items():
        if not isinstance(outer[name], kind):
            raise InvalidMessage(f"control envelope field {name!r} must be {kind.__name__}")
    if len(outer["nonce"]) != NONCE_BYTES:
        raise InvalidMessage(f"control envelope nonce must be {NONCE_BYTES} bytes")
    return outer


def unseal(body: dict[str, Any], *, sender_peer: str, ca_public: Ed25519PublicKey | bytes,
           revoked: Collection[int], audience: str, replay: ReplayWindow | None = None,
           now: float | None = None) -> tuple[Certificate, dict[str, Any]]:
    """Verify a sealed body from `sender_peer` addressed to cluster `audience`.

    Returns (signer's certificate, body). Raises NotAMember/SignatureError/WrongRole/
    InvalidMessage (all ProtocolError) with the reason."""
    clock = time.time() if now is None else now
    raw = body.get(SIGNED_KEY)
    if not isinstance(raw, bytes) or len(body) != 1:
        raise InvalidMessage("control body is not signed (expected a single 'signed' envelope)")
    envelope = decode(raw, max_size=MAX_BODY_BYTES + 8192)
    if not isinstance(envelope, SignedEnvelope):
        raise InvalidMessage(f"expected a SignedEnvelope, got {envelope.TYPE}")
    cert, payload = open_envelope(envelope, ca_public, now=clock, revoked=revoked, required_role=None)
    if cert.peer_id != sender_peer:
        raise NotAMember(f"envelope signed by {cert.peer_id} but sent by {sender_peer}")
    outer = _envelope_fields(payload)
    if outer["audience"] != audience:
        raise InvalidMessage(f"control envelope is addressed to cluster {outer['audience']!r}, "
                             f"not {audience!r} (re-targeted)")
    issued, expires = outer["issued_at"], outer["expires_at"]
    if clock > expires:
        raise InvalidMessage(f"control envelope expired {clock - expires:.1f} s ago (signed at {issued:.3f})")
    if issued > clock + CLOCK_SKEW or expires - issued > MAX_ENVELOPE_TTL or expires < issued:
        raise InvalidMessage(f"control envelope validity {issued:.3f}..{expires:.3f} is not acceptable "
                             f"(at most {MAX_ENVELOPE_TTL:.0f} s, clocks within {CLOCK_SKEW:.0f} s)")
    inner = outer["body"]
    inner_job = inner.get("job_id")
    if (inner_job if isinstance(inner_job, str) else "") != outer["job_id"]:
        raise InvalidMessage(f"control envelope is for job {outer['job_id']!r} but its body names "
                             f"{inner_job!r}")
    if is_job_message(inner) and cert.role != "scheduler":
        raise WrongRole(f"{inner.get('kind')} must be signed by a scheduler certificate; "
                        f"peer {cert.peer_id} (cluster {cert.cluster_id}) has role {cert.role!r}")
    if replay is not None:
        replay.admit(outer["nonce"], issued, expires, clock)
    return cert, inner


__all__ = ["ProtocolError", "ReplayWindow", "is_job_message", "seal", "unseal"]
