"""A small convolutional network for (channels, height, width) inputs such as 8x8 digits."""

from __future__ import annotations

import torch
from torch import nn

from ._shapes import flat_size, image_shape


class CNN(nn.Module):
    """Two 3x3 conv layers (32, 64 channels, same padding), one 2x2 max-pool, two dense layers."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        channels, height, width = image_shape(input_shape, "cnn")
        self._image = (channels, height, width)
        self.features = nn.Sequential(
            nn.Conv2d(channels, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(flat_size(self.features, self._image), 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x.reshape(x.shape[0], *self._image)))
