"""Typed scheduler -> executor control messages, validated like the wire messages.

A control body is a plain map with a `kind` and the job's `job_id`; it travels inside a
signed ControlRequest, and the executor (`worker/executor/service.py`) answers each:
- `job.start` {job, clients}: build the job's partitions, reply with the label histograms
  of `clients` (no sample leaves the cluster; `histogram_reply`: one raw little-endian
  array, a row per client in the order asked, so the reply costs a byte or two a count
  and the daemons relay one bytes field, not a map of 100,000 lists) and this cluster's
  capacity. The clients go as a list or, when they are an arithmetic progression (the
  round-robin and pinned assignments are), as `client_range` [start, stop, step], a few
  bytes for a million clients. The reply holds only the first `histogram_bytes` of the
  counts (`page_rows` rows; every reply stays under the 4 MiB cap) with the dtype of all
  of them; the scheduler fetches the rest with `job.profile`;
- `job.profile` {offset, count}: rows offset..offset+count-1 of the job.start's
  histograms (in the order of its clients: this cluster's own, no other), the job.start
  reply's dtype, at most `histogram_bytes` of counts (or one row);
- `job.plan` {routing | routing_sha256 + routing_size, imports, next_round, client_samples?,
  absent?, pooled_labels?, scaling_mean? + scaling_sd?, learning_rate?}: adopt the routing matrix (the whole plan:
  the round graph is a read-only view of it), materialize the local clients, and take the
  states of nodes that migrated here (`imports`: node names; the states arrive as update
  streams); a pinned-data job's plan also carries every client's training-sample count
  (what its own cluster reported), the weight its updates get elsewhere, and the clients
  that sit out (`absent`: their cluster is gone, their data with it), and the mean and sd
  every site standardizes its samples by (`scaling_*`: data.standardize), and the
  learning rate its clients train at where the sites' trials lowered the job's
  (`learning_rate`: training.learning_rate_check);
- `job.plan.part` {digest, index, count, size, data}: one slice of a routing matrix too
  large for one body (over `INLINE_PLAN_BYTES`; ~26 bytes a client, so past ~120,000
  clients). Every part is a signed, owner-checked control body under the same 4 MiB cap
  as any other; the `job.plan` that follows names the whole matrix by `routing_sha256`
  and `routing_size` instead of carrying it, so its signature covers the parts, and a
  receiver refuses the plan unless the parts it holds hash to exactly that digest
  (`PlanAssembly`, used by the executor and by both daemons, which learn placements
  from plans);
- `round.run` {round, attempt, deadline?}: run this cluster's share of the round (its
  waits end after `deadline` seconds), reply with its RoundRecord;
- `node.export` {nodes: {node: cluster}, epoch}: stream the state of nodes that move to
  another cluster straight to that cluster;
- `job.model` {to_cluster, node?, share_to?, collect?}: stream the final model (or this
  cluster's share of it) as an update; never inside a control reply, so any size works;
- `job.stop`: release actors and reply with how many were materialized;
- `job.checkpoint` {round, to_cluster}: stream the state of this cluster's checkpoint
  nodes (model + aggregator server state + the compression references of the edges the
  node sends and receives on, one payload per node) to the scheduler;
- `job.restore` {phase: expect, source_cluster, nodes} then {phase: apply, codec?}: take
  those nodes' states, streamed by the scheduler from a checkpoint, and adopt them (with
  `codec`, a resume of the whole job, their compression references too);
- `job.score` {phase: expect, round, source_cluster} then {phase: apply, round}: take the
  job's final model, streamed by the scheduler, and reply with the personalized accuracy
  of `round` (the last) against it as counts over this cluster's clients: {total, global,
  local: [wins, losses], shifted: [wins, losses]} (proto.rounds.personal_reply);
- `round.abort` {round, reason}: end that round's waits at once (a cluster was lost; the
  round is run again, `round.run` with a new `attempt`, on the survivors);
- `job.lease` {lease}: the scheduler is alive (`scheduler/run/leases.py`, every few
  seconds); renews the executor's lease for `lease` seconds.

Every kind is a frozen dataclass here: the scheduler builds one and sends
`to_body()`; the executor turns what arrives into one with `parse_control(body)`, which
checks every field's type and range and raises `ControlMessageError` naming the kind,
the dotted field (``client_samples[3]``) and what is allowed. Nothing is unpickled.

Keys: a missing required field, a value of the wrong type or out of range is refused;
an optional field that is absent takes its default; keys this side does not know are
ignored, so a newer scheduler may add an optional field without breaking older
executors. `to_body()` leaves out optional fields that are None, so the bodies are the
dicts the scheduler always sent.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from proto._schema import (
    U32_MAX,
    Bin,
    Bool,
    Data,
    FieldSpec,
    Float,
    Int,
    ListOf,
    Schema,
    Text,
    spec,
)
from proto.errors import ControlMessageError, InvalidMessage, ProtocolError
from proto.ids import MIB
from proto.messages import CLUSTER_ID, JOB_ID, NODE_ID
from proto.routing import RoutingMatrix

MAX_ITEMS = 1 << 20
ROUND = Int(1, U32_MAX)
NODES = ListOf(NODE_ID, max_items=MAX_ITEMS)
#: a routing matrix up to this size travels inside its job.plan; a larger one in parts
INLINE_PLAN_BYTES = 3 * MIB
#: bytes of the routing matrix in one job.plan.part (the body stays under the 4 MiB cap
#: of every control body, with room for the signed envelope and the certificate)
PLAN_PART_BYTES = 3 * MIB
#: the largest routing matrix sent in parts (~2.5 M clients); what a receiver holds
#: per job while a plan's parts arrive
MAX_PLAN_BYTES = 64 * MIB
MAX_PLAN_PARTS = -(-MAX_PLAN_BYTES // PLAN_PART_BYTES)
SHA256_HEX = Text(64, min_len=64, pattern=r"[0-9a-f]{64}")
#: the dtypes a job.start reply's histogram counts may take (the smallest that holds them)
HISTOGRAM_DTYPES = ("<u1", "<u2", "<u4", "<u8")
MAX_LABELS = 1 << 16
START_REPLY = "job.start reply"
PROFILE_REPLY = "job.profile reply"
#: bytes of histogram counts in one job.start or job.profile reply (at least one row:
#: a row of MAX_LABELS u8 counts is 512 KiB), under the 4 MiB cap with room to spare
PROFILE_PAGE_BYTES = 3 * MIB


def histogram_dtype(rows: np.ndarray) -> str:
    """The smallest HISTOGRAM_DTYPES entry that holds every count of `rows`."""
    counts = np.asarray(rows)
    top = int(counts.max()) if counts.size else 0
    return next(d for d in HISTOGRAM_DTYPES if top <= np.iinfo(np.dtype(d)).max)


def page_rows(page_bytes: int, labels: int, dtype: str) -> int:
    """How many histogram rows of `labels` counts of `dtype` one reply holds: as many as
    fit `page_bytes`, at least one (the scheduler and the executor both use this)."""
    return max(1, page_bytes // max(1, labels * np.dtype(dtype).itemsize))


def histogram_reply(rows: np.ndarray, dtype: str | None = None) -> dict[str, Any]:
    """The histogram fields of a job.start or job.profile reply: `rows` (clients x
    labels, counts >= 0) as one little-endian array of `dtype` (default: the smallest
    unsigned dtype that holds them)."""
    counts = np.asarray(rows, dtype=np.int64)
    if counts.ndim != 2:  # no clients: np.array([]) has no row length
        counts = counts.reshape(len(counts), -1) if counts.size else counts.reshape(len(counts), 0)
    if counts.size and counts.min() < 0:
        raise ValueError("label histograms hold counts >= 0")
    if dtype is None:
        dtype = histogram_dtype(counts)
    elif (dtype not in HISTOGRAM_DTYPES
          or HISTOGRAM_DTYPES.index(histogram_dtype(counts)) > HISTOGRAM_DTYPES.index(dtype)):
        raise ValueError(f"histogram dtype {dtype!r} does not hold these counts")
    return {"histogram_counts": counts.astype(dtype).tobytes(), "histogram_dtype": dtype,
            "histogram_shape": [int(counts.shape[0]), int(counts.shape[1])]}


def histogram_layout(reply: Mapping[str, Any], what: str = START_REPLY) -> tuple[str, int]:
    """The (dtype, labels) of a reply's histograms; ControlMessageError naming the field
    if either is malformed (the rows are checked by `read_histograms`)."""
    dtype, shape = reply.get("histogram_dtype"), reply.get("histogram_shape")
    if dtype not in HISTOGRAM_DTYPES:
        raise ControlMessageError(what, "histogram_dtype", f"field 'histogram_dtype': "
                                  f"must be one of {list(HISTOGRAM_DTYPES)}, got {str(dtype)[:64]!r}")
    if (not isinstance(shape, list | tuple) or len(shape) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in shape)
            or not 0 <= shape[1] <= MAX_LABELS):
        raise ControlMessageError(what, "histogram_shape", f"field 'histogram_shape': must be "
                                  f"[rows, labels <= {MAX_LABELS}], got {str(shape)[:64]}")
    return str(dtype), int(shape[1])


def read_histograms(reply: Mapping[str, Any], clients: int, *, dtype: str | None = None,
                    labels: int | None = None, what: str = START_REPLY) -> np.ndarray:
    """The `clients` x labels counts of a job.start or job.profile reply
    (`histogram_reply`), of exactly `dtype` and `labels` if given (what was asked);
    ControlMessageError naming the field if they are not exactly that."""
    got_dtype, got_labels = histogram_layout(reply, what)
    if dtype is not None and got_dtype != dtype:
        raise ControlMessageError(what, "histogram_dtype", f"field 'histogram_dtype': must be "
                                  f"{dtype!r} (the job.start reply's), got {got_dtype!r}")
    shape = reply["histogram_shape"]
    if shape[0] != clients or (labels is not None and got_labels != labels):
        want = f"[{clients}, {labels if labels is not None else 'labels'}]"
        raise ControlMessageError(what, "histogram_shape", f"field 'histogram_shape': "
                                  f"must be {want} (a row per client asked), got {str(shape)[:64]}")
    raw = reply.get("histogram_counts")
    size = shape[0] * shape[1] * np.dtype(got_dtype).itemsize
    if not isinstance(raw, bytes) or len(raw) != size:
        got = len(raw) if isinstance(raw, bytes) else type(raw).__name__
        raise ControlMessageError(what, "histogram_counts", f"field 'histogram_counts': "
                                  f"must be {size} bytes ({shape[0]} x {shape[1]} {got_dtype}), "
                                  f"got {got}")
    counts = np.frombuffer(raw, dtype=got_dtype).reshape(shape[0], shape[1])
    if counts.size and int(counts.max()) > 2**62:
        raise ControlMessageError(what, "histogram_counts",
                                  "field 'histogram_counts': a count is over 2**62")
    return counts.astype(np.int64)


def client_range(clients: Sequence[int]) -> tuple[int, int, int] | None:
    """[start, stop, step] of `clients` if they are an increasing arithmetic progression
    (None otherwise): how a job.start names them in a few bytes."""
    if not clients:
        return None
    ids = np.asarray(clients, dtype=np.int64)
    start = int(ids[0])
    step = int(ids[1] - ids[0]) if len(ids) > 1 else 1
    if step < 1 or not np.array_equal(ids, np.arange(start, start + step * len(ids), step)):
        return None
    return start, start + step * (len(ids) - 1) + 1, step


@dataclass(frozen=True)
class Seconds(FieldSpec):
    """A finite number of seconds in lo..hi (above lo only, if `open_lo`); kept as sent."""

    lo: float
    hi: float
    open_lo: bool = False

    def check(self, name: str, value: Any) -> Any:
        low = "(" if self.open_lo else "["
        allowed = f"seconds in {low}{self.lo:g}, {self.hi:g}]"
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not math.isfinite(value) or value < self.lo or value > self.hi
                or (self.open_lo and value == self.lo)):
            raise InvalidMessage(f"field {name!r}: must be {allowed}, got {value!r}", field=name)
        return value


@dataclass(frozen=True)
class OrNone(FieldSpec):
    """None, or a value `inner` accepts."""

    inner: FieldSpec

    def check(self, name: str, value: Any) -> Any:
        return None if value is None else self.inner.check(name, value)


@dataclass(frozen=True)
class MapOf(FieldSpec):
    """A map of at most max_items entries, keys and values checked (field ``name.key``)."""

    key: FieldSpec
    value: FieldSpec
    max_items: int = MAX_ITEMS

    def check(self, name: str, value: Any) -> Any:
        if not isinstance(value, Mapping) or len(value) > self.max_items:
            raise InvalidMessage(f"field {name!r}: must be a map of at most {self.max_items} "
                                 f"entries, got {type(value).__name__}", field=name)
        return {self.key.check(name, k): self.value.check(f"{name}.{k}", v)
                for k, v in value.items()}


@dataclass(frozen=True)
class Routing(FieldSpec):
    """A routing matrix: its bytes (`RoutingMatrix.to_bytes`), decoded and validated."""

    def check(self, name: str, value: Any) -> Any:
        if isinstance(value, RoutingMatrix):
            return value
        if not isinstance(value, bytes | bytearray | memoryview):
            raise InvalidMessage(f"field {name!r}: must be a routing matrix's bytes, got "
                                 f"{type(value).__name__}", field=name)
        try:
            return RoutingMatrix.from_bytes(bytes(value))
        except ProtocolError as exc:
            raise InvalidMessage(f"field {name!r}: not a valid routing matrix: {exc}",
                                 field=name) from None


@dataclass(frozen=True)
class ControlMessage(Schema):
    """Base of every control message (one registry, keyed by kind = TYPE)."""

    REGISTRY: ClassVar[dict[str, type[Schema]]] = {}
    job_id: str = spec(JOB_ID)

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
            self._check()
        except ControlMessageError:
            raise
        except InvalidMessage as exc:
            raise ControlMessageError(self.TYPE, exc.field, str(exc)) from None

    def _check(self) -> None:
        """Checks across fields (raise `self._refuse(...)`)."""

    def _refuse(self, field: str, what: str) -> ControlMessageError:
        return ControlMessageError(self.TYPE, field, f"field {field!r}: {what}")

    def to_body(self) -> dict[str, Any]:
        """The body to send: `kind` and every field (optional ones only when not None)."""
        body: dict[str, Any] = {"kind": self.TYPE}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, RoutingMatrix):
                value = value.to_bytes()
            body[f.name] = list(value) if isinstance(value, tuple) else value
        return body


def parse_control(body: Mapping[str, Any]) -> ControlMessage:
    """The typed message `body` describes; ControlMessageError naming the field if it is
    not exactly right (unknown keys are ignored)."""
    kind = body.get("kind")
    cls = ControlMessage.REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ControlMessageError("control message", "kind", f"unknown control message kind "
                                  f"{str(kind)[:64]!r} (known: {', '.join(sorted(ControlMessage.REGISTRY))})")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in body:
            values[f.name] = body[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ControlMessageError(cls.TYPE, f.name, f"field {f.name!r}: missing (required)")
    message = cls(**values)
    assert isinstance(message, ControlMessage)
    return message


@dataclass(frozen=True)
class JobStart(ControlMessage):
    """Start the job (`job`: a JobSpec's dict) with these clients' data."""

    TYPE: ClassVar[str] = "job.start"
    job: dict[str, Any] = spec(Data())  # a JobSpec's dict (proto.job checks it)
    clients: tuple[int, ...] = spec(ListOf(Int(0, U32_MAX), MAX_ITEMS), default=())
    #: the clients as range(start, stop, step) instead of a list (not with `clients`)
    client_range: tuple[int, ...] | None = spec(
        OrNone(ListOf(Int(0, U32_MAX + 1), 3, min_items=3)), default=None)
    #: bytes of histogram counts in the reply (the rest: job.profile)
    histogram_bytes: int = spec(Int(1, PROFILE_PAGE_BYTES), default=PROFILE_PAGE_BYTES)

    def _check(self) -> None:
        r = self.client_range
        if r is None:
            return
        if self.clients:
            raise self._refuse("client_range", "give the clients as a list or as a range, "
                               "not both")
        if r[2] < 1 or r[0] > r[1]:
            raise self._refuse("client_range", f"must be [start, stop, step] with start <= "
                               f"stop and step >= 1, got {list(r)}")

    def client_ids(self) -> Sequence[int]:
        """The clients this job.start names (a range or the list)."""
        r = self.client_range
        return range(r[0], r[1], r[2]) if r is not None else self.clients


@dataclass(frozen=True)
class JobProfile(ControlMessage):
    """Rows offset..offset+count-1 of the label histograms of the clients the job.start
    named (in its order), in the job.start reply's dtype."""

    TYPE: ClassVar[str] = "job.profile"
    offset: int = spec(Int(0, U32_MAX))
    count: int = spec(Int(1, PROFILE_PAGE_BYTES))


@dataclass(frozen=True)
class JobPlan(ControlMessage):
    """Adopt a plan (the routing matrix) and the states of the nodes it moves here. The
    matrix comes inline (`routing`) or, when large, as `job.plan.part`s named here by
    `routing_sha256` and `routing_size` (exactly one of the two forms)."""

    TYPE: ClassVar[str] = "job.plan"
    routing: RoutingMatrix | None = spec(OrNone(Routing()), default=None)
    imports: tuple[str, ...] = spec(NODES, default=())
    next_round: int = spec(Int(0, U32_MAX), default=1)
    client_samples: tuple[int, ...] | None = spec(
        OrNone(ListOf(Int(0, 2**63 - 1), MAX_ITEMS)), default=None)
    absent: tuple[int, ...] = spec(ListOf(Int(0, U32_MAX), MAX_ITEMS), default=())
    #: pinned data: the label counts of every client's training samples, summed (the mix
    #: the model learns: personalized accuracy's reference, `label_offsets`)
    pooled_labels: tuple[int, ...] | None = spec(
        OrNone(ListOf(Int(0, 2**63 - 1), MAX_ITEMS)), default=None)
    #: pinned data (data.standardize): the mean and sd, per feature or channel, every site
    #: standardizes its samples by (`fedcore.data.shared_scaling` of the job.start
    #: replies' `moments`); both or neither, of equal length
    scaling_mean: tuple[float, ...] | None = spec(OrNone(ListOf(Float(), MAX_ITEMS)),
                                                  default=None)
    scaling_sd: tuple[float, ...] | None = spec(OrNone(ListOf(Float(1e-300), MAX_ITEMS)),
                                                default=None)
    #: pinned data (training.learning_rate_check): the learning rate every client trains
    #: at, the median of the sites' trials (`fedcore.data.preflight.shared_learning_rate`);
    #: a plan may only lower the job's (the executor refuses a larger one)
    learning_rate: float | None = spec(OrNone(Float(1e-300)), default=None)
    routing_sha256: str | None = spec(OrNone(SHA256_HEX), default=None)
    routing_size: int | None = spec(OrNone(Int(1, MAX_PLAN_BYTES)), default=None)
    #: [privacy] secure_aggregation: every cluster's X25519 public key (from its job.start
    #: reply), from which each derives its pairwise mask secrets
    privacy_keys: dict[str, bytes] | None = spec(
        OrNone(MapOf(CLUSTER_ID, Bin(32, exact=(32,)), max_items=65536)), default=None)

    def _check(self) -> None:
        by_digest = self.routing_sha256 is not None
        if by_digest == (self.routing is not None):
            raise self._refuse("routing", "give the routing matrix's bytes or its "
                               "routing_sha256 (its job.plan.parts were sent first), not "
                               + ("both" if by_digest else "neither"))
        if by_digest != (self.routing_size is not None):
            raise self._refuse("routing_size", "required with routing_sha256 (and only then)")
        if (self.scaling_mean is None) != (self.scaling_sd is None) or (
                self.scaling_mean is not None and self.scaling_sd is not None
                and len(self.scaling_mean) != len(self.scaling_sd)):
            raise self._refuse("scaling_sd", "give scaling_mean and scaling_sd together, "
                               "one of each per feature or channel")
        if self.routing is None:
            return  # the checks against the matrix run once its parts are assembled
        n = self.routing.num_clients
        if self.client_samples is not None and len(self.client_samples) != n:
            raise self._refuse("client_samples", f"must be {n} non-negative integers (one per "
                               f"client of the routing matrix), got {len(self.client_samples)}")
        bad = [c for c in self.absent if c >= n]
        if bad:
            raise self._refuse("absent", f"must be client ids in 0..{n - 1}, got {bad[:5]}")

    def with_routing(self, parts: PlanAssembly) -> JobPlan:
        """This plan with its matrix inline: as sent, or assembled from `parts`
        (ControlMessageError naming `routing_sha256` if they do not hash to it)."""
        if self.routing is not None:
            return self
        assert self.routing_sha256 is not None and self.routing_size is not None
        data = parts.take(self.routing_sha256, self.routing_size)
        try:
            matrix = RoutingMatrix.from_bytes(data, max_size=MAX_PLAN_BYTES)
        except ProtocolError as exc:
            raise self._refuse("routing_sha256", f"the parts with this digest are not a valid "
                               f"routing matrix: {exc}") from None
        return dataclasses.replace(self, routing=matrix, routing_sha256=None, routing_size=None)


@dataclass(frozen=True)
class JobPlanPart(ControlMessage):
    """Slice `index` of `count` of the routing matrix whose bytes (`size` in all) hash to
    `digest`; every slice but the last holds exactly PLAN_PART_BYTES."""

    TYPE: ClassVar[str] = "job.plan.part"
    digest: str = spec(SHA256_HEX)
    index: int = spec(Int(0, MAX_PLAN_PARTS - 1))
    count: int = spec(Int(1, MAX_PLAN_PARTS))
    size: int = spec(Int(1, MAX_PLAN_BYTES))
    data: bytes = spec(Bin(PLAN_PART_BYTES, min_len=1))

    def _check(self) -> None:
        if self.count != -(-self.size // PLAN_PART_BYTES):
            raise self._refuse("count", f"{self.size} bytes make "
                               f"{-(-self.size // PLAN_PART_BYTES)} parts of {PLAN_PART_BYTES}, "
                               f"not {self.count}")
        if self.index >= self.count:
            raise self._refuse("index", f"must be in 0..{self.count - 1}, got {self.index}")
        want = min(PLAN_PART_BYTES, self.size - self.index * PLAN_PART_BYTES)
        if len(self.data) != want:
            raise self._refuse("data", f"part {self.index} of a {self.size}-byte plan holds "
                               f"{want} bytes, got {len(self.data)}")


def plan_parts(job_id: str, data: bytes) -> tuple[list[JobPlanPart], str]:
    """The `job.plan.part`s that carry `data` (a routing matrix's bytes), and its sha256."""
    if len(data) > MAX_PLAN_BYTES:
        raise ValueError(f"routing matrix of {len(data)} bytes is over the {MAX_PLAN_BYTES}-byte "
                         "limit of a plan sent in parts (proto.control.MAX_PLAN_BYTES)")
    digest = hashlib.sha256(data).hexdigest()
    count = -(-len(data) // PLAN_PART_BYTES)
    return [JobPlanPart(job_id, digest=digest, index=i, count=count, size=len(data),
                        data=data[i * PLAN_PART_BYTES:(i + 1) * PLAN_PART_BYTES])
            for i in range(count)], digest


class PlanAssembly:
    """The parts of one job's newest plan as they arrive (thread-safe).

    Holds one digest at a time: a part of another plan drops the parts held, so a
    receiver never holds more than MAX_PLAN_BYTES for a job. Parts are checked for their
    place (`JobPlanPart`); whether they are the plan is decided by `take`, against the
    digest of the signed `job.plan`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._digest = ""
        self._parts: dict[int, bytes] = {}

    def add(self, part: JobPlanPart) -> int:
        """Keep `part`; returns how many parts of its plan are held."""
        with self._lock:
            if part.digest != self._digest:
                self._digest, self._parts = part.digest, {}
            self._parts[part.index] = part.data
            return len(self._parts)

    def take(self, digest: str, size: int) -> bytes:
        """The plan's bytes: every part of `digest`, joined, `size` bytes hashing to it;
        ControlMessageError naming `routing_sha256` otherwise. The parts stay (the
        scheduler's daemon sends one plan to every cluster)."""
        count = -(-size // PLAN_PART_BYTES)
        with self._lock:
            held = dict(self._parts) if self._digest == digest else {}
        missing = [i for i in range(count) if i not in held]
        if missing:
            raise ControlMessageError(
                JobPlan.TYPE, "routing_sha256",
                f"field 'routing_sha256': parts {missing[:5]} of plan {digest[:16]}... "
                f"({count} parts, {size} bytes) did not arrive; send every job.plan.part "
                "of it first")
        data = b"".join(held[i] for i in range(count))
        actual = hashlib.sha256(data).hexdigest()
        if len(data) != size or actual != digest:
            raise ControlMessageError(
                JobPlan.TYPE, "routing_sha256",
                f"field 'routing_sha256': the plan's parts are {len(data)} bytes with sha256 "
                f"{actual}, not the signed {size} bytes with {digest}")
        return data


@dataclass(frozen=True)
class RoundRun(ControlMessage):
    """Run this cluster's share of `round` (a new `attempt`: the round is repeated).
    `clusters`: the clusters that train in it (None: all); a round that may close without
    a slow cluster leaves out the ones still training an earlier round."""

    TYPE: ClassVar[str] = "round.run"
    round: int = spec(ROUND)
    attempt: int = spec(Int(0, U32_MAX), default=0)
    deadline: float | None = spec(OrNone(Seconds(0, 86400, open_lo=True)), default=None)
    clusters: tuple[str, ...] | None = spec(OrNone(ListOf(CLUSTER_ID, 4096)), default=None)


@dataclass(frozen=True)
class RoundAbort(ControlMessage):
    """End `round`'s waits at once with `reason`."""

    TYPE: ClassVar[str] = "round.abort"
    round: int = spec(ROUND)
    reason: str = spec(Text(MAX_ITEMS, allow_control=True), default="aborted")


@dataclass(frozen=True)
class JobLease(ControlMessage):
    """The executor's lease ends `lease` seconds from now."""

    TYPE: ClassVar[str] = "job.lease"
    lease: float = spec(Seconds(1, 3600))


@dataclass(frozen=True)
class JobStop(ControlMessage):
    """End the job here."""

    TYPE: ClassVar[str] = "job.stop"


@dataclass(frozen=True)
class NodeExport(ControlMessage):
    """Stream the states of `nodes` {node: target cluster} there, for plan `epoch`."""

    TYPE: ClassVar[str] = "node.export"
    nodes: dict[str, str] = spec(MapOf(NODE_ID, CLUSTER_ID), default={})
    epoch: int | None = spec(OrNone(Int(0, U32_MAX)), default=None)


@dataclass(frozen=True)
class JobModel(ControlMessage):
    """Stream the final model: {node, to_cluster}, {share_to} or {collect, to_cluster}."""

    TYPE: ClassVar[str] = "job.model"
    to_cluster: str = spec(Text(64, pattern=CLUSTER_ID.pattern), default="")
    node: str = spec(Text(256), default="")
    share_to: str | None = spec(OrNone(CLUSTER_ID), default=None)
    collect: tuple[str, ...] | None = spec(OrNone(NODES), default=None)

    def _check(self) -> None:
        if self.share_to is None and not self.to_cluster:
            raise self._refuse("to_cluster", "a cluster id is required (unless share_to is given)")


@dataclass(frozen=True)
class JobCheckpoint(ControlMessage):
    """Stream this cluster's checkpoint states of `round` to `to_cluster`."""

    TYPE: ClassVar[str] = "job.checkpoint"
    round: int = spec(ROUND)
    to_cluster: str = spec(CLUSTER_ID)


@dataclass(frozen=True)
class JobRestore(ControlMessage):
    """`expect` `nodes`' states from `source_cluster`, then `apply` them."""

    TYPE: ClassVar[str] = "job.restore"
    phase: str = spec(Text(16, choices=("expect", "apply")))
    source_cluster: str | None = spec(OrNone(CLUSTER_ID), default=None)
    nodes: tuple[str, ...] = spec(NODES, default=())
    codec: bool = spec(Bool(), default=False)

    def _check(self) -> None:
        if self.phase == "expect" and self.source_cluster is None:
            raise self._refuse("source_cluster", "the cluster the states come from is required "
                               "with phase 'expect'")


@dataclass(frozen=True)
class JobScore(ControlMessage):
    """`expect` the final model from `source_cluster`, then `apply`: score `round`'s
    personalized accuracy against it."""

    TYPE: ClassVar[str] = "job.score"
    phase: str = spec(Text(16, choices=("expect", "apply")))
    round: int = spec(ROUND)
    source_cluster: str | None = spec(OrNone(CLUSTER_ID), default=None)

    def _check(self) -> None:
        if self.phase == "expect" and self.source_cluster is None:
            raise self._refuse("source_cluster", "the cluster the model comes from is required "
                               "with phase 'expect'")
