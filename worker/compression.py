"""Lossy and lossless encodings of weights (or weight updates) for inter-cluster transfer.

Every encoding is a set of tensors (quantized values, scales, top-k indices and values)
plus string metadata describing how to rebuild each original tensor; the update payload
(worker/payload.py) carries both as one safetensors blob. Nothing is ever pickled.

Methods:
- `none`: tensors as they are.
- `fp16`: floating tensors as float16 (values beyond the float16 range are clipped).
- `int8`: floating tensors as int8 with one float32 scale per tensor (max |x| / 127);
  the rounding error of each element is at most scale / 2.
- `topk`: per floating tensor the `ceil(topk_ratio * size)` entries of largest magnitude,
  with error feedback: what was not sent is kept in `state` and added to the next call, so
  over many calls the sum of what is transmitted tracks the sum of the true inputs. Meant
  for updates (deltas), where dropping small entries is harmless.
Non-floating tensors (counters) always travel unchanged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import numpy as np

from worker.errors import WorkerError

METHODS = ("none", "fp16", "int8", "topk")
FORMAT_VERSION = "1"
_FP16_MAX = float(np.finfo(np.float16).max)
MAX_ELEMENTS = 1 << 28  # values one decoded blob may declare (1 GiB of float32)

Weights = dict[str, np.ndarray]
# Error-feedback residuals of `topk`, by tensor name (empty for the other methods).
CompressionState = dict[str, np.ndarray]


class CompressionError(WorkerError, ValueError):
    """A method, setting or encoded blob is unusable; the message says which and why."""


def compress_tensors(
    weights: Mapping[str, np.ndarray],
    method: str,
    *,
    state: CompressionState | None = None,
    topk_ratio: float = 0.1,
) -> tuple[Weights, dict[str, str], CompressionState]:
    """Encode `weights` with `method`: the tensors to send, the metadata that says how to
    rebuild them (the update payload adds its own fields to the same header), and the
    state for next time. `state` is only used by `topk` (error feedback): pass back what
    the previous call returned for the same stream of updates. Inputs are never modified."""
    if method not in METHODS:
        raise CompressionError(
            f"transfer.compression {method!r} is unknown; use one of {', '.join(METHODS)}"
        )
    if method == "topk" and not (0.0 < topk_ratio <= 1.0):
        raise CompressionError(f"transfer.topk_ratio must be in (0, 1], got {topk_ratio!r}")
    tensors: Weights = {}
    layout: dict[str, dict[str, object]] = {}
    new_state: CompressionState = {}
    for name, value in weights.items():
        arr = np.asarray(value)
        info: dict[str, object] = {"dtype": arr.dtype.str, "shape": list(arr.shape)}
        if method == "none" or not np.issubdtype(arr.dtype, np.floating):
            info["kind"] = "dense"
            tensors[f"d/{name}"] = arr
        elif method == "fp16":
            info["kind"] = "fp16"
            tensors[f"h/{name}"] = np.clip(arr, -_FP16_MAX, _FP16_MAX).astype(np.float16)
        elif method == "int8":
            info["kind"] = "int8"
            q, scale = _quantize_int8(arr)
            tensors[f"q/{name}"], tensors[f"s/{name}"] = q, scale
        else:
            info["kind"] = "topk"
            residual = (state or {}).get(name)
            idx, vals, rest = _topk(arr, residual, topk_ratio)
            tensors[f"i/{name}"], tensors[f"v/{name}"] = idx, vals
            new_state[name] = rest
        layout[name] = info
    metadata = {"compression": method, "format": FORMAT_VERSION, "layout": json.dumps(layout)}
    return tensors, metadata, new_state


def decompress_tensors(tensors: Mapping[str, np.ndarray], meta: Mapping[str, str], *,
                       max_elements: int = MAX_ELEMENTS) -> Weights:
    """Rebuild the weights from `compress_tensors`' tensors and metadata (as parsed from
    an update payload), dtypes and shapes restored. Raises `CompressionError` for anything
    malformed: an unknown method or format, missing tensors, out-of-range indices, or a
    layout declaring more than `max_elements` values in all (a sparse update cannot make
    us allocate without bound)."""
    method, version = meta.get("compression"), meta.get("format")
    if method not in METHODS or version != FORMAT_VERSION:
        raise CompressionError(
            f"compressed update has compression={method!r} format={version!r}; expected one of "
            f"{', '.join(METHODS)} with format {FORMAT_VERSION}"
        )
    try:
        layout = json.loads(meta.get("layout", ""))
        if not isinstance(layout, dict):
            raise ValueError("not a map")
    except ValueError as exc:
        raise CompressionError(f"compressed update has an unreadable layout ({exc})") from None
    declared = 0
    out: Weights = {}
    for name, info in layout.items():
        out[name] = _rebuild(name, info, tensors, max_elements - declared)
        declared += out[name].size
    return out


def _quantize_int8(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = arr.astype(np.float64)
    finite = np.isfinite(x)
    peak = float(np.max(np.abs(x[finite]))) if finite.any() else 0.0
    # NaN becomes 0 and +-inf the largest finite magnitude, so the scale stays meaningful.
    x = np.clip(np.where(np.isnan(x), 0.0, x), -peak, peak)
    scale = peak / 127.0 if peak > 0 else 1.0
    q = np.clip(np.rint(x / scale), -127, 127).astype(np.int8)
    return q, np.array(scale, dtype=np.float32)


def _topk(
    arr: np.ndarray, residual: np.ndarray | None, ratio: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    acc = arr.astype(np.float64).ravel()
    if residual is not None:
        if residual.size != acc.size:
            raise CompressionError(
                f"topk state holds {residual.size} values but the tensor has {acc.size}; "
                "start a new state when the model changes"
            )
        acc = acc + residual.ravel()
    k = min(acc.size, max(1, math.ceil(ratio * acc.size))) if acc.size else 0
    idx = np.argpartition(np.abs(acc), acc.size - k)[acc.size - k :] if k else np.zeros(0, int)
    idx = np.sort(idx)
    vals = acc[idx].astype(arr.dtype)
    rest = acc.copy()
    rest[idx] -= vals.astype(np.float64)  # what rounding to the wire dtype lost stays too
    index_dtype = np.int32 if acc.size < 2**31 else np.int64
    return idx.astype(index_dtype), vals, rest.reshape(arr.shape)


def _rebuild(
    name: str, info: object, tensors: Mapping[str, np.ndarray], budget: int
) -> np.ndarray:
    if not isinstance(info, dict):
        raise CompressionError(f"compressed update: layout of {name!r} is not a map")
    try:
        dtype = np.dtype(str(info["dtype"]))
        shape = tuple(int(d) for d in info["shape"])
        kind = info["kind"]
    except (KeyError, TypeError, ValueError) as exc:
        raise CompressionError(f"compressed update: layout of {name!r} is malformed ({exc})") from None
    if dtype.kind not in "biuf":
        raise CompressionError(
            f"compressed update: tensor {name!r} claims dtype {dtype}; only numeric dtypes travel"
        )
    if any(d < 0 for d in shape):
        raise CompressionError(f"compressed update: tensor {name!r} has negative shape {shape}")
    size = math.prod(shape)
    if size > budget:
        raise CompressionError(
            f"compressed update: tensor {name!r} declares {size} values, more than the "
            f"{budget} left of the limit; refusing to allocate it"
        )

    def part(prefix: str) -> np.ndarray:
        key = f"{prefix}/{name}"
        if key not in tensors:
            raise CompressionError(f"compressed update: tensor {key!r} is missing for {name!r}")
        return tensors[key]

    if kind == "dense":
        out = part("d")
    elif kind == "fp16":
        out = part("h")
    elif kind == "int8":
        out = part("q").astype(np.float64) * float(part("s"))
    elif kind == "topk":
        idx, vals = part("i").astype(np.int64), part("v")
        if idx.shape != vals.shape or idx.ndim != 1:
            raise CompressionError(f"compressed update: topk parts of {name!r} disagree in shape")
        if idx.size and (idx.min() < 0 or idx.max() >= size):
            raise CompressionError(f"compressed update: topk index out of range for {name!r}")
        flat = np.zeros(size, dtype=dtype)
        flat[idx] = vals
        out = flat
    else:
        raise CompressionError(f"compressed update: tensor {name!r} has unknown kind {kind!r}")
    if out.size != size:
        raise CompressionError(
            f"compressed update: tensor {name!r} has {out.size} values, layout says shape {shape}"
        )
    return np.asarray(out).astype(dtype).reshape(shape)
