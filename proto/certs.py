"""Federation membership: the CA, certificates binding a peer ID to a cluster and role, revocation.

A certificate is msgpack `{v, type: "SignedCertificate", tbs, signature}` where `tbs` is
the msgpack of the `Certificate` fields and `signature` is the CA's ed25519 signature
over `CERT_DOMAIN + tbs`. Verification checks the CA signature first, then that the
certificate's public key hashes to its peer ID, then the validity window, the
revocation list, the expected peer and the role.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from proto._schema import (
    I64_MAX,
    Bin,
    Int,
    ListOf,
    Schema,
    Text,
    from_map,
    pack,
    spec,
    unpack_limited,
)
from proto.errors import (
    CertificateExpired,
    CertificateRevoked,
    ForeignCertificate,
    NotAMember,
    PeerMismatch,
    ProtocolError,
    WrongRole,
)
from proto.ids import MAX_CERTIFICATE_BYTES

log = logging.getLogger(__name__)

ROLES = ("cluster", "scheduler")
CERT_DOMAIN = b"fedpilot-certificate-v1\x00"
REVOCATIONS_DOMAIN = b"fedpilot-revocations-v1\x00"
#: largest signed revocation list (about 40,000 serials); it travels over gossip
MAX_REVOCATIONS_BYTES = 480 * 1024
MAX_REVOKED_SERIALS = 40_000
CA_KEY_FILE = "ca.key"
CA_PUB_FILE = "ca.pub"
DEFAULT_VALIDITY_SECONDS = 365 * 24 * 3600
CLUSTER_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
PEER_ID_PATTERN = r"[1-9A-HJ-NP-Za-km-z]+"

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58)}
# libp2p PublicKey protobuf: field 1 (KeyType) = 1 (Ed25519), field 2 (Data) = 32 bytes.
_ED25519_PROTOBUF_PREFIX = b"\x08\x01\x12\x20"
_IDENTITY_MULTIHASH_PREFIX = b"\x00\x24"


def _b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58[r])
    pad = len(data) - len(data.lstrip(b"\x00"))
    return "1" * pad + "".join(reversed(out))


def _b58decode(text: str) -> bytes:
    n = 0
    for c in text:
        if c not in _B58_INDEX:
            raise ValueError(f"{c!r} is not a base58 character")
        n = n * 58 + _B58_INDEX[c]
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    pad = len(text) - len(text.lstrip("1"))
    return b"\x00" * pad + body


def peer_id_from_ed25519_public(raw32: bytes) -> str:
    """The libp2p peer ID (base58 identity multihash) of a raw 32-byte ed25519 public key.

    Equals `libp2p.peer.id.ID.from_pubkey(key).to_base58()` for ed25519 keys.
    """
    if not isinstance(raw32, bytes) or len(raw32) != 32:
        raise ValueError("an ed25519 public key is exactly 32 raw bytes")
    return _b58encode(_IDENTITY_MULTIHASH_PREFIX + _ED25519_PROTOBUF_PREFIX + raw32)


def ed25519_public_from_peer_id(peer_id: str) -> bytes:
    """The raw 32-byte ed25519 key embedded in a libp2p peer ID; ValueError if it has none."""
    raw = _b58decode(peer_id)
    prefix = _IDENTITY_MULTIHASH_PREFIX + _ED25519_PROTOBUF_PREFIX
    if len(raw) != len(prefix) + 32 or not raw.startswith(prefix):
        raise ValueError(f"peer ID {peer_id[:64]!r} does not embed an ed25519 public key")
    return raw[len(prefix):]


def public_key_bytes(key: Ed25519PublicKey | Ed25519PrivateKey | bytes) -> bytes:
    """Raw 32 bytes of an ed25519 public key (given the key, its private key or raw bytes)."""
    if isinstance(key, Ed25519PrivateKey):
        key = key.public_key()
    if isinstance(key, Ed25519PublicKey):
        return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    if isinstance(key, bytes) and len(key) == 32:
        return key
    raise ValueError("expected an Ed25519 key or 32 raw public-key bytes")


def _public_key(key: Ed25519PublicKey | bytes) -> Ed25519PublicKey:
    if isinstance(key, Ed25519PublicKey):
        return key
    return Ed25519PublicKey.from_public_bytes(public_key_bytes(key))


class _CertSchema(Schema):
    REGISTRY: ClassVar[dict[str, type[Schema]]] = {}


@dataclass(frozen=True)
class Certificate(_CertSchema):
    """What a membership certificate asserts (times are integer Unix seconds)."""

    TYPE: ClassVar[str] = "Certificate"
    peer_id: str = spec(Text(128, 1, pattern=PEER_ID_PATTERN))
    cluster_id: str = spec(Text(64, 1, pattern=CLUSTER_ID_PATTERN))
    role: str = spec(Text(16, choices=ROLES))
    not_before: int = spec(Int(0, I64_MAX))
    not_after: int = spec(Int(0, I64_MAX))
    serial: int = spec(Int(1, I64_MAX))
    public_key: bytes = spec(Bin(32, exact=(32,)))


@dataclass(frozen=True)
class _SignedCertificate(_CertSchema):
    TYPE: ClassVar[str] = "SignedCertificate"
    tbs: bytes = spec(Bin(MAX_CERTIFICATE_BYTES, 1))
    signature: bytes = spec(Bin(64, exact=(64,)))


def generate_ca() -> Ed25519PrivateKey:
    """A fresh federation CA key."""
    return Ed25519PrivateKey.generate()


def save_ca(directory: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Write a fresh CA key to `ca.key` (PEM, mode 0600) and its `ca.pub` (PEM) into
    `directory`; return the key. Refuses to overwrite an existing `ca.key`."""
    key = generate_ca()
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    key_path = root / CA_KEY_FILE
    if key_path.exists():
        raise FileExistsError(f"{key_path} already exists; refusing to overwrite a CA key")
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    os.chmod(key_path, 0o600)
    mode = stat.S_IMODE(key_path.stat().st_mode)
    if mode & 0o077:  # e.g. a filesystem that ignores chmod: never leave a readable CA key
        key_path.unlink()
        raise InsecureKeyFile(f"{key_path} could not be made private (mode {mode:o}); create the "
                              "CA on a filesystem that keeps Unix permissions")
    pub = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    (root / CA_PUB_FILE).write_bytes(pub)
    return key


def _resolve(path: str | os.PathLike[str], default_name: str) -> Path:
    p = Path(path)
    return p / default_name if p.is_dir() else p


class InsecureKeyFile(ProtocolError, ValueError):
    """The CA key file can be read by other users; the message says how to fix it."""


def load_ca_private(path: str | os.PathLike[str], *, allow_readable: bool = False) -> Ed25519PrivateKey:
    """Load the CA key from a PEM file (or `DIR/ca.key`); ValueError names the file.

    Refuses (InsecureKeyFile) a key file that group or others may access, unless
    ``allow_readable`` (the CLI's ``--allow-readable-ca-key``), then only warns."""
    p = _resolve(path, CA_KEY_FILE)
    mode = stat.S_IMODE(p.stat().st_mode)
    if mode & 0o077:
        if not allow_readable:
            raise InsecureKeyFile(
                f"{p} has mode {mode:o}: other users can read the federation CA key; run "
                f"`chmod 600 {p}` (or pass --allow-readable-ca-key to use it anyway)")
        log.warning("event=ca_key_permissions path=%s mode=%o advice=chmod_600", p, mode)
    try:
        key = serialization.load_pem_private_key(p.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{p}: not a PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{p}: the CA key must be ed25519, got {type(key).__name__}")
    return key


def load_ca_public(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    """Load the CA public key from a PEM file (or `DIR/ca.pub`); ValueError names the file."""
    p = _resolve(path, CA_PUB_FILE)
    try:
        key = serialization.load_pem_public_key(p.read_bytes())
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{p}: not a PEM public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{p}: the CA public key must be ed25519, got {type(key).__name__}")
    return key


def issue_certificate(
    ca_private: Ed25519PrivateKey,
    public_key: Ed25519PublicKey | bytes,
    cluster_id: str,
    role: str = "cluster",
    *,
    not_before: int,
    not_after: int | None = None,
    serial: int | None = None,
) -> bytes:
    """Sign a certificate for the holder of `public_key` (its peer ID is derived from it).

    `not_after` defaults to one year after `not_before`; `serial` to a random 63-bit int.
    Raises InvalidMessage for a bad cluster id, role or time window.
    """
    raw = public_key_bytes(public_key)
    cert = Certificate(
        peer_id=peer_id_from_ed25519_public(raw),
        cluster_id=cluster_id,
        role=role,
        not_before=int(not_before),
        not_after=int(not_after if not_after is not None
                      else not_before + DEFAULT_VALIDITY_SECONDS),
        serial=serial if serial is not None else secrets.randbits(62) + 1,
        public_key=raw,
    )
    if cert.not_after <= cert.not_before:
        raise ValueError("not_after must be later than not_before")
    tbs = pack(cert.to_map())
    signed = _SignedCertificate(tbs=tbs, signature=ca_private.sign(CERT_DOMAIN + tbs))
    return pack(signed.to_map())


def _parse(data: bytes) -> tuple[Certificate, _SignedCertificate]:
    outer = from_map(_CertSchema.REGISTRY, unpack_limited(data, MAX_CERTIFICATE_BYTES))
    if not isinstance(outer, _SignedCertificate):
        raise ProtocolError("expected a SignedCertificate")
    inner = from_map(_CertSchema.REGISTRY, unpack_limited(outer.tbs, MAX_CERTIFICATE_BYTES))
    if not isinstance(inner, Certificate):
        raise ProtocolError("the signed part is not a Certificate")
    return inner, outer


def parse_certificate(data: bytes) -> Certificate:
    """Read a certificate WITHOUT checking it (e.g. to revoke its serial); NotAMember if garbled."""
    try:
        return _parse(data)[0]
    except ProtocolError as exc:
        raise NotAMember(f"malformed membership certificate: {exc}") from None


def verify_certificate(
    data: bytes,
    ca_public: Ed25519PublicKey | bytes,
    *,
    now: float,
    revoked: Collection[int] | RevocationList = (),
    expected_peer_id: str | None = None,
    required_role: str | None = None,
) -> Certificate:
    """Return the certificate if `data` is a valid, unrevoked membership certificate.

    Raises a NotAMember subclass saying why: ForeignCertificate (not signed by this CA),
    PeerMismatch (key does not hash to its peer ID, or not `expected_peer_id`),
    CertificateExpired (outside not_before..not_after), CertificateRevoked, WrongRole.
    """
    if not isinstance(data, bytes):
        raise NotAMember(f"membership certificate must be bytes, got {type(data).__name__}")
    try:
        cert, outer = _parse(data)
    except ProtocolError as exc:
        raise NotAMember(f"malformed membership certificate: {exc}") from None
    try:
        _public_key(ca_public).verify(outer.signature, CERT_DOMAIN + outer.tbs)
    except InvalidSignature:
        raise ForeignCertificate(
            f"certificate for peer {cert.peer_id} (cluster {cert.cluster_id!r}) is not signed "
            "by this federation's CA"
        ) from None
    if peer_id_from_ed25519_public(cert.public_key) != cert.peer_id:
        raise PeerMismatch(
            f"certificate serial {cert.serial}: its public key does not hash to peer {cert.peer_id}"
        )
    if expected_peer_id is not None and cert.peer_id != expected_peer_id:
        raise PeerMismatch(
            f"certificate is for peer {cert.peer_id}, but was presented by {expected_peer_id}"
        )
    if now < cert.not_before:
        raise CertificateExpired(
            f"certificate serial {cert.serial} for peer {cert.peer_id} is not valid before "
            f"{cert.not_before} (now {int(now)})"
        )
    if now > cert.not_after:
        raise CertificateExpired(
            f"certificate serial {cert.serial} for peer {cert.peer_id} expired at "
            f"{cert.not_after} (now {int(now)})"
        )
    if cert.serial in revoked:
        raise CertificateRevoked(
            f"certificate serial {cert.serial} for peer {cert.peer_id} has been revoked"
        )
    if required_role is not None and cert.role != required_role:
        raise WrongRole(
            f"peer {cert.peer_id} has role {cert.role!r}; this needs role {required_role!r}"
        )
    return cert


class RevocationList(Collection[int]):
    """A set of revoked certificate serials, read from a text file.

    File format: one decimal serial per line; `#` starts a comment; blank lines ignored.
    A missing file means nothing is revoked.
    """

    def __init__(self, serials: Iterable[int] = (), path: Path | None = None) -> None:
        self.serials = frozenset(serials)
        self.path = path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RevocationList:
        """Read `path`; ValueError names the file and line of anything not a serial."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            return cls((), p)
        serials = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            entry = line.split("#", 1)[0].strip()
            if not entry:
                continue
            if not entry.isdigit() or int(entry) <= 0:
                raise ValueError(
                    f"{p}:{lineno}: {entry[:64]!r} is not a certificate serial "
                    "(expected one positive decimal integer per line; '#' starts a comment)"
                )
            serials.append(int(entry))
        return cls(serials, p)

    @staticmethod
    def append(path: str | os.PathLike[str], serial: int, comment: str = "") -> None:
        """Add `serial` as a new line of `path` (created if missing)."""
        if isinstance(serial, bool) or not isinstance(serial, int) or serial <= 0:
            raise ValueError(f"serial must be a positive integer, got {serial!r}")
        p = Path(path)
        needs_newline = p.exists() and p.stat().st_size > 0 and not p.read_bytes().endswith(b"\n")
        note = f"  # {comment.splitlines()[0]}" if comment else ""
        with p.open("a", encoding="utf-8") as fh:
            fh.write(("\n" if needs_newline else "") + f"{serial}{note}\n")

    def __contains__(self, serial: Any) -> bool:
        return serial in self.serials

    def __iter__(self) -> Any:
        return iter(sorted(self.serials))

    def __len__(self) -> int:
        return len(self.serials)

    def __repr__(self) -> str:
        return f"RevocationList({len(self.serials)} serials, path={self.path})"


class RevocationWatcher:
    """Re-reads a revocation list when its file changes (mtime, size or inode).

    `current()` is cheap (one stat) and always returns the last list that parsed; a
    malformed edit is logged and ignored until fixed, so a typo never un-revokes anyone.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int, int] | None = None
        self._list = RevocationList((), self.path)
        self.current()

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def current(self) -> RevocationList:
        """The up-to-date list (re-read only if the file changed since the last call)."""
        stamp = self._stat()
        if stamp != self._stamp:
            try:
                self._list = RevocationList.load(self.path)
                log.info("event=revocation_list_loaded path=%s serials=%d",
                         self.path, len(self._list))
            except (ValueError, OSError) as exc:
                log.error("event=revocation_list_invalid path=%s error=%s "
                          "action=keeping_previous_list", self.path, exc)
            self._stamp = stamp
        return self._list


@dataclass(frozen=True)
class RevocationSet(_CertSchema):
    """What a CA-signed revocation list asserts: every revoked serial as of ``issued_at``."""

    TYPE: ClassVar[str] = "RevocationSet"
    serials: tuple[int, ...] = spec(ListOf(Int(1, I64_MAX), max_items=MAX_REVOKED_SERIALS))
    issued_at: int = spec(Int(0, I64_MAX))


@dataclass(frozen=True)
class _SignedRevocations(_CertSchema):
    TYPE: ClassVar[str] = "SignedRevocations"
    tbs: bytes = spec(Bin(MAX_REVOCATIONS_BYTES, 1))
    signature: bytes = spec(Bin(64, exact=(64,)))


def sign_revocations(ca_private: Ed25519PrivateKey, serials: Iterable[int], issued_at: int) -> bytes:
    """A revocation list signed by the federation CA (cumulative: every revoked serial)."""
    body = RevocationSet(serials=tuple(sorted(set(serials))), issued_at=int(issued_at))
    tbs = pack(body.to_map())
    return pack(_SignedRevocations(tbs=tbs, signature=ca_private.sign(REVOCATIONS_DOMAIN + tbs)).to_map())


def verify_revocations(data: bytes, ca_public: Ed25519PublicKey | bytes) -> RevocationSet:
    """The revocation set in ``data`` if the federation CA signed it; ForeignCertificate or
    ProtocolError (malformed, too large) otherwise."""
    outer = from_map(_CertSchema.REGISTRY, unpack_limited(data, MAX_REVOCATIONS_BYTES + 1024))
    if not isinstance(outer, _SignedRevocations):
        raise ProtocolError("expected a SignedRevocations")
    try:
        _public_key(ca_public).verify(outer.signature, REVOCATIONS_DOMAIN + outer.tbs)
    except InvalidSignature:
        raise ForeignCertificate("revocation list is not signed by this federation's CA") from None
    inner = from_map(_CertSchema.REGISTRY, unpack_limited(outer.tbs, MAX_REVOCATIONS_BYTES))
    if not isinstance(inner, RevocationSet):
        raise ProtocolError("the signed part is not a RevocationSet")
    return inner
