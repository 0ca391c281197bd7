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
from urllib.parse import quote, unquote

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
        #: never sent once for several nodes (HybridTransport.send_many): TransferSpec
        self.per_edge = transfer.per_edge
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


    # -- checkpoints: the references are training state (they decide what a receiver gets) --
    def nodes(self) -> set[str]:
        """This cluster's nodes that hold references (as sender or receiver of an edge)."""
        with self._lock:
            return {e[0] for e in self._sent} | {e[1] for e in self._received}

    def export(self, node: str) -> Weights:
        """`node`'s references as flat tensors: "codec/out/<dst>/<from>/<to>/<tensor>" for
        the edges it sends on, "codec/in/<src>/<from>/<to>/<tensor>" for those it receives
        on (names and clusters percent-encoded)."""
        out: Weights = {}
        with self._lock:
            for direction, table, own, peer in (("out", self._sent, 0, 1),
                                                ("in", self._received, 1, 0)):
                for edge, reference in table.items():
                    if edge[own] != node:
                        continue
                    prefix = "/".join([CODEC, direction, *(quote(x, safe="") for x in
                                                           (edge[peer], edge[2], edge[3]))])
                    out.update({f"{prefix}/{k}": v.copy() for k, v in reference.items()})
        return out

    def load(self, node: str, state: Mapping[str, np.ndarray]) -> None:
        """Take back what `export(node)` gave (other keys are ignored)."""
        tables: dict[str, dict[Edge, Weights]] = {"out": {}, "in": {}}
        for key, value in state.items():
            parts = key.split("/", 5)
            if len(parts) != 6 or parts[0] != CODEC or parts[1] not in tables:
                continue
            peer, a, b = (unquote(x) for x in parts[2:5])
            edge = (node, peer, a, b) if parts[1] == "out" else (peer, node, a, b)
            tables[parts[1]].setdefault(edge, {})[parts[5]] = np.array(value, dtype=np.float64)
        with self._lock:
            self._sent.update(tables["out"])
            self._received.update(tables["in"])


CODEC = "codec"


def _copy(weights: Mapping[str, np.ndarray]) -> Weights:
    return {k: np.array(v, dtype=np.float64) for k, v in weights.items()}
