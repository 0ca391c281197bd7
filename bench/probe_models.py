"""Probe models: oddities a user may bring, none of them in the grid or tuned on.

Run one as any user model, e.g. `bench/bench_learning.py --grid full --dataset digits
--models probe_models:KerasLikeVGG --betas 0.3 --clients 20 --seeds 0` (bench/ on
PYTHONPATH, as for `usercnn`). Stops 75-77 ran each on digits (beta 0.3, 20 clients,
seed 0; some on wine and breast-cancer at beta 0.1) against centralized training and the
reference FedAvg loop; what each found is in docs/job.md ("Stop 75" to "Stop 77").

Stop 75: NoTrackBN, ZeroHead, BNNoAffineMomNone, InstNormCNN, TinyInit, LazyMLP,
FrozenConv, ParamListNet. Stop 76: GroupNormCNN, LayerNormDropMLP, KerasLikeVGG, RowGRU,
WeightNormMLP, LogSoftmaxBNHead, SoftmaxOut. Stop 77: SpectralNormMLP, MaskedCounterMLP,
DoubleMLP, SiLUBNPostAct.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm
from usercnn import _chw, _width


def _image(x: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    return x.reshape(x.shape[0], *shape)


# ---- stop 75 ---------------------------------------------------------------------------

class ZeroHead(nn.Module):
    """An MLP whose classifier starts at zero (as ResNet recipes initialize it)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(_width(input_shape), 128), nn.ReLU())
        self.head = nn.Linear(128, num_classes)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class NoTrackBN(nn.Module):
    """BatchNorm without running statistics (batch statistics in eval too), dropout."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(_width(input_shape), 128),
                                 nn.BatchNorm1d(128, track_running_stats=False), nn.ReLU(),
                                 nn.Dropout(0.3), nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class BNNoAffineMomNone(nn.Module):
    """BatchNorm with affine=False, and a cumulative running average (momentum=None)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = self.shape = _chw(input_shape)
        self.net = nn.Sequential(
            nn.Conv2d(c, 16, 3, padding=1), nn.BatchNorm2d(16, affine=False, momentum=None),
            nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32, momentum=None), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(), nn.Dropout(0.25), nn.Linear(32 * (h // 4) * (w // 4), num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(_image(x, self.shape))


class LazyMLP(nn.Module):
    """nn.LazyLinear: its weights are shaped by the first forward pass."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.LazyLinear(128), nn.ReLU(),
                                 nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class InstNormCNN(nn.Module):
    """InstanceNorm2d with running statistics, and a constant buffer of the user's."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = self.shape = _chw(input_shape)
        self.register_buffer("scale", torch.tensor(1.0 / 16.0))
        self.net = nn.Sequential(
            nn.Conv2d(c, 16, 3, padding=1),
            nn.InstanceNorm2d(16, affine=True, track_running_stats=True), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * (h // 4) * (w // 4), num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(_image(x, self.shape) * self.scale * 16.0)


class TinyInit(nn.Module):
    """Weights drawn 100 x smaller than torch's default (a user's own init)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = self.shape = _chw(input_shape)
        self.net = nn.Sequential(
            nn.Conv2d(c, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(16 * (h // 2) * (w // 2), 64), nn.ReLU(),
            nn.Linear(64, num_classes))
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.normal_(m.weight, std=0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(_image(x, self.shape))


class FrozenConv(nn.Module):
    """Transfer-learning style: a frozen first conv (requires_grad False), a parameter
    forward never uses, and a layer used twice."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = self.shape = _chw(input_shape)
        self.conv = nn.Conv2d(c, 16, 3, padding=1)
        for p in self.conv.parameters():
            p.requires_grad_(False)
        self.unused = nn.Linear(5, 5)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(16 * (h // 2) * (w // 2), 64)
        self.tied = nn.Linear(64, 64)
        self.head = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.pool(torch.relu(self.conv(_image(x, self.shape))))
        z = torch.relu(self.fc(z.flatten(1)))
        z = torch.relu(self.tied(z)) + z
        z = torch.relu(self.tied(z))
        return self.head(z)


class ParamListNet(nn.Module):
    """Bare nn.Parameter / ParameterList layers (no nn.Linear), a learned temperature."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        d = _width(input_shape)
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(d, 64) / math.sqrt(d)),
                                    nn.Parameter(torch.randn(64, num_classes) / 8.0)])
        self.b = nn.Parameter(torch.zeros(64))
        self.temperature = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x.flatten(1) @ self.ws[0] + self.b)
        return (h @ self.ws[1]) * self.temperature


# ---- stop 76 ---------------------------------------------------------------------------

class GroupNormCNN(nn.Module):
    """GroupNorm (no buffers), GELU, dropout."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = self.shape = _chw(input_shape)
        self.net = nn.Sequential(
            nn.Conv2d(c, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.GELU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.GELU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Dropout(0.3), nn.Linear(64 * (h // 4) * (w // 4), num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(_image(x, self.shape))


class LayerNormDropMLP(nn.Module):
    """LayerNorm, SiLU and heavy dropout (0.5)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(_width(input_shape), 256), nn.LayerNorm(256), nn.SiLU(),
            nn.Dropout(0.5), nn.Linear(256, 128), nn.LayerNorm(128), nn.SiLU(),
            nn.Dropout(0.5), nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class KerasLikeVGG(nn.Module):
    """VGG-like: 4 bias-free convs with BatchNorm and Dropout2d, a BatchNorm1d head, and
    Keras's BatchNorm momentum (running averages keep 0.99 a step; torch's 0.9)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = self.shape = _chw(input_shape)

        def block(i: int, o: int) -> list[nn.Module]:
            return [nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o, momentum=0.01),
                    nn.ReLU()]

        self.net = nn.Sequential(
            *block(c, 32), *block(32, 32), nn.MaxPool2d(2), nn.Dropout2d(0.1),
            *block(32, 64), *block(64, 64), nn.MaxPool2d(2), nn.Dropout2d(0.1),
            nn.Flatten(), nn.Linear(64 * (h // 4) * (w // 4), 128, bias=False),
            nn.BatchNorm1d(128, momentum=0.01), nn.ReLU(), nn.Dropout(0.4),
            nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(_image(x, self.shape))


class RowGRU(nn.Module):
    """A GRU over an image's rows, its last state to a linear head (no dropout)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = self.shape = _chw(input_shape)
        self.gru = nn.GRU(c * w, 64, batch_first=True)
        self.head = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _image(x, self.shape).permute(0, 2, 1, 3).flatten(2)  # (batch, h, c * w)
        out, _ = self.gru(rows)
        return self.head(out[:, -1])


class WeightNormMLP(nn.Module):
    """Parametrized weights (weight_norm): state-dict names under `parametrizations.`."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), weight_norm(nn.Linear(_width(input_shape), 128)),
                                 nn.ReLU(), weight_norm(nn.Linear(128, num_classes)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class LogSoftmaxBNHead(nn.Module):
    """Returns log-probabilities; BatchNorm on the hidden layer and on the logits."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(_width(input_shape), 128),
                                 nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, num_classes),
                                 nn.BatchNorm1d(num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.net(x), dim=1)


class SoftmaxOut(nn.Module):
    """Returns probabilities (a final Softmax), not logits: `plan` / `submit` warn."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(_width(input_shape), 128), nn.ReLU(),
                                 nn.Linear(128, num_classes), nn.Softmax(dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


# ---- stop 77 ---------------------------------------------------------------------------

class SpectralNormMLP(nn.Module):
    """Spectral normalization (parametrizations): power-iteration vectors `_u` / `_v` as
    buffers, updated by every forward in training mode and used as they are in eval."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        from torch.nn.utils.parametrizations import spectral_norm
        self.net = nn.Sequential(nn.Flatten(), spectral_norm(nn.Linear(_width(input_shape), 128)),
                                 nn.ReLU(), spectral_norm(nn.Linear(128, 128)), nn.ReLU(),
                                 nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class MaskedCounterMLP(nn.Module):
    """Non-float buffers: a bool pruning mask on the first layer's weights (constant) and
    an int64 count of training forwards (a user's own num_batches_tracked)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        width = _width(input_shape)
        self.fc1 = nn.Linear(width, 128)
        self.fc2 = nn.Linear(128, num_classes)
        gen = torch.Generator().manual_seed(7)
        self.register_buffer("mask", torch.rand(128, width, generator=gen) > 0.3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.steps += 1
        hidden = torch.relu(nn.functional.linear(x.flatten(1), self.fc1.weight * self.mask,
                                                 self.fc1.bias))
        return self.fc2(hidden)


class DoubleMLP(nn.Module):
    """float64 parameters (a user who calls `.double()`), casting its input itself."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(_width(input_shape), 128), nn.ReLU(),
                                 nn.Linear(128, num_classes)).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.double())


class SiLUBNPostAct(nn.Module):
    """BatchNorm after the activation (SiLU), Dropout before the first layer, and a
    bias-free classifier: layer orders the grid's models do not use."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Dropout(0.2),
                                 nn.Linear(_width(input_shape), 128), nn.SiLU(),
                                 nn.BatchNorm1d(128), nn.Linear(128, 64), nn.SiLU(),
                                 nn.BatchNorm1d(64), nn.Linear(64, num_classes, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

