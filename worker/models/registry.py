"""Model registry: config names -> constructors, plus user classes named `package.module:Class`.

Every model is initialised deterministically from `seed` without disturbing the process's
global random state: it is built with torch's, numpy's and Python's global generators seeded
from `seed` and restored afterwards. A built-in's standard layers are then re-initialised from
a private `torch.Generator`; a user class keeps the initialisation its own code gave it
(its own scheme, zero-initialised last layers, weights it loaded).
"""

from __future__ import annotations

import difflib
import importlib
import logging
import math
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from worker.errors import WorkerError

from .cnn import CNN
from .lenet import LeNet
from .mlp import MLP

if TYPE_CHECKING:
    from proto.job import ModelSpec

log = logging.getLogger(__name__)

Builder = Callable[["ModelSpec", tuple[int, ...], int], nn.Module]

MODELS: dict[str, Builder] = {
    "mlp": lambda spec, shape, classes: MLP(shape, classes, hidden=int(spec.hidden)),
    "cnn": lambda spec, shape, classes: CNN(shape, classes),
    "lenet": lambda spec, shape, classes: LeNet(shape, classes),
}
MODEL_NAMES = tuple(MODELS)

#: torch's global generator: model construction and training forward passes of models
#: with dropout (`worker.training`) seed and draw from it one thread at a time, and restore
#: its state afterwards
GLOBAL_RNG = threading.Lock()


class ModelError(WorkerError, ValueError):
    """A model name or user class cannot be used; the message says what exists instead."""


def build_model(
    spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int, seed: int
) -> nn.Module:
    """Build the model `spec.name` for inputs of `input_shape` and `num_classes` outputs.

    The same (spec, shape, classes, seed) always gives identical weights. Unknown names
    raise `ModelError` listing the registered models and the `package.module:Class` form.
    """
    name = spec.name
    shape = tuple(int(d) for d in input_shape)
    if num_classes < 1:
        raise ModelError(f"model {name!r}: num_classes must be at least 1, got {num_classes}")
    builder = MODELS.get(name) or (_user_builder(name) if ":" in name else None)
    if builder is None:
        raise ModelError(
            f"unknown model {name!r}; use one of {', '.join(MODEL_NAMES)} "
            "or a user class as 'package.module:Class'"
        )
    with GLOBAL_RNG, torch.random.fork_rng(devices=[]), _seeded_global_rngs(seed):
        torch.manual_seed(seed)
        try:
            model = builder(spec, shape, num_classes)
        except ModelError:
            raise
        except (ValueError, TypeError) as exc:
            hint = ("; a model class is called as Class(input_shape, num_classes), e.g. "
                    f"Class({shape}, {num_classes})" if ":" in name
                    and isinstance(exc, TypeError) and "argument" in str(exc) else "")
            raise ModelError(f"model {name!r} cannot be built for input {shape}: {exc}"
                             f"{hint}") from None
        if not isinstance(model, nn.Module):
            raise ModelError(f"model {name!r} built a {type(model).__name__}, "
                             "not a torch.nn.Module")
        _materialize_lazy(name, model, shape)
    if name in MODELS:
        # a user's class keeps its own: the same on every cluster, built from the same seed
        reset_parameters(model, seed)
    log.debug("event=model_built name=%s params=%d seed=%d", name, count_parameters(model), seed)
    return model


@contextmanager
def _seeded_global_rngs(seed: int) -> Iterator[None]:
    """numpy's and Python's global generators seeded from `seed` (a user's model may draw
    its initial weights from them), restored afterwards; the caller holds GLOBAL_RNG."""
    py_state, np_state = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable scalars in `model`."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def batchnorm_layers(model: nn.Module) -> list[tuple[str, nn.modules.batchnorm._BatchNorm]]:
    """Every BatchNorm layer of `model` (1d, 2d, 3d, sync), with its name."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def batchnorm_tensors(model: nn.Module) -> frozenset[str]:
    """Names (as in the state dict) of every BatchNorm layer's weights and statistics."""
    return frozenset(f"{prefix}.{name}" if prefix else name
                     for prefix, module in batchnorm_layers(model)
                     for name in module.state_dict())


def reset_parameters(model: nn.Module, seed: int) -> None:
    """Re-initialise Linear and Conv layers as PyTorch does by default, from a private
    generator seeded with `seed` (other parameters are left as constructed)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d):
                nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5), generator=gen)
                if module.bias is not None:
                    fan_in = module.weight[0].numel()
                    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
                    nn.init.uniform_(module.bias, -bound, bound, generator=gen)


def _materialize_lazy(name: str, model: nn.Module, shape: tuple[int, ...]) -> None:
    """Shape a model's lazy layers (`nn.LazyLinear`, `nn.LazyConv2d`, ...) as torch's own
    recipe does: one forward pass of a batch of zeros, in eval mode (no running statistic
    moves) and without gradients, under the build's seeded generators, so every cluster
    gets the same weights. Their parameters have no size until then: training, the
    learning-rate trial and the state dict could not use them."""
    from torch.nn.parameter import is_lazy

    def unshaped() -> bool:
        return any(is_lazy(t) for t in (*model.parameters(), *model.buffers()))

    if not unshaped():
        return
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros((2, *shape), dtype=torch.float32))
    except Exception as exc:  # a user's forward: anything it raises is the user's to see
        raise ModelError(f"model {name!r} has lazy layers (nn.Lazy*), and one forward pass "
                         f"of a batch of shape {(2, *shape)} to shape them failed: "
                         f"{type(exc).__name__}: {exc}") from None
    finally:
        model.train(was_training)
    if unshaped():
        raise ModelError(f"model {name!r}: lazy layers (nn.Lazy*) its forward pass does "
                         "not use stay unshaped; give them their sizes or remove them")


def _user_builder(name: str) -> Builder:
    module_name, _, class_name = name.partition(":")
    if not module_name or not class_name:
        raise ModelError(f"model {name!r}: a user model is written 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelError(
            f"model {name!r}: cannot import module {module_name!r} ({exc}); make sure it is "
            "installed on every cluster"
        ) from None
    cls = getattr(module, class_name, None)
    if cls is None:
        # the module's own torch.nn.Module classes (not the ones it imports), closest first
        own = [k for k, v in vars(module).items() if isinstance(v, type)
               and issubclass(v, nn.Module) and v.__module__ == module.__name__]
        close = difflib.get_close_matches(class_name, own, n=max(1, len(own)), cutoff=0.0)
        raise ModelError(f"model {name!r}: module {module_name!r} has no attribute "
                         f"{class_name!r}; " + (f"its torch.nn.Module classes: {', '.join(close)}"
                                                if close else "it defines no torch.nn.Module "
                                                "class"))
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ModelError(f"model {name!r}: {class_name} is not a torch.nn.Module subclass")

    def build(spec: ModelSpec, shape: tuple[int, ...], classes: int) -> nn.Module:
        return cls(shape, classes)

    return build
