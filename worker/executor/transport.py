"""The hybrid transport: one `send` for node code, two paths underneath.

INTRA_CLUSTER messages stay in this process's mailbox as object references (Ray object
refs on Ray, futures in-process); INTER_CLUSTER messages are compressed, framed as
safetensors and handed to fabricd through the bridge. Node code never sees which path
a message took. Bytes are accounted exactly: inter-cluster bytes are the payload bytes
given to the bridge; intra-cluster bytes are the tensor bytes the reference stands for.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from worker.executor.mailbox import Envelope, Mailbox
from worker.serialization import bytes_metadata
from worker.topology.messages import SAMPLES_KEY

Weights = dict[str, np.ndarray]


class RemoteLink(Protocol):
    """What the transport needs from the bridge to fabricd."""

    def send_update(self, *, target_cluster: str, job_id: str, round: int, source_node: str,
                    target_node: str, message_id: str, payload: bytes) -> None: ...


Edge = tuple[str, str, str, str]  # (source node, target node, source cluster, target cluster)


class Codec(Protocol):
    def compress(self, weights: Weights, edge: Edge) -> bytes: ...
    def decompress(self, payload: bytes, edge: Edge) -> Weights: ...


@dataclass
class TrafficCounters:
    bytes_intra: int = 0
    bytes_inter: int = 0
    messages_intra: int = 0
    messages_inter: int = 0

    def snapshot_and_reset(self) -> TrafficCounters:
        snap = TrafficCounters(self.bytes_intra, self.bytes_inter,
                               self.messages_intra, self.messages_inter)
        self.bytes_intra = self.bytes_inter = self.messages_intra = self.messages_inter = 0
        return snap


def message_id(job_id: str, round_index: int, kind: str, src: str, dst: str) -> str:
    return f"{job_id}/{round_index}/{kind}/{src}/{dst}"


def parse_message_id(mid: str) -> tuple[str, int, str, str, str]:
    """Inverse of `message_id`; raises ValueError on anything else."""
    job_id, round_text, kind, src, dst = mid.split("/")
    return job_id, int(round_text), kind, src, dst


def with_samples(payload: bytes, samples: int) -> bytes:
    """Add the sample count to a safetensors payload's metadata (no tensor is copied)."""
    header, body = _split_safetensors(payload)
    meta = dict(header.get("__metadata__") or {})
    meta[SAMPLES_KEY] = str(int(samples))
    header["__metadata__"] = meta
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def samples_of(payload: bytes) -> int:
    try:
        return int(bytes_metadata(payload)[SAMPLES_KEY])
    except (KeyError, ValueError) as exc:  # SerializationError is a ValueError
        raise ValueError("update payload carries no valid fedpilot.samples metadata") from exc


def _split_safetensors(payload: bytes) -> tuple[dict[str, Any], bytes]:
    if len(payload) < 8:
        raise ValueError("update payload is shorter than a safetensors header")
    (size,) = struct.unpack("<Q", payload[:8])
    if size > len(payload) - 8 or size > 16 * 1024 * 1024:
        raise ValueError("update payload has an impossible safetensors header length")
    header = json.loads(payload[8:8 + size])
    if not isinstance(header, dict):
        raise ValueError("update payload's safetensors header is not a JSON object")
    return header, payload[8 + size:]


class HybridTransport:
    """Routes each message by the routing matrix's channel for (src, dst)."""

    def __init__(
        self,
        *,
        job_id: str,
        local_cluster: str,
        locate: Callable[[str], str],
        mailbox: Mailbox,
        resolve: Callable[[Any], Weights],
        codec: Codec,
        link: RemoteLink | None,
    ) -> None:
        self.job_id = job_id
        self.local_cluster = local_cluster
        self._locate = locate
        self._mailbox = mailbox
        self._resolve = resolve
        self._codec = codec
        self._link = link
        self._lock = threading.Lock()
        self.counters = TrafficCounters()

    def relocate(self, locate: Callable[[str], str]) -> None:
        """Use a new node -> cluster map (after a re-plan)."""
        self._locate = locate

    def is_local(self, node: str) -> bool:
        return self._locate(node) == self.local_cluster

    def send(self, round_index: int, kind: str, src: str, dst: str, weights: Any, samples: int,
             nbytes: int) -> None:
        """Deliver `weights` (a handle or a dict) from `src` to `dst`, whichever path it takes."""
        target = self._locate(dst)
        if target == self.local_cluster:
            self._mailbox.put((round_index, kind, src, dst),
                              Envelope(weights, samples, nbytes, remote=False))
            with self._lock:
                self.counters.bytes_intra += nbytes
                self.counters.messages_intra += 1
            return
        if self._link is None:
            raise RuntimeError(f"node {dst} lives on cluster {target!r} but this executor has "
                               "no bridge to fabricd")
        edge = (src, dst, self.local_cluster, target)
        payload = with_samples(self._codec.compress(self._resolve(weights), edge), samples)
        self._link.send_update(
            target_cluster=target, job_id=self.job_id, round=round_index, source_node=src,
            target_node=dst, message_id=message_id(self.job_id, round_index, kind, src, dst),
            payload=payload,
        )
        with self._lock:
            self.counters.bytes_inter += len(payload)
            self.counters.messages_inter += 1

    def deliver_remote(self, mid: str, payload: bytes) -> bool:
        """Called for every update fabricd delivers; False if it was a repeat."""
        job_id, round_index, kind, src, dst = parse_message_id(mid)
        if job_id != self.job_id:
            raise ValueError(f"update for job {job_id!r} reached the executor of {self.job_id!r}")
        weights = self._codec.decompress(payload, (src, dst, self._locate(src), self.local_cluster))
        envelope = Envelope(weights, samples_of(payload), len(payload), remote=True)
        return self._mailbox.put((round_index, kind, src, dst), envelope)

    def receive(self, round_index: int, kind: str, src: str, dst: str,
                timeout: float) -> Envelope:
        where = f" (cluster {self._locate(src)})"
        return self._mailbox.take((round_index, kind, src, dst), timeout, where)
