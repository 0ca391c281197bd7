"""What a client's actor hands back: model weights plus the sample count behind them.

Inside one cluster a message is a Python object behind an object reference; between
clusters the engine sends it as an update payload (`worker.payload`). Nothing is pickled
on any wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np


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
    #: per sample of the client's test split, whether the model trained there got it
    #: right (the job's last personalized accuracy is scored against its final model)
    held_out_hits: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))


def as_message(value: Message | Mapping[str, np.ndarray]) -> Message:
    """A `Message` for either a message or a bare weights dict (a model broadcast)."""
    if isinstance(value, Message):
        return value
    if isinstance(value, Mapping):
        return Message(weights=value, num_samples=0)
    raise TypeError(f"expected a Message or a weights dict, got {type(value).__name__}")
