"""Weights travel as safetensors bytes: round trips, metadata, clear errors, no pickle."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from worker.payload import PayloadError, parse
from worker.serialization import (
    SerializationError,
    load_weights,
    model_weights,
    state_dict_to_weights,
    weights_to_bytes,
    weights_to_state_dict,
)


def test_round_trip_keeps_names_dtypes_values_and_metadata() -> None:
    weights: dict[str, np.ndarray] = {
        "a.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "a.bias": np.array([1.5, -2.0], dtype=np.float64),
        "steps": np.array(7, dtype=np.int64),
        "half": np.array([0.5, 0.25], dtype=np.float16),
        "strided": np.arange(10, dtype=np.float32)[::2],
    }
    data = weights_to_bytes(weights, metadata={"round": "3"})
    back, meta = parse(data)  # the one reader of weights bytes (update payloads)
    assert set(back) == set(weights)
    for name, arr in weights.items():
        assert back[name].dtype == arr.dtype and back[name].shape == arr.shape
        np.testing.assert_array_equal(back[name], arr)
    assert meta == {"round": "3"}


def test_encoding_is_safetensors_json_header_not_pickle() -> None:
    data = weights_to_bytes({"w": np.ones(2, dtype=np.float32)})
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    assert header["w"]["dtype"] == "F32" and header["w"]["shape"] == [2]
    assert b"\x80\x04" not in data[:2]


def test_garbage_and_object_arrays_fail_clearly() -> None:
    with pytest.raises(PayloadError, match="header"):
        parse(b"\x80\x04garbage-pickle-looking-bytes")
    with pytest.raises(PayloadError, match="too short"):
        parse(b"abc")
    with pytest.raises(SerializationError, match="dtype object"):
        weights_to_bytes({"x": np.array([{}], dtype=object)})


def test_state_dict_conversions_and_load_weights() -> None:
    model = torch.nn.Linear(3, 2)
    weights = state_dict_to_weights(model.state_dict())
    assert weights["weight"].shape == (2, 3) and weights["weight"].dtype == np.float32
    weights["weight"][:] = 1.0  # a copy, not a view of the model
    assert not torch.all(model.weight == 1.0)
    state = weights_to_state_dict(weights)
    assert isinstance(state["bias"], torch.Tensor)
    load_weights(model, weights)
    assert torch.all(model.weight == 1.0)
    np.testing.assert_array_equal(model_weights(model)["bias"], weights["bias"])


def test_load_weights_names_missing_and_misshapen_tensors() -> None:
    model = torch.nn.Linear(3, 2)
    weights = model_weights(model)
    with pytest.raises(SerializationError, match=r"missing \['bias'\]"):
        load_weights(model, {"weight": weights["weight"]})
    with pytest.raises(SerializationError, match=r"weight has shape \(3, 2\)"):
        load_weights(model, {"weight": weights["weight"].T, "bias": weights["bias"]})


def test_numpy_side_modules_do_not_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import worker.aggregators, worker.compression, worker.serialization\n"
        "print(','.join(m for m in ('torch', 'ray') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
