"""Transfer compression: round-trip error bounds, sizes, error feedback, malformed blobs."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from worker.compression import (
    METHODS,
    CompressionError,
    CompressionState,
    compress_tensors,
    decompress_tensors,
)
from worker.payload import parse
from worker.serialization import weights_to_bytes

Encoded = tuple[dict[str, np.ndarray], dict[str, str]]


def compress(weights: dict[str, np.ndarray], method: str, **kw: Any
             ) -> tuple[Encoded, CompressionState]:
    """What an update carries (tensors and metadata), and the state for next time."""
    tensors, meta, state = compress_tensors(weights, method, **kw)
    return (tensors, meta), state


def decompress(encoded: Encoded, **kw: Any) -> dict[str, np.ndarray]:
    return decompress_tensors(*encoded, **kw)


def sent(tensors: dict[str, np.ndarray], meta: dict[str, str]) -> Encoded:
    """Hand-made tensors and metadata as a receiver parses them off the wire."""
    return parse(weights_to_bytes(tensors, metadata=meta))


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "fc.weight": rng.normal(0, 1, (64, 32)).astype(np.float32),
        "fc.bias": rng.normal(0, 0.1, 32).astype(np.float32),
        "wide": rng.normal(0, 1, 7).astype(np.float64),
        "steps": np.array([5, 6], dtype=np.int64),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }


@pytest.mark.parametrize("method", METHODS)
def test_round_trip_restores_names_dtypes_shapes_and_counters(method: str) -> None:
    w = _weights()
    blob, _ = compress(w, method)
    back = decompress(blob)
    assert set(back) == set(w)
    for k in w:
        assert back[k].dtype == w[k].dtype and back[k].shape == w[k].shape, k
    np.testing.assert_array_equal(back["steps"], w["steps"])


def test_none_is_exact_and_fp16_int8_stay_within_their_bounds() -> None:
    w = _weights()
    exact = decompress(compress(w, "none")[0])
    for k in w:
        np.testing.assert_array_equal(exact[k], w[k])
    half = decompress(compress(w, "fp16")[0])
    for k in ("fc.weight", "fc.bias", "wide"):
        np.testing.assert_allclose(half[k], w[k], rtol=2.0**-11, atol=2.0**-24)
    quant = decompress(compress(w, "int8")[0])
    for k in ("fc.weight", "fc.bias", "wide"):
        scale = np.abs(w[k]).max() / 127.0
        err = np.abs(quant[k].astype(np.float64) - w[k])
        assert err.max() <= scale / 2 * (1 + 1e-6), k
        assert err.max() > 0  # it really is lossy


def test_sizes_shrink_as_promised() -> None:
    w = {"w": np.random.default_rng(1).normal(size=(256, 256)).astype(np.float32)}
    size = {m: len(weights_to_bytes(*compress(w, m, topk_ratio=0.01)[0])) for m in METHODS}
    raw = 256 * 256 * 4
    assert raw < size["none"] < raw + 400
    assert size["fp16"] < 0.51 * size["none"]
    assert size["int8"] < 0.26 * size["none"]
    assert size["topk"] < 0.03 * size["none"]  # 1 % of entries, 4-byte index + 4-byte value


def test_fp16_clips_instead_of_overflowing() -> None:
    back = decompress(compress({"x": np.array([1e6, -1e6], np.float32)}, "fp16")[0])
    assert np.all(np.isfinite(back["x"])) and back["x"][0] == pytest.approx(65504.0)


def test_topk_sends_the_largest_entries_and_keeps_the_rest() -> None:
    x = np.array([0.1, -5.0, 0.2, 3.0, -0.05, 0.0, 1.0, -0.3, 0.4, 2.0], dtype=np.float32)
    blob, state = compress({"x": x}, "topk", topk_ratio=0.3)
    got = decompress(blob)["x"]
    np.testing.assert_array_equal(np.flatnonzero(got), [1, 3, 9])
    np.testing.assert_allclose(got[[1, 3, 9]], [-5.0, 3.0, 2.0])
    np.testing.assert_allclose(state["x"], x - got, atol=1e-7)
    # next call adds the residual: 0.4 + 0.4 beats every fresh entry of 0.5 or less
    blob2, _ = compress({"x": np.full(10, 0.05, np.float32)}, "topk", state=state, topk_ratio=0.1)
    assert np.flatnonzero(decompress(blob2)["x"]).tolist() == [6]  # 1.0 + 0.05


def test_error_feedback_makes_transmitted_sum_track_true_sum() -> None:
    rng = np.random.default_rng(0)
    true_sum = np.zeros(500)
    sent_fb = np.zeros(500)
    sent_plain = np.zeros(500)
    state: dict[str, np.ndarray] = {}
    for _ in range(300):
        u = (rng.normal(0, 1, 500) + 0.2).astype(np.float32)
        true_sum += u
        blob, state = compress({"u": u}, "topk", state=state, topk_ratio=0.05)
        sent_fb += decompress(blob)["u"]
        sent_plain += decompress(compress({"u": u}, "topk", topk_ratio=0.05)[0])["u"]
    gap_fb = np.linalg.norm(true_sum - sent_fb)
    gap_plain = np.linalg.norm(true_sum - sent_plain)
    # the gap is exactly the residual still held back, and it stays small
    np.testing.assert_allclose(true_sum - sent_fb, state["u"], atol=1e-3)
    assert gap_fb / np.linalg.norm(true_sum) < 0.1
    assert gap_plain > 5 * gap_fb


def test_bad_methods_settings_and_state() -> None:
    with pytest.raises(CompressionError, match="'zstd' is unknown; use one of none, fp16, int8, topk"):
        compress(_weights(), "zstd")
    with pytest.raises(CompressionError, match="topk_ratio must be in"):
        compress(_weights(), "topk", topk_ratio=0.0)
    _, state = compress({"x": np.ones(4, np.float32)}, "topk")
    with pytest.raises(CompressionError, match="state holds 4 values but the tensor has 5"):
        compress({"x": np.ones(5, np.float32)}, "topk", state=state)


def test_malformed_blobs_fail_clearly() -> None:
    plain = sent({"x": np.ones(2, np.float32)}, {})
    with pytest.raises(CompressionError, match="compression=None"):
        decompress(plain)
    layout = {"x": {"dtype": "<f4", "shape": [4], "kind": "topk"}}
    meta = {"compression": "topk", "format": "1", "layout": json.dumps(layout)}
    bad_index = sent({"i/x": np.array([7], np.int32), "v/x": np.array([1.0], np.float32)}, meta)
    with pytest.raises(CompressionError, match="index out of range for 'x'"):
        decompress(bad_index)
    missing = sent({"i/x": np.array([1], np.int32)}, meta)
    with pytest.raises(CompressionError, match="'v/x' is missing"):
        decompress(missing)
    meta_obj = dict(meta, layout=json.dumps({"x": {"dtype": "|O", "shape": [1], "kind": "dense"}}))
    with pytest.raises(CompressionError, match="dtype object; only numeric"):
        decompress(sent({"d/x": np.ones(1)}, meta_obj))


def test_declared_sizes_are_bounded_and_non_finite_values_do_not_break_int8() -> None:
    layout = {"x": {"dtype": "<f4", "shape": [1 << 40], "kind": "topk"}}
    meta = {"compression": "topk", "format": "1", "layout": json.dumps(layout)}
    huge = sent({"i/x": np.array([0], np.int32), "v/x": np.array([1.0], np.float32)}, meta)
    with pytest.raises(CompressionError, match="refusing to allocate"):
        decompress(huge)
    with pytest.raises(CompressionError, match="refusing to allocate"):
        decompress(compress({"a": np.ones(10, np.float32)}, "none")[0], max_elements=9)
    x = np.array([np.nan, np.inf, -np.inf, 2.0, -1.0], np.float32)
    back = decompress(compress({"x": x}, "int8")[0])["x"]
    np.testing.assert_allclose(back, [0.0, 2.0, -2.0, 2.0, -1.0], atol=2.0 / 254)
