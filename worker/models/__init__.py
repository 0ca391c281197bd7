"""Models: a registry of built-in networks (mlp, cnn, lenet) and user `package.module:Class`."""

from .registry import MODEL_NAMES, ModelError, batchnorm_tensors, build_model, count_parameters

__all__ = [
    "MODEL_NAMES",
    "ModelError",
    "batchnorm_tensors",
    "build_model",
    "count_parameters",
]
