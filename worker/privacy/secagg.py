"""Secure aggregation between clusters: the aggregator learns the sum of the contributions,
not any one of them (Bonawitz et al. 2017's pairwise masks, per cluster).

Every contributing cluster's executor holds an X25519 key pair; two clusters A and B share
`pair_secret(a, B)` (X25519, then HKDF-SHA256 bound to the job). A contribution is quantized
to fixed point in the ring Z_2^24 (`quantize`: values clipped to +-`clip_range`) and masked:
- a pair mask M_AB per round, expanded with ChaCha20 from A and B's secret, added by A and
  subtracted by B (to one of each cluster's contributions), so it cancels in the sum;
- inside a cluster, its contributions' masks telescope (R_1, R_2 - R_1, ..., -R_{k-1}, from
  the cluster's own secret, its X25519 with itself), so that each contribution is masked
  and the cluster's masks add up to its pair masks alone.
Summing every masked contribution mod 2^24 gives the sum of the quantized contributions
exactly; one masked contribution is uniform in the ring to whoever lacks the seeds. 2^24:
a ring element is an integer a float32 holds exactly, so a masked contribution travels as
a model of the job's shapes and dtype through the ordinary transport (which refuses
anything else); the sum keeps 22 bits: steps of clip_range / 2^22.
A cluster that drops after the masks were fixed: its X25519 private key is Shamir-shared
among the clusters at a threshold (`share_key`); any `threshold` survivors' shares rebuild
it (`combine_key`), and `dropped_correction` removes its pair masks from the survivors' sum.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

#: quantized values live in Z_2^24 (exact in float32); with weights summing to at most 1 the
#: sum stays within +-2^22 (arithmetic runs in uint32 and is reduced with RING_MASK)
RING_BITS = 24
RING_MASK = (1 << RING_BITS) - 1
_RANGE = 1 << (RING_BITS - 2)


def new_key() -> X25519PrivateKey:
    return X25519PrivateKey.generate()


def public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def pair_secret(key: X25519PrivateKey, peer_public: bytes, context: str) -> bytes:
    """The 32-byte secret two clusters share (a cluster with itself: its own secret),
    bound to `context` (the job id)."""
    shared = key.exchange(X25519PublicKey.from_public_bytes(peer_public))
    return HKDF(hashes.SHA256(), 32, salt=None,
                info=b"fedpilot-secagg/" + context.encode()).derive(shared)


def expand(secret: bytes, label: str, n: int) -> np.ndarray:
    """n uniform ring elements from ChaCha20 keyed by HKDF(secret, label) (a key per label,
    so a zero nonce is never reused)."""
    key = HKDF(hashes.SHA256(), 32, salt=None, info=label.encode()).derive(secret)
    stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
    return np.frombuffer(stream.update(bytes(4 * n)), dtype="<u4") & np.uint32(RING_MASK)


def scale(clip_range: float) -> float:
    """Fixed-point steps per unit: a value in +-clip_range maps into +-2^22."""
    return _RANGE / clip_range


def quantize(x: np.ndarray, weight: float, clip_range: float) -> tuple[np.ndarray, int]:
    """weight * clip(x, +-clip_range) in fixed point (a ring element, two's complement),
    and the number of coordinates clipped. Weights of one sum must add up to at most 1."""
    x = np.asarray(x, dtype=np.float64).ravel()
    clipped = int(np.count_nonzero(np.abs(x) > clip_range))
    q = np.rint(np.clip(x, -clip_range, clip_range) * (weight * scale(clip_range)))
    return (q.astype(np.int64) & RING_MASK).astype(np.uint32), clipped


def dequantize(total: np.ndarray, clip_range: float) -> np.ndarray:
    """The float64 value of a sum of `quantize`d contributions (mod 2^24)."""
    v = (np.asarray(total, dtype=np.uint32) & np.uint32(RING_MASK)).astype(np.int64)
    v[v >= 1 << (RING_BITS - 1)] -= 1 << RING_BITS
    return v / scale(clip_range)


def pair_mask(secret: bytes, low: str, high: str, tag: str, n: int) -> np.ndarray:
    """M between clusters `low` < `high` (sorted names) for contributions of round `tag`."""
    return expand(secret, f"{tag}/pair/{low}/{high}", n)


def cluster_masks(cluster: str, contributors: Sequence[str], clusters: Sequence[str],
                  secrets: Mapping[str, bytes], tag: str, n: int) -> dict[str, np.ndarray]:
    """The masks of `cluster`'s own `contributors` (this round's, in any order) when
    `clusters` (every cluster with a contribution in the sum, this one among them) take
    part. `secrets[c]` is this cluster's `pair_secret` with c (with itself: its own).
    The masks add up to sum_c +-M(cluster, c) mod 2^24; each one alone is uniform."""
    mine = sorted(contributors)
    if not mine:
        return {}
    masks = [np.zeros(n, dtype=np.uint32) for _ in mine]
    for other in clusters:
        if other == cluster:
            continue
        low, high = sorted((cluster, other))
        m = pair_mask(secrets[other], low, high, tag, n)
        masks[0] += m if cluster == low else np.uint32(0) - m
    own = secrets[cluster]
    for i, name in enumerate(mine[:-1]):
        r = expand(own, f"{tag}/self/{cluster}/{name}", n)
        masks[i] += r
        masks[i + 1] -= r
    return {name: m & np.uint32(RING_MASK) for name, m in zip(mine, masks, strict=True)}


def masked_sum(contributions: Sequence[np.ndarray]) -> np.ndarray:
    """The sum mod 2^24 of ring elements (what the aggregator computes)."""
    total = np.zeros(np.shape(contributions[0]), dtype=np.uint32)
    for c in contributions:
        total += np.asarray(c, dtype=np.uint32)
    return total & np.uint32(RING_MASK)


def mask(quantized: np.ndarray, m: np.ndarray) -> np.ndarray:
    """A quantized contribution plus its mask, in the ring."""
    return (quantized + m) & np.uint32(RING_MASK)


def dropped_correction(dropped: str, dropped_key: X25519PrivateKey,
                       survivors: Mapping[str, bytes], context: str, tag: str,
                       n: int) -> np.ndarray:
    """What to add to the survivors' masked sum to remove their pair masks with the
    `dropped` cluster (whose key was rebuilt from Shamir shares); `survivors` maps each
    surviving cluster to its public key."""
    fix = np.zeros(n, dtype=np.uint32)
    for other, public in survivors.items():
        low, high = sorted((dropped, other))
        m = pair_mask(pair_secret(dropped_key, public, context), low, high, tag, n)
        # the survivor added +M if it is `low`: take it away (and the reverse)
        fix += np.uint32(0) - m if other == low else m
    return fix & np.uint32(RING_MASK)


def share_key(key: X25519PrivateKey, threshold: int, count: int) -> list[tuple[int, bytes]]:
    """`count` Shamir shares of a private key (pycryptodome's GF(2^128) scheme on each
    16-byte half; a share is 32 bytes), any `threshold` of which rebuild it."""
    raw = private_bytes(key)
    low = Shamir.split(threshold, count, raw[:16])
    high = Shamir.split(threshold, count, raw[16:])
    return [(i, a + b) for (i, a), (_, b) in zip(low, high, strict=True)]


def combine_key(shares: Sequence[tuple[int, bytes]]) -> X25519PrivateKey:
    raw = (Shamir.combine([(i, s[:16]) for i, s in shares])
           + Shamir.combine([(i, s[16:]) for i, s in shares]))
    return X25519PrivateKey.from_private_bytes(raw)


__all__ = ["RING_BITS", "RING_MASK", "cluster_masks", "combine_key", "dequantize", "dropped_correction",
           "expand", "mask", "masked_sum", "new_key", "pair_mask", "pair_secret", "private_bytes",
           "public_bytes", "quantize", "scale", "share_key"]
