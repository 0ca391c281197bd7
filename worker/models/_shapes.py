"""Shape helpers shared by the convolutional models."""

from __future__ import annotations

import torch
from torch import nn


def image_shape(input_shape: tuple[int, ...], model: str) -> tuple[int, int, int]:
    """Return (channels, height, width); a 2-D shape is read as one channel."""
    shape = tuple(int(d) for d in input_shape)
    if len(shape) == 2:
        shape = (1, *shape)
    if len(shape) != 3:
        raise ValueError(
            f"model {model} needs image inputs shaped (channels, height, width), got "
            f"input_shape {tuple(input_shape)}; use model 'mlp' for flat features"
        )
    return shape[0], shape[1], shape[2]


def flat_size(features: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Number of features `features` produces for one input of `input_shape`."""
    with torch.no_grad():
        return int(features(torch.zeros(1, *input_shape)).shape[1])
