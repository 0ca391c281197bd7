"""Models: a registry of built-in networks (mlp, cnn, lenet) and user `package.module:Class`."""

from .registry import (
    MODEL_NAMES,
    MODELS,
    ModelError,
    build_model,
    count_parameters,
    reset_parameters,
)

__all__ = [
    "MODELS",
    "MODEL_NAMES",
    "ModelError",
    "build_model",
    "count_parameters",
    "reset_parameters",
]
