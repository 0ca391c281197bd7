"""LeNet-5, padded so that small inputs (8x8 digits) keep a spatial extent through both pools."""

from __future__ import annotations

import torch
from torch import nn

from ._shapes import flat_size, image_shape


class LeNet(nn.Module):
    """conv5(6) -> pool -> conv5(16) -> pool -> 120 -> 84 -> num_classes, ReLU activations.

    Both convolutions use padding 2 ("same"), so an 8x8 input becomes 16 maps of 2x2.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        channels, height, width = image_shape(input_shape, "lenet")
        self._image = (channels, height, width)
        if min(height, width) < 4:
            raise ValueError(
                f"model lenet needs inputs of at least 4x4 pixels, got {height}x{width}"
            )
        self.features = nn.Sequential(
            nn.Conv2d(channels, 6, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(flat_size(self.features, self._image), 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x.reshape(x.shape[0], *self._image)))
