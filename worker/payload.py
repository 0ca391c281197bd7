"""The update payload: one safetensors blob per message between clusters.

Its header carries everything the receiver needs besides the tensors: the message kind
(`up`, `down`, `peer`, `state`, `final`), the sample count behind the weights, and the
compression layout (written by `worker.compression`). `encode` writes it once at the
sender; `decode` parses the header once at the receiver and returns zero-copy views of
the tensors. Nothing here trusts the bytes: offsets, dtypes, shapes and sizes are checked
before any view is made, and nothing is ever unpickled.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from worker.serialization import SerializationError, weights_to_bytes

SAMPLES_KEY = "fedpilot.samples"
KIND_KEY = "fedpilot.kind"
MAX_HEADER_BYTES = 16 * 1024 * 1024

_DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": None, "I64": "<i8", "I32": "<i4",
    "I16": "<i2", "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1",
    "BOOL": "?",
}

Weights = dict[str, np.ndarray]


class PayloadError(SerializationError):
    """The bytes are not a well-formed update payload; the message says what is wrong."""


@dataclass(frozen=True)
class Payload:
    """A decoded payload: the tensors as sent (possibly compressed) and the header fields."""

    tensors: Weights
    metadata: Mapping[str, str]
    kind: str
    samples: int


def encode(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None, *,
           kind: str, samples: int) -> bytes:
    """The payload bytes of `tensors` with `metadata` plus kind and sample count."""
    if samples < 0:
        raise PayloadError(f"sample count must be >= 0, got {samples}")
    meta = {**(metadata or {}), KIND_KEY: kind, SAMPLES_KEY: str(int(samples))}
    return weights_to_bytes(tensors, meta)


def decode(data: bytes | bytearray | memoryview, *, source: str = "remote node") -> Payload:
    """Parse `data` once; raises `PayloadError` naming `source` on anything malformed."""
    tensors, meta = parse(data, source=source)
    kind = meta.get(KIND_KEY, "")
    raw = meta.get(SAMPLES_KEY, "")
    try:
        samples = int(raw)
    except ValueError:
        raise PayloadError(f"payload from {source}: {SAMPLES_KEY}={raw!r} is not an integer") from None
    if samples < 0:
        raise PayloadError(f"payload from {source}: negative sample count {samples}")
    if not kind:
        raise PayloadError(f"payload from {source} names no message kind ({KIND_KEY})")
    return Payload(tensors, meta, kind, samples)


def parse(data: bytes | bytearray | memoryview, *, source: str = "remote node"
          ) -> tuple[Weights, dict[str, str]]:
    """Tensors (read-only views into `data`) and string metadata of safetensors bytes."""
    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise PayloadError(f"payload from {source} is {len(view)} bytes, too short to hold "
                           "a safetensors header")
    (size,) = struct.unpack_from("<Q", view)
    if size > min(len(view) - 8, MAX_HEADER_BYTES):
        raise PayloadError(f"payload from {source} declares a {size}-byte header; "
                           f"{len(view) - 8} bytes follow (limit {MAX_HEADER_BYTES})")
    try:
        header = json.loads(bytes(view[8:8 + size]))
    except ValueError as exc:
        raise PayloadError(f"payload from {source}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise PayloadError(f"payload from {source}: header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise PayloadError(f"payload from {source}: __metadata__ must map strings to strings")
    body = view[8 + size:]
    tensors: Weights = {}
    for name, info in header.items():
        tensors[name] = _tensor(name, info, body, source)
    return tensors, {str(k): v for k, v in meta.items()}


def _tensor(name: str, info: object, body: memoryview, source: str) -> np.ndarray:
    where = f"payload from {source}: tensor {name!r}"
    if not isinstance(info, dict):
        raise PayloadError(f"{where} has no dtype/shape/data_offsets entry")
    dtype = _DTYPES.get(str(info.get("dtype")))
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if dtype is None:
        raise PayloadError(f"{where} has unsupported dtype {info.get('dtype')!r}")
    if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
            or not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)):
        raise PayloadError(f"{where} has a malformed shape or data_offsets")
    start, end = offsets
    itemsize = np.dtype(dtype).itemsize
    if not 0 <= start <= end <= len(body) or end - start != math.prod(shape) * itemsize:
        raise PayloadError(f"{where}: offsets {offsets} do not fit shape {shape} in a "
                           f"{len(body)}-byte body")
    return np.frombuffer(body[start:end], dtype=dtype).reshape(shape)
