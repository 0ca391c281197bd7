"""Compression of inter-cluster model messages, per directed edge.

`none`, `fp16` and `int8` encode the model itself. `topk` sends only the largest
changes: each directed edge keeps a reference model known to both ends (starting from
the job's initial weights); the sender transmits the top-k of (model - reference) and both
ends add what was transmitted to their reference; what was not sent stays in the
difference and goes out later (error feedback through the reference). So the
receiver's copy converges to the sender's model instead of being mostly zeros.
A node that changes cluster starts fresh references (edges are keyed by cluster too).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np

from proto.job import TransferSpec
from worker.compression import compress_tensors, decompress_tensors

Weights = dict[str, np.ndarray]
Edge = tuple[str, str, str, str]


class EdgeCodec:
    """Implements the transport's `Codec` for one executor (both directions)."""

    def __init__(self, transfer: TransferSpec, initial: Mapping[str, np.ndarray]) -> None:
        self.method = transfer.compression
        self.ratio = transfer.topk_ratio
        # topk's per-edge references start from the initial weights; the other methods
        # keep no state, so they need no float64 copy of the model
        self._initial = ({k: np.asarray(v, dtype=np.float64) for k, v in initial.items()}
                         if self.method == "topk" else {})
        self._dtypes = {k: np.asarray(v).dtype for k, v in initial.items()}
        self._sent: dict[Edge, Weights] = {}
        self._received: dict[Edge, Weights] = {}
        self._lock = threading.Lock()

    def compress(self, weights: Weights, edge: Edge) -> tuple[Weights, dict[str, str]]:
        """The tensors to send over `edge` and the header metadata to rebuild them."""
        if self.method != "topk":
            tensors, meta, _ = compress_tensors(weights, self.method)
            return tensors, meta
        with self._lock:
            reference = self._sent.setdefault(edge, _copy(self._initial))
            delta = {k: np.asarray(v, dtype=np.float64) - reference[k] for k, v in weights.items()}
            # the reference already holds everything sent so far, so `delta` *is* the error
            # feedback: passing the compressor's own residual too would count it twice
            tensors, meta, _ = compress_tensors(delta, "topk", topk_ratio=self.ratio)
            for k, v in decompress_tensors(tensors, meta).items():
                reference[k] += v
        return tensors, meta

    def decompress(self, tensors: Weights, meta: Mapping[str, str], edge: Edge) -> Weights:
        if meta.get("compression") != "topk":
            return decompress_tensors(tensors, meta)
        with self._lock:
            reference = self._received.setdefault(edge, _copy(self._initial))
            for k, v in decompress_tensors(tensors, meta).items():
                reference[k] += v
            return {k: v.astype(self._dtypes[k]) for k, v in reference.items()}


def _copy(weights: Mapping[str, np.ndarray]) -> Weights:
    return {k: np.array(v, dtype=np.float64) for k, v in weights.items()}
