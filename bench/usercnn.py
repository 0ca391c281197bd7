"""A model as a user would bring one (`model.name = "usercnn:SmallCNN"`): two 3x3 conv
layers (16 and 32 channels), each followed by a 2x2 max-pool, then 64 hidden units.
bench_learning trains it on MNIST; it is not one of worker/models' built-ins on purpose."""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    """Two conv layers and two dense layers, for (channels, height, width) images."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = input_shape if len(input_shape) == 3 else (1, *input_shape)
        self.shape = (c, h, w)
        self.net = nn.Sequential(
            nn.Conv2d(c, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * (h // 4) * (w // 4), 64), nn.ReLU(),
            nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.reshape(x.shape[0], *self.shape))
