"""Per-edge compression of inter-cluster messages (worker.executor.codec)."""

from __future__ import annotations

import numpy as np
import pytest

from proto.job import TransferSpec
from worker.executor.codec import EdgeCodec
from worker.payload import decode, encode

EDGE = ("c1", "server", "a", "b")


def wire(sender: EdgeCodec, receiver: EdgeCodec, model: dict[str, np.ndarray]
         ) -> dict[str, np.ndarray]:
    """Through the update payload, as between two executors."""
    tensors, meta = sender.compress(model, EDGE)
    payload = decode(encode(tensors, meta, kind="up", samples=7))
    assert payload.samples == 7 and payload.kind == "up"
    return receiver.decompress(payload.tensors, payload.metadata, EDGE)


def test_topk_receiver_copy_converges_to_the_sender_model() -> None:
    rng = np.random.default_rng(0)
    initial = {"w": np.zeros((20, 5), dtype=np.float32)}
    sender = EdgeCodec(TransferSpec(compression="topk", topk_ratio=0.1), initial)
    receiver = EdgeCodec(TransferSpec(compression="topk", topk_ratio=0.1), initial)
    model = {"w": rng.normal(size=(20, 5)).astype(np.float32)}
    errors = []
    for _ in range(12):  # a static model: 10 sends of 10% each cover every coordinate
        got = wire(sender, receiver, model)
        errors.append(float(np.abs(got["w"] - model["w"]).max()))
    assert errors[0] > 0.1  # the first message carries only the largest 10%
    assert all(b <= a + 1e-6 for a, b in zip(errors, errors[1:], strict=False))  # never worse
    assert errors[-1] == pytest.approx(0.0, abs=1e-5)  # no overshoot: sent exactly once
    assert got["w"].dtype == np.float32


def test_topk_tracks_a_moving_model_within_what_was_not_sent() -> None:
    rng = np.random.default_rng(1)
    initial = {"w": np.zeros(1000, dtype=np.float32)}
    sender = EdgeCodec(TransferSpec(compression="topk", topk_ratio=0.2), initial)
    receiver = EdgeCodec(TransferSpec(compression="topk", topk_ratio=0.2), initial)
    model = {"w": np.zeros(1000, dtype=np.float32)}
    for _ in range(30):
        model = {"w": model["w"] + 0.01 * rng.normal(size=1000).astype(np.float32)}
        got = wire(sender, receiver, model)
    gap = np.abs(got["w"] - model["w"])
    assert float(gap.max()) < 0.1 * float(np.abs(model["w"]).max())


@pytest.mark.parametrize("method,bound", [("none", 0.0), ("fp16", 1e-3), ("int8", 2e-2)])
def test_dense_methods_round_trip_within_their_precision(method: str, bound: float) -> None:
    rng = np.random.default_rng(2)
    model = {"w": rng.normal(size=(8, 8)).astype(np.float32), "b": np.arange(3, dtype=np.int64)}
    codec = EdgeCodec(TransferSpec(compression=method), model)
    got = wire(codec, codec, model)
    assert np.array_equal(got["b"], model["b"])
    assert float(np.abs(got["w"] - model["w"]).max()) <= bound * 4
