"""Models as users would bring them (`model.name = "usercnn:SmallCNN"`, ...), not among
worker/models' built-ins on purpose; bench_learning trains them on MNIST and the tests
train them through the engine.

- SmallCNN: two 3x3 conv layers (16 and 32 channels), each followed by a 2x2 max-pool,
  then 64 hidden units.
- WideCNN: two 5x5 conv layers (32 and 64 channels) and 128 hidden units: weights of a
  smaller scale than SmallCNN's (more fan-in per unit).
- BNCNN: conv + BatchNorm blocks and dropout before the classifier, the kind most users
  write: running statistics (buffers) and a train/eval difference.
- WideBNCNN: WideCNN with BatchNorm everywhere and dropout 0.5.
- BNMLP: any input flattened, two BatchNorm + dropout layers (tables and images alike).
- GNResCNN: GroupNorm and residual blocks, global pooling, a LayerNorm + GELU head and
  dropout: normalization with no running statistics, and no bias in the convolutions.
- LNMLP: any input flattened, LayerNorm + GELU layers (a transformer's MLP block).
- TinyCNN: two 5x5 conv layers of stride 2 (8, 16 channels), a linear head, 11k parameters:
  the size differential privacy favours (its noise grows with the square root of the
  parameters; docs/security.md, "Privacy").
- BNResCNN: a BatchNorm residual block with Dropout2d and SiLU, global average pooling.
- Conv1dBN: one 1-D convolution over the flattened features, BatchNorm, adaptive max-pool
  (tables and images alike).
- GRURows: a GRU (64 hidden) over the input's rows (an image's rows, a table as one row),
  dropout and a linear head: a recurrent model.
- PatchTransformer: the rows as tokens, two pre-LayerNorm transformer encoder layers
  (4 heads, GELU, dropout), mean pooling: attention and LayerNorm.
- DWSepNet: MobileNet-style depthwise-separable blocks, bias-free convolutions with
  BatchNorm and ReLU6, global average pooling, dropout.
- KaimingMLP: any input flattened, three BatchNorm + SiLU + dropout layers, initialized by
  the user (Kaiming-normal weights, zero biases) instead of torch's defaults.
- SmallInitCNN: SmallCNN's first block and head, every weight drawn 100 x smaller than
  torch's default (normal, std 0.01) and zero biases: a user's init that starts on a
  plateau (outputs near zero, the loss a hair below a uniform guess's for many steps).
- KerasBNCNN: BNCNN with Keras's BatchNorm momentum (running averages keep 0.99 a step;
  torch's keep 0.9), as a model ported from Keras has them.
GNResCNN and LNMLP (stop 51), BNResCNN and Conv1dBN (stop 58), GRURows and PatchTransformer
(stop 59), DWSepNet and KaimingMLP (stop 67), SmallInitCNN and KerasBNCNN (stops 75-76)
came after the engine's defaults were set and are not in the grid's default models:
`--models usercnn:GNResCNN` runs them (docs/job.md, "Does it learn?").
"""

from __future__ import annotations

import math

import torch
from torch import nn


def _chw(input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    c, h, w = input_shape if len(input_shape) == 3 else (1, *input_shape)
    return int(c), int(h), int(w)


def _width(input_shape: tuple[int, ...]) -> int:
    """Features of one sample, flattened."""
    return math.prod(int(d) for d in input_shape)


class SmallCNN(nn.Module):
    """Two conv layers and two dense layers, for (channels, height, width) images."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = self.shape = _chw(input_shape)
        self.net = nn.Sequential(
            nn.Conv2d(c, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * (h // 4) * (w // 4), 64), nn.ReLU(),
            nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.reshape(x.shape[0], *self.shape))


class WideCNN(nn.Module):
    """Two 5x5 conv layers (32, 64 channels), 128 hidden units."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = self.shape = _chw(input_shape)
        self.net = nn.Sequential(
            nn.Conv2d(c, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * (h // 4) * (w // 4), 128), nn.ReLU(),
            nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.reshape(x.shape[0], *self.shape))


class BNCNN(nn.Module):
    """Conv-BatchNorm-ReLU blocks, dropout 0.25 before the classifier."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = self.shape = _chw(input_shape)
        self.net = nn.Sequential(
            nn.Conv2d(c, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Dropout(0.25), nn.Linear(32 * (h // 4) * (w // 4), 64),
            nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.25), nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.reshape(x.shape[0], *self.shape))


class KerasBNCNN(BNCNN):
    """BNCNN as ported from Keras, whose BatchNormalization keeps 0.99 of its running
    averages each step (torch's momentum 0.01, not 0.1): after a few local steps they still
    describe the initial model, and a model evaluated on them is wrong (digits beta 0.3,
    20 clients, seed 0: the reference loop, which averages them, 0.23-0.40 in rounds 1-3,
    then at chance from round 5 to the end, 0.109; every engine job 0.983-0.992 on
    statistics measured for the model it serves; centralized 0.989)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__(input_shape, num_classes)
        for m in self.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.momentum = 0.01


class WideBNCNN(nn.Module):
    """WideCNN with BatchNorm after every conv and dense layer and dropout 0.5."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = self.shape = _chw(input_shape)
        self.net = nn.Sequential(
            nn.Conv2d(c, 32, 5, padding=2), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * (h // 4) * (w // 4), 128), nn.BatchNorm1d(128),
            nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.reshape(x.shape[0], *self.shape))


class TutorialCNN(nn.Module):
    """The tutorials' MNIST CNN: two 3x3 conv layers without bias (32, 64 channels), each
    with BatchNorm, ReLU and a 2x2 max-pool, 128 dense units and dropout 0.5. At sgd 0.05
    with momentum 0.9 (the defaults) its units die within 20 steps, centralized too
    (worker.training.learning_rate_trial)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = self.shape = _chw(input_shape)
        self.features = nn.Sequential(
            nn.Conv2d(c, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
            nn.MaxPool2d(2))
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * (h // 4) * (w // 4), 128), nn.ReLU(), nn.Dropout(0.5),
            nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x.reshape(x.shape[0], *self.shape)))


class BNMLP(nn.Module):
    """Any input flattened; 128 hidden units with BatchNorm and dropout 0.25, twice."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        width = _width(input_shape)
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(width, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.25),
            nn.Linear(128, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.25),
            nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _Residual(nn.Module):
    """x + two 3x3 conv-GroupNorm layers, then ReLU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.GroupNorm(4, channels),
            nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.GroupNorm(4, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


class GNResCNN(nn.Module):
    """A GroupNorm stem, two residual blocks around a 2x2 max-pool, 2x2 average pooling,
    dropout 0.3 and a LayerNorm + GELU head."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = self.shape = _chw(input_shape)
        self.net = nn.Sequential(
            nn.Conv2d(c, 24, 3, padding=1), nn.GroupNorm(4, 24), nn.ReLU(),
            _Residual(24), nn.MaxPool2d(2), _Residual(24), nn.AdaptiveAvgPool2d(2),
            nn.Flatten(), nn.Dropout(0.3), nn.Linear(96, 48), nn.LayerNorm(48), nn.GELU(),
            nn.Linear(48, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.reshape(x.shape[0], *self.shape))


class LNMLP(nn.Module):
    """Any input flattened; 256 then 64 hidden units, each with LayerNorm and GELU."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        width = _width(input_shape)
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(width, 256), nn.LayerNorm(256), nn.GELU(), nn.Dropout(0.1),
            nn.Linear(256, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

class BNResCNN(nn.Module):
    """A conv-BatchNorm-SiLU stem, one residual block (two 3x3 conv-BatchNorm layers with
    Dropout2d 0.1 between), global average pooling, dropout 0.2 and a linear head."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = self.shape = _chw(input_shape)
        self.stem = nn.Sequential(nn.Conv2d(c, 24, 3, padding=1), nn.BatchNorm2d(24), nn.SiLU())
        self.block = nn.Sequential(
            nn.Conv2d(24, 24, 3, padding=1), nn.BatchNorm2d(24), nn.SiLU(), nn.Dropout2d(0.1),
            nn.Conv2d(24, 24, 3, padding=1), nn.BatchNorm2d(24))
        self.head = nn.Sequential(nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Dropout(0.2), nn.Linear(24, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x.reshape(x.shape[0], *self.shape))
        return self.head(h + self.block(h))


class Conv1dBN(nn.Module):
    """The flattened features as one 1-D signal: a 5-tap convolution (8 channels),
    BatchNorm, ReLU, adaptive max-pooling to 8 and a linear head."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(1, 8, 5, padding=2), nn.BatchNorm1d(8), nn.ReLU(),
            nn.AdaptiveMaxPool1d(8), nn.Flatten(), nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.reshape(x.shape[0], 1, -1))


class TinyCNN(nn.Module):
    """Two 5x5 conv layers of stride 2 (8 and 16 channels) and one linear layer: about
    11,000 parameters for 28x28 digits (SmallCNN: 106,000)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = self.shape = _chw(input_shape)
        self.net = nn.Sequential(
            nn.Conv2d(c, 8, 5, stride=2, padding=2), nn.ReLU(),
            nn.Conv2d(8, 16, 5, stride=2, padding=2), nn.ReLU(),
            nn.Flatten(), nn.Linear(16 * ((h + 3) // 4) * ((w + 3) // 4), num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.reshape(x.shape[0], *self.shape))


def _rows(input_shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, features per row): an image's height x (channels * width); a table's
    features as one row."""
    if len(input_shape) == 3:
        c, h, w = input_shape
        return int(h), int(c * w)
    if len(input_shape) == 2:
        return int(input_shape[0]), int(input_shape[1])
    return 1, int(math.prod(input_shape))


class GRURows(nn.Module):
    """A GRU (64 hidden) over the rows of the input, its last state through dropout 0.2
    into a linear head."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.rows, self.width = _rows(input_shape)
        self.gru = nn.GRU(self.width, 64, batch_first=True)
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _out, h = self.gru(x.reshape(x.shape[0], self.rows, self.width))
        return self.head(h[-1])


class PatchTransformer(nn.Module):
    """Rows as tokens (linear embedding to 48), a learned position embedding, two
    pre-LayerNorm transformer encoder layers (4 heads, GELU, dropout 0.1), mean pooling,
    LayerNorm and a linear head."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.rows, self.width = _rows(input_shape)
        self.embed = nn.Linear(self.width, 48)
        self.position = nn.Parameter(torch.zeros(1, self.rows, 48))
        layer = nn.TransformerEncoderLayer(48, 4, 96, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(48), nn.Linear(48, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.reshape(x.shape[0], self.rows, self.width)) + self.position
        return self.head(self.encoder(tokens).mean(dim=1))


class DWSepNet(nn.Module):
    """MobileNet-style: a 3x3 stem and three depthwise-separable blocks (the second of
    stride 2), bias-free convolutions each followed by BatchNorm and ReLU6, global average
    pooling, dropout 0.2 and a linear head."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = self.shape = _chw(input_shape)

        def separable(cin: int, cout: int, stride: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False),
                    nn.BatchNorm2d(cin), nn.ReLU6(),
                    nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU6()]

        self.net = nn.Sequential(
            nn.Conv2d(c, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
            *separable(16, 32, 1), *separable(32, 64, 2), *separable(64, 64, 1),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.reshape(x.shape[0], *self.shape))


class KaimingMLP(nn.Module):
    """Any input flattened, three hidden layers (256, 128, 64) of Linear, BatchNorm, SiLU
    and dropout 0.3, with the user's own initialization: Kaiming-normal weights, zero
    biases."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = _width(input_shape)
        for out in (256, 128, 64):
            layers += [nn.Linear(width, out), nn.BatchNorm1d(out), nn.SiLU(), nn.Dropout(0.3)]
            width = out
        self.net = nn.Sequential(nn.Flatten(), *layers, nn.Linear(width, num_classes))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallInitCNN(nn.Module):
    """One 3x3 conv layer (16 channels), a 2x2 max-pool, 64 hidden units: every weight
    normal with std 0.01, every bias zero (the user's own init, kept by build_model)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = self.shape = _chw(input_shape)
        self.net = nn.Sequential(
            nn.Conv2d(c, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(16 * (h // 2) * (w // 2), 64), nn.ReLU(),
            nn.Linear(64, num_classes))
        for module in self.modules():
            if isinstance(module, nn.Conv2d | nn.Linear):
                nn.init.normal_(module.weight, std=0.01)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.reshape(x.shape[0], *self.shape))
