"""A multi-layer perceptron over flattened inputs."""

from __future__ import annotations

import math

import torch
from torch import nn


class MLP(nn.Module):
    """Flatten -> Linear(hidden) -> ReLU -> Linear(num_classes)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 64) -> None:
        super().__init__()
        if hidden < 1:
            raise ValueError(f"model.hidden must be a positive integer, got {hidden}")
        features = math.prod(input_shape)
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
