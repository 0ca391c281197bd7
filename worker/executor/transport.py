"""The hybrid transport: one `send` for node code, two paths underneath.

INTRA_CLUSTER messages stay in this process's mailbox as object references (Ray object
refs on Ray, futures in-process); INTER_CLUSTER messages are compressed, framed as
safetensors and handed to fabricd through the bridge. Node code never sees which path
a message took. Bytes are accounted exactly: inter-cluster bytes are the payload bytes
given to the bridge; intra-cluster bytes are the tensor bytes the reference stands for.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from proto.messages import NO_CONSUMER
from worker import payload as wire
from worker.errors import WorkerError
from worker.executor.graph import FINAL, KINDS, MIXING_KINDS, PEER, ROUND_KINDS, STATE, UP
from worker.executor.mailbox import Envelope, Mailbox
from worker.serialization import finite, nonfinite

Weights = dict[str, np.ndarray]

log = logging.getLogger("fedpilot.executor")

#: Backoff between attempts of one update (seconds; doubled per attempt, capped, jittered).
RETRY_FIRST, RETRY_MAX = 0.2, 2.0
#: BatchNorm buffers no honest model holds below 0 (torch's names, the tensor name's last
#: part): a member's negative variance passes every finiteness check, and averaged into the
#: job's model it makes sqrt(var + eps) NaN in every evaluation after
NONNEGATIVE_BUFFERS = ("running_var", "num_batches_tracked")
#: A target cluster whose daemon says it has no executor for the job this long is taken
#: as gone (its daemon restarted without it, or it exited): the send fails naming that,
#: and the scheduler's fault path (lease, re-plan) takes over from there.
ABSENT_GRACE_SECONDS = 10.0


class RemoteSendError(WorkerError, RuntimeError):
    """fabricd could not deliver an update to the target cluster (reason from the daemon).

    ``retry``: the failure may pass if the same update (same message id) is sent again
    later (the target was unreachable, busy, or its executor absent or silent)."""

    def __init__(self, reason: str, *, retry: bool = False) -> None:
        super().__init__(reason)
        self.retry = retry


class RemoteLink(Protocol):
    """What the transport needs from the bridge to fabricd: `send_update` returns once the
    target cluster's executor accepted the update, else raises RemoteSendError."""

    def send_update(self, *, target_cluster: str, job_id: str, round: int, source_node: str,
                    target_node: str, message_id: str, payload: bytes) -> None: ...


Edge = tuple[str, str, str, str]  # (source node, target node, source cluster, target cluster)
MODEL, AGGREGATOR = "model/", "aggregator/"  # tensor name prefixes of a migrating node's state
#: a message for several nodes of one cluster (`send_many`) is addressed to "@<cluster>"
#: and lists its nodes under this metadata key: the model crosses to that cluster once
GROUP, TARGETS_KEY = "@", "fedpilot.targets"


class Intake(Protocol):
    def put(self, r: int, src: str, envelope: Envelope, message_id: str) -> bool: ...


class Codec(Protocol):
    def compress(self, weights: Weights, edge: Edge) -> tuple[Weights, dict[str, str]]: ...
    def decompress(self, tensors: Weights, meta: Mapping[str, str], edge: Edge) -> Weights: ...


class DeliveryRefused(WorkerError, ValueError):
    """An update from another cluster does not fit this job's plan (the reason goes back to
    its sender, which does not retry it)."""


class DeliveryNotReady(WorkerError):
    """An update from another cluster came before this executor can take it (e.g. before
    the job's plan); the sender may retry it."""


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
    """The update's id for fabricd's idempotent delivery (a retry reuses it)."""
    return f"{job_id}/{round_index}/{kind}/{src}/{dst}"


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
        template: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        self.job_id = job_id
        self.local_cluster = local_cluster
        self._locate = locate
        self._mailbox = mailbox
        self._resolve = resolve
        self._codec = codec
        self._link = link
        # names, shapes and dtypes every model from another cluster must have
        self._template = {k: (np.asarray(v).shape, np.asarray(v).dtype)
                          for k, v in (template or {}).items()}
        self._lock = threading.Lock()
        self._sending: dict[str, int] = {}  # a round's updates in the link: id -> round
        self.counters = TrafficCounters()
        # updates of a round are accepted only for the round being run and the next one:
        # a member cannot park models for future rounds in this executor's memory
        self.current_round = 0
        # a repeated round (after a lost cluster) sends under fresh message ids: daemons
        # remember the ids they delivered in its first attempt
        self.attempt = 0
        #: how long one update is retried (the round's deadline; the engine sets it)
        self.retry_seconds = 600.0
        #: nodes whose "up" updates go to an intake of their own, whatever their round
        #: (a star root whose rounds close early: worker.executor.contributions)
        self.collectors: dict[str, Intake] = {}
        #: a round may skip this cluster while it trains an earlier one: an update for a
        #: round it has not begun yet is "not ready" (retried), not refused
        self.rounds_skip = False
        #: why the round's plan sends no (round, kind, src, dst) model (None: it does);
        #: set by the engine (`ClusterEngine.unexpected`: who sends what depends on who is
        #: drawn): anything else a member delivers is refused, not parked in the mailbox
        #: where it would wait for a reader that never comes
        self.expects: Callable[[int, str, str, str], str | None] | None = None

    def is_local(self, node: str) -> bool:
        return self._locate(node) == self.local_cluster

    def send(self, round_index: int, kind: str, src: str, dst: str, weights: Any, samples: int,
             nbytes: int) -> None:
        """Deliver `weights` (a handle or a dict) from `src` to `dst`, whichever path it takes."""
        target = self._locate(dst)
        if target == self.local_cluster:
            envelope = Envelope(weights, samples, nbytes, remote=False)
            intake = self.collectors.get(dst) if kind == UP else None
            if intake is not None:
                intake.put(round_index, src, envelope, self.local_cluster + "/" + message_id(
                    self.job_id, round_index, kind, src, dst) + self._attempt_suffix())
            else:
                self._mailbox.put((round_index, kind, src, dst), envelope)
            with self._lock:
                self.counters.bytes_intra += nbytes
                self.counters.messages_intra += 1
            return
        self._send_remote(target, round_index, kind, src, dst, weights, samples)

    def _send_remote(self, target: str, round_index: int, kind: str, src: str, dst: str,
                     weights: Any, samples: int, extra: Mapping[str, str] | None = None) -> None:
        """Compress (for this edge), frame and stream a model to another cluster; counted."""
        tensors, meta = self._codec.compress(self._resolve(weights),
                                             (src, dst, self.local_cluster, target))
        nbytes_sent = self.send_to(target, round_index, kind, src, dst, wire.encode(
            tensors, {**meta, **(extra or {})}, kind=kind, samples=samples))
        with self._lock:
            self.counters.bytes_inter += nbytes_sent
            self.counters.messages_inter += 1

    def send_many(self, round_index: int, kind: str, src: str, dsts: list[str], weights: Any,
                  samples: int, nbytes: int) -> None:
        """`send` to each of `dsts`, where the nodes of another cluster get one message
        together (addressed to GROUP + that cluster, listing them): a decentralized node's
        model crosses to each neighbouring cluster once, however many neighbours live
        there (scheduler.planning.topology.inter_transfers counts it so), unless the
        codec's messages depend on their edge (topk)."""
        remote: dict[str, list[str]] = {}
        for dst in dsts:
            target = self._locate(dst)
            if target == self.local_cluster:
                self.send(round_index, kind, src, dst, weights, samples, nbytes)
            else:
                remote.setdefault(target, []).append(dst)
        for target, group in remote.items():
            if len(group) == 1 or getattr(self._codec, "per_edge", False):
                for dst in group:
                    self.send(round_index, kind, src, dst, weights, samples, nbytes)
                continue
            self._send_remote(target, round_index, kind, src, GROUP + target, weights, samples,
                              {TARGETS_KEY: ",".join(group)})

    def send_to(self, target_cluster: str, round_index: int, kind: str, src: str, dst: str,
                payload: bytes) -> int:
        """Stream an encoded payload to `target_cluster`'s consumer; its size in bytes.

        Returns once that cluster's executor accepted it. A failure that may pass (see
        RemoteSendError.retry) is retried with backoff under the same message id (the
        receiver applies an id once) until `retry_seconds` have passed or the round was
        aborted; then, or at once for a final refusal, RemoteSendError says why."""
        link = self._link
        if link is None:
            raise RuntimeError(f"node {dst} lives on cluster {target_cluster!r} but this "
                               "executor has no bridge to fabricd")
        mid = message_id(self.job_id, round_index, kind, src, dst) + self._attempt_suffix()
        started = time.monotonic()
        absent_since: float | None = None
        attempts = 0
        while True:
            attempts += 1
            try:
                with self._sent_while_open(mid, round_index, kind):
                    link.send_update(target_cluster=target_cluster, job_id=self.job_id,
                                     round=round_index, source_node=src, target_node=dst,
                                     message_id=mid, payload=payload)
                return len(payload)
            except RemoteSendError as exc:
                if not exc.retry:
                    raise
                wait = min(RETRY_MAX, RETRY_FIRST * 2 ** (attempts - 1)) * (0.5 + random.random())
                now = time.monotonic()
                spent = now - started
                absent_since = (absent_since or now) if NO_CONSUMER in str(exc) else None
                stop = self._mailbox.aborted(round_index) if kind in ROUND_KINDS else None
                if stop is None and spent + wait > self.retry_seconds:
                    stop = f"its deadline of {self.retry_seconds:.0f} s passed"
                if (stop is None and absent_since is not None
                        and now + wait - absent_since > ABSENT_GRACE_SECONDS):
                    stop = (f"cluster {target_cluster!r} has had no executor for job "
                            f"{self.job_id!r} for {now - absent_since:.0f} s: its daemon "
                            "restarted without it, or it exited")
                if stop is None:
                    log.info("event=send_retry message=%s cluster=%s attempt=%d wait_s=%.2f "
                             "reason=%s", mid, target_cluster, attempts, wait, exc)
                    # an abort of the round (a cluster was lost) ends the wait at once: the
                    # scheduler re-plans only once the survivors' rounds have stopped
                    if kind in ROUND_KINDS:
                        stop = self._mailbox.wait_aborted(round_index, wait)
                    else:
                        time.sleep(wait)
                if stop is not None:
                    raise RemoteSendError(f"{exc} (gave up after {attempts} attempts in "
                                          f"{time.monotonic() - started:.1f} s: {stop})") from exc

    @contextlib.contextmanager
    def _sent_while_open(self, mid: str, round_index: int, kind: str) -> Iterator[None]:
        """A round's update is sent only while the round is not aborted, and abort_round
        abandons it in the link (registered before the check: one of the two sees the other)."""
        if kind not in ROUND_KINDS:
            yield
            return
        with self._lock:
            self._sending[mid] = round_index
        try:
            why = self._mailbox.aborted(round_index)
            if why is not None:
                raise RemoteSendError(f"update {mid} was not sent: {why}", retry=False)
            yield
        finally:
            with self._lock:
                self._sending.pop(mid, None)

    def _attempt_suffix(self) -> str:
        return f"~{self.attempt}" if self.attempt else ""

    def deliver_remote(self, *, job_id: str, round: int, source_node: str, target_node: str,
                       source_cluster: str, payload: bytes, message_id: str = "") -> bool:
        """Called for every update fabricd delivers; False if it was a repeat (of its
        `message_id`, or of its key), which is not applied again. The fields are the
        delivery's own (fabricd names the authenticated sending cluster). DeliveryRefused
        if it does not fit the plan."""
        src, dst = source_node, target_node
        # by sending cluster too: a member cannot spend another's ids before it does
        message_id = f"{source_cluster}/{message_id}" if message_id else ""
        if message_id and self._mailbox.applied(message_id):
            return False  # a retried copy of one applied already: accepted, not applied
        if job_id != self.job_id:
            raise DeliveryRefused(f"update for job {job_id!r} reached the executor of "
                                  f"{self.job_id!r}")
        decoded = wire.decode(payload, source=f"cluster {source_cluster} node {src}")
        kind = decoded.kind
        if kind not in KINDS:
            raise DeliveryRefused(f"update {src} -> {dst} has unknown kind {kind!r}")
        head, _, attempt = message_id.rpartition("~")
        if kind in ROUND_KINDS and head and attempt.isdigit() and int(attempt) > self.attempt:
            # a repeated round's update before this cluster began the repeat (its keys
            # are still those of the first attempt): retried until it has
            raise DeliveryNotReady(f"update {src} -> {dst} is of attempt {attempt} of round "
                                   f"{round}; this cluster runs attempt {self.attempt}")
        placed = self._locate(src)
        if source_cluster and placed != source_cluster:
            raise DeliveryRefused(f"update from node {src} came from cluster "
                                  f"{source_cluster!r}, but the plan places it on {placed!r}")
        what = f"{kind} update {src} -> {dst} from cluster {source_cluster or placed}"
        if kind == STATE:  # a migrating node: its model and its aggregator's server state
            if dst != src:
                raise DeliveryRefused(f"{what} is not addressed as one")
            model = {k[len(MODEL):]: np.array(v) for k, v in decoded.tensors.items()
                     if k.startswith(MODEL)}
            server = {k[len(AGGREGATOR):]: np.array(v) for k, v in decoded.tensors.items()
                      if k.startswith(AGGREGATOR)}
            if len(model) + len(server) != len(decoded.tensors):
                raise DeliveryRefused(f"{what} holds tensors outside {MODEL} and {AGGREGATOR}")
            if nonfinite(server) is not None:
                raise DeliveryRefused(f"{what}: the aggregator state holds NaN or infinities")
            envelope = Envelope((self._conform(model, what), server), 0, len(payload),
                                remote=True)
            return self._mailbox.put((round, kind, src, dst), envelope, message_id)
        if kind == FINAL:  # an exact copy of a cluster's share: never compressed
            if dst != "final":
                raise DeliveryRefused(f"{what} is not addressed as one")
            weights = {k: np.array(v) for k, v in decoded.tensors.items()}
        else:
            intake = self.collectors.get(dst) if kind == UP else None
            if intake is not None:  # it judges the round itself (late: dropped, counted)
                weights = self._codec.decompress(decoded.tensors, decoded.metadata,
                                                 (src, dst, placed, self.local_cluster))
                return intake.put(round, src, Envelope(self._conform(weights, what),
                                                       decoded.samples, len(payload), True),
                                  message_id or f"{source_cluster}/{round}/{src}")
            if self.rounds_skip and round > self.current_round + 1:
                raise DeliveryNotReady(f"update {src} -> {dst} is for round {round}; this "
                                       f"cluster is still in round {self.current_round}")
            if not self.current_round <= round <= self.current_round + 1:
                raise DeliveryRefused(f"update {src} -> {dst} is for round {round}; this "
                                      f"cluster accepts rounds {self.current_round} and "
                                      f"{self.current_round + 1} only")
            targets = self._targets(dst, kind, decoded.metadata, what)
            if self.expects is not None:
                for target in targets or [dst]:
                    if (why := self.expects(round, kind, src, target)) is not None:
                        raise DeliveryRefused(f"{what}: {why}")
            weights = self._codec.decompress(decoded.tensors, decoded.metadata,
                                             (src, dst, placed, self.local_cluster))
            if targets:
                envelope = Envelope(self._conform(weights, what), decoded.samples,
                                    len(payload), remote=True)
                stored = [self._mailbox.put((round, kind, src, t), envelope,
                                            message_id and f"{message_id}/{t}") for t in targets]
                return any(stored)
        weights = self._conform(weights, what)
        envelope = Envelope(weights, decoded.samples, len(payload), remote=True)
        return self._mailbox.put((round, kind, src, dst), envelope, message_id)

    def _targets(self, dst: str, kind: str, metadata: Mapping[str, str], what: str) -> list[str]:
        """The nodes a message is for: [] for one addressed to a node of this cluster, the
        listed nodes of this cluster for a `send_many` group; DeliveryRefused otherwise."""
        if not dst.startswith(GROUP):
            if not self.is_local(dst):
                raise DeliveryRefused(f"update for node {dst}, which is not on this cluster")
            return []
        if kind not in (PEER, *MIXING_KINDS):
            raise DeliveryRefused(f"{what}: only neighbours' models go to a group of nodes")
        if dst != GROUP + self.local_cluster:
            raise DeliveryRefused(f"{what} is for the nodes of another cluster")
        targets = metadata.get(TARGETS_KEY, "").split(",")
        if len(set(targets)) != len(targets) or not all(t and self.is_local(t) for t in targets):
            raise DeliveryRefused(f"{what} lists nodes {TARGETS_KEY}="
                                  f"{metadata.get(TARGETS_KEY, '')[:120]!r}; each must be a "
                                  "node of this cluster, once")
        return targets

    def _conform(self, weights: Weights, what: str) -> Weights:
        """The model as this job's model: same tensor names and shapes, its dtypes, finite
        values; anything else is refused before it reaches an aggregator."""
        if not self._template:
            return weights
        wrong = conform_error(weights, {k: shape for k, (shape, _) in self._template.items()})
        if wrong is not None:
            raise DeliveryRefused(f"{what}: {wrong}")
        return {name: weights[name] if weights[name].dtype == dtype
                else weights[name].astype(dtype) for name, (_, dtype) in self._template.items()}

    def begin_round(self, round_index: int) -> None:
        """Accept updates for `round_index` (and the next) from now on; forget the rounds
        before the previous one."""
        self.current_round = round_index
        self._mailbox.reopen_round(round_index)
        self._mailbox.forget_before(round_index - 1, ROUND_KINDS)

    def abort_round(self, round_index: int, reason: str) -> None:
        self._mailbox.abort_round(round_index, reason)
        abandon = getattr(self._link, "abandon_send", None)
        if abandon is not None:
            with self._lock:
                sending = [m for m, r in self._sending.items() if r == round_index]
            for mid in sending:
                abandon(mid, reason)

    def aborted(self, round_index: int) -> str | None:
        return self._mailbox.aborted(round_index)

    def receive(self, round_index: int, kind: str, src: str, dst: str,
                timeout: float) -> Envelope:
        where = f" (cluster {self._locate(src)})" if kind not in (STATE, FINAL) else ""
        return self._mailbox.take((round_index, kind, src, dst), timeout, where)


def conform_error(weights: Mapping[str, np.ndarray],
                  shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """Why `weights` from another cluster cannot be the job's model (its tensors' `shapes`),
    or None: other tensor names or shapes, NaN or infinities, or a statistic below 0
    (`NONNEGATIVE_BUFFERS`)."""
    if set(weights) != set(shapes):
        extra, missing = sorted(set(weights) - set(shapes)), sorted(set(shapes) - set(weights))
        return (f"tensors differ from the job's model (unexpected {extra[:3]}, missing "
                f"{missing[:3]})")
    for name, shape in shapes.items():
        value = np.asarray(weights[name])
        if value.shape != tuple(shape):
            return f"tensor {name!r} has shape {value.shape}, the job's model has {shape}"
        if not finite(value):
            return f"tensor {name!r} holds NaN or infinite values"
        if name.rpartition(".")[2] in NONNEGATIVE_BUFFERS and bool((value < 0).any()):
            return (f"tensor {name!r} holds negative values (no variance or batch count is "
                    "below 0; averaged in, it would break every model that evaluates with it)")
    return None
