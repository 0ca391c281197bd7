"""The daemon's persistent libp2p identity (ed25519), stored in a 0600 file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.identity_utils import load_identity, save_identity
from libp2p.peer.id import ID

from fabricd.errors import FabricdError


class IdentityError(FabricdError):
    """The identity file is missing, unreadable, or too open."""


def create_identity(path: Path) -> KeyPair:
    """Write a new ed25519 identity to ``path`` (mode 0600) and return it."""
    key_pair = create_new_key_pair()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_identity(key_pair, path)
    os.chmod(path, 0o600)
    return key_pair


def read_identity(path: Path) -> KeyPair:
    """Load the identity at ``path``; refuse a file readable by group or others."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise IdentityError(f"{path}: identity key not found (run `fabricd init`)") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise IdentityError(
            f"{path}: identity key has mode {oct(mode & 0o777)}; run `chmod 600 {path}`"
        )
    try:
        return load_identity(path)
    except ValueError as exc:
        raise IdentityError(f"{path}: {exc}") from None


def peer_id_of(key_pair: KeyPair) -> ID:
    return ID.from_pubkey(key_pair.public_key)


def raw_private_key(key_pair: KeyPair) -> bytes:
    """The 32-byte ed25519 seed, for signing records with `cryptography`."""
    seed = bytes(key_pair.private_key.impl)  # type: ignore[attr-defined]
    if len(seed) != 32:
        raise IdentityError(f"identity key is not ed25519 (got {len(seed)}-byte key)")
    return seed
