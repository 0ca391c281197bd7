"""Model weights as safetensors bytes (never pickle) and conversions to/from torch state dicts.

`weights_to_bytes` needs only numpy (`worker.payload.parse` is the one reader of such bytes);
the state-dict helpers import torch when called.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import save as _st_save

from worker.errors import WorkerError

if TYPE_CHECKING:
    import torch

Weights = dict[str, np.ndarray]


class SerializationError(WorkerError, ValueError):
    """Bytes are not valid safetensors, or weights cannot be encoded; says which and why."""


def weights_to_bytes(
    weights: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> bytes:
    """Encode named numpy arrays (and optional string metadata) as safetensors bytes."""
    arrays: dict[str, np.ndarray] = {}
    for name, value in weights.items():
        if not isinstance(name, str) or not name:
            raise SerializationError(f"tensor names must be non-empty strings, got {name!r}")
        arr = np.asarray(value)
        if arr.dtype == object:
            raise SerializationError(f"tensor {name!r} has dtype object; only numeric arrays travel")
        # not np.ascontiguousarray: it turns 0-d arrays into 1-d ones
        arrays[name] = arr if arr.flags.c_contiguous else arr.copy(order="C")
    try:
        return _st_save(arrays, metadata=dict(metadata) if metadata else None)
    except (SafetensorError, ValueError, TypeError) as exc:
        raise SerializationError(f"cannot encode weights as safetensors: {exc}") from None


def state_dict_to_weights(state_dict: Mapping[str, torch.Tensor]) -> Weights:
    """Copy a torch state dict (parameters and buffers) into numpy arrays."""
    return {name: t.detach().cpu().numpy().copy() for name, t in state_dict.items()}


def weights_to_state_dict(weights: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Turn numpy weights into torch tensors for `model.load_state_dict` (copies the data)."""
    import torch

    return {name: torch.from_numpy(np.array(arr, copy=True)) for name, arr in weights.items()}


def finite(value: np.ndarray) -> bool:
    """No NaN or infinity in a floating tensor (any other kind is finite)."""
    return value.dtype.kind != "f" or bool(np.isfinite(value).all())


def nonfinite(weights: Mapping[str, np.ndarray]) -> str | None:
    """The first tensor of `weights` holding NaN or infinities, or None."""
    return next((name for name, value in weights.items() if not finite(np.asarray(value))), None)


def model_weights(model: torch.nn.Module) -> Weights:
    """The model's current state dict as numpy arrays."""
    return state_dict_to_weights(model.state_dict())


def load_weights(model: torch.nn.Module, weights: Mapping[str, np.ndarray]) -> None:
    """Load numpy weights into `model`; every name and shape must match exactly."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        raise SerializationError(
            f"weights do not fit {type(model).__name__}: missing {missing or 'none'}, "
            f"unexpected {extra or 'none'}"
        )
    for name, tensor in expected.items():
        if tuple(np.shape(weights[name])) != tuple(tensor.shape):
            raise SerializationError(
                f"weights do not fit {type(model).__name__}: {name} has shape "
                f"{tuple(np.shape(weights[name]))}, the model expects {tuple(tensor.shape)}"
            )
    model.load_state_dict(weights_to_state_dict(weights))
