"""What travels along a topology edge: model weights plus the sample count behind them.

Inside one cluster a message is a Python object behind an object reference; between
clusters it is safetensors bytes (`encode_message`/`decode_message`), the sample count
riding in the safetensors metadata. Nothing is ever pickled on a wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from worker.serialization import (
    SerializationError,
    bytes_metadata,
    bytes_to_weights,
    weights_to_bytes,
)

Weights = dict[str, np.ndarray]
SAMPLES_KEY = "fedpilot.samples"


@dataclass(frozen=True)
class Message:
    """Model weights and how many training samples they stand for (0 = a model broadcast)."""

    weights: Mapping[str, np.ndarray]
    num_samples: int = 0


@dataclass(frozen=True)
class LocalUpdate(Message):
    """A client's model after local training, with what it measured."""

    client_id: int = -1
    round: int = 0
    loss: float = 0.0
    local_accuracy: float = 0.0
    local_samples: int = 0
    extra: Mapping[str, float] = field(default_factory=dict)


def as_message(value: Message | Mapping[str, np.ndarray]) -> Message:
    """A `Message` for either a message or a bare weights dict (a model broadcast)."""
    if isinstance(value, Message):
        return value
    if isinstance(value, Mapping):
        return Message(weights=value, num_samples=0)
    raise TypeError(f"expected a Message or a weights dict, got {type(value).__name__}")


def weights_nbytes(weights: Mapping[str, np.ndarray]) -> int:
    """Bytes of tensor data in `weights` (what an intra-cluster reference stands for)."""
    return int(sum(np.asarray(v).nbytes for v in weights.values()))


def encode_message(value: Message | Mapping[str, np.ndarray]) -> bytes:
    """Safetensors bytes of the message's weights with its sample count as metadata."""
    message = as_message(value)
    return weights_to_bytes(message.weights, {SAMPLES_KEY: str(int(message.num_samples))})


def decode_message(data: bytes, *, source: str = "remote node") -> Message:
    """Inverse of `encode_message`; raises `SerializationError` naming `source` on bad bytes."""
    weights = bytes_to_weights(data)
    raw = bytes_metadata(data).get(SAMPLES_KEY, "0")
    try:
        samples = int(raw)
    except ValueError:
        raise SerializationError(
            f"message from {source}: metadata {SAMPLES_KEY}={raw!r} is not an integer"
        ) from None
    if samples < 0:
        raise SerializationError(f"message from {source}: negative sample count {samples}")
    return Message(weights=weights, num_samples=samples)
