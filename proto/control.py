"""Typed scheduler -> executor control messages, validated like the wire messages.

A control body is a plain map with a `kind` and the job's `job_id`; it travels inside a
signed ControlRequest, and the executor (`worker/executor/service.py`) answers each:
- `job.start` {job, clients}: build the job's partitions, reply with the label histograms
  of `clients` (no sample leaves the cluster) and this cluster's capacity;
- `job.plan` {routing, imports, next_round, client_samples?, absent?}: adopt the routing matrix (the whole plan:
  the round graph is a read-only view of it), materialize the local clients, and take the
  states of nodes that migrated here (`imports`: node names; the states arrive as update
  streams); a pinned-data job's plan also carries every client's training-sample count
  (what its own cluster reported), the weight its updates get elsewhere, and the clients
  that sit out (`absent`: their cluster is gone, their data with it);
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
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from proto._schema import U32_MAX, Bool, Data, FieldSpec, Int, ListOf, Schema, Text, spec
from proto.errors import ControlMessageError, InvalidMessage, ProtocolError
from proto.messages import CLUSTER_ID, JOB_ID, NODE_ID
from proto.routing import RoutingMatrix

MAX_ITEMS = 1 << 20
ROUND = Int(1, U32_MAX)
NODES = ListOf(NODE_ID, max_items=MAX_ITEMS)


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


@dataclass(frozen=True)
class JobPlan(ControlMessage):
    """Adopt a plan (the routing matrix) and the states of the nodes it moves here."""

    TYPE: ClassVar[str] = "job.plan"
    routing: RoutingMatrix = spec(Routing())
    imports: tuple[str, ...] = spec(NODES, default=())
    next_round: int = spec(Int(0, U32_MAX), default=1)
    client_samples: tuple[int, ...] | None = spec(
        OrNone(ListOf(Int(0, 2**63 - 1), MAX_ITEMS)), default=None)
    absent: tuple[int, ...] = spec(ListOf(Int(0, U32_MAX), MAX_ITEMS), default=())

    def _check(self) -> None:
        n = self.routing.num_clients
        if self.client_samples is not None and len(self.client_samples) != n:
            raise self._refuse("client_samples", f"must be {n} non-negative integers (one per "
                               f"client of the routing matrix), got {len(self.client_samples)}")
        bad = [c for c in self.absent if c >= n]
        if bad:
            raise self._refuse("absent", f"must be client ids in 0..{n - 1}, got {bad[:5]}")


@dataclass(frozen=True)
class RoundRun(ControlMessage):
    """Run this cluster's share of `round` (a new `attempt`: the round is repeated)."""

    TYPE: ClassVar[str] = "round.run"
    round: int = spec(ROUND)
    attempt: int = spec(Int(0, U32_MAX), default=0)
    deadline: float | None = spec(OrNone(Seconds(0, 86400, open_lo=True)), default=None)


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


__all__ = [
    "ControlMessage",
    "ControlMessageError",
    "JobCheckpoint",
    "JobLease",
    "JobModel",
    "JobPlan",
    "JobRestore",
    "JobStart",
    "JobStop",
    "NodeExport",
    "RoundAbort",
    "RoundRun",
    "parse_control",
]
