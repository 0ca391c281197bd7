"""The execution-context interface: how worker code runs actors.

Code that needs parallelism receives an `ExecutionContext` and never touches a global
backend. Two implementations keep the same semantics: `InProcessContext` (threads, for
tests) and `RayContext` (Ray, for production). Object references are opaque: pass them to
`get`, `wait`, or as top-level arguments of actor calls (they are resolved to
their values before the callee runs, as Ray does). Values behind references are shared,
not copied, in-process; treat them as immutable (Ray hands back read-only arrays).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.errors import WorkerError

Ref = Any
"""An object reference: a `concurrent.futures.Future` in-process, a `ray.ObjectRef` on Ray."""

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class ContextError(WorkerError, RuntimeError):
    """Base of the errors raised by execution contexts."""


class PlacementError(ContextError):
    """A placement group cannot be reserved; the message says what was asked and what exists."""


class ActorDiedError(ContextError):
    """A call reached an actor that was killed or whose constructor failed."""


@dataclass(frozen=True)
class Reservation:
    """A reserved placement group: `bundles[i]` resources, kept until `release`."""

    bundles: tuple[Mapping[str, float], ...]
    strategy: str
    handle: Any = field(default=None, compare=False, repr=False)

    def bundle(self, index: int) -> Placement:
        """Where an actor must run to use bundle `index` of this reservation."""
        if not 0 <= index < len(self.bundles):
            raise IndexError(f"bundle {index} not in reservation of {len(self.bundles)} bundles")
        return Placement(self, index)


@dataclass(frozen=True)
class Placement:
    """One bundle of a reservation; pass it as `actor(..., placement=...)`."""

    reservation: Reservation
    index: int

    @property
    def resources(self) -> Mapping[str, float]:
        return self.reservation.bundles[self.index]


class ActorHandle(ABC):
    """A live actor. `handle.method(*args)` schedules the call and returns a `Ref`.

    Calls on one actor run one at a time, in the order they were made.
    """

    def __init__(self, name: str | None) -> None:
        self.name = name

    @abstractmethod
    def call(self, method: str, *args: Any, **kwargs: Any) -> Ref:
        """Schedule `method(*args, **kwargs)` on the actor; returns a reference to its result."""

    @abstractmethod
    def call_many(self, method: str, n: int, *args: Any) -> list[Ref]:
        """Schedule `method(*args)`, which returns a sequence of `n` values; one reference
        per value, each ready when the call ends (Ray's `num_returns`), so one call can
        stand for many."""

    def __getattr__(self, method: str) -> Callable[..., Ref]:
        if method.startswith("_"):
            raise AttributeError(method)

        def bound(*args: Any, **kwargs: Any) -> Ref:
            return self.call(method, *args, **kwargs)

        bound.__name__ = method
        return bound


class ExecutionContext(ABC):
    """Actors, an object store and placement groups, behind one small interface."""

    @abstractmethod
    def actor(
        self,
        cls: type,
        *args: Any,
        name: str | None = None,
        placement: Placement | None = None,
        num_cpus: float | None = None,
        **kwargs: Any,
    ) -> ActorHandle:
        """Start `cls(*args, **kwargs)` as an actor, inside `placement` when given.

        `num_cpus` defaults to the placement bundle's CPU share (or 0 without placement);
        a bundle's GPU share is the actor's GPU reservation.
        """

    @abstractmethod
    def put(self, value: Any) -> Ref:
        """Store `value`; the reference can be read by any number of readers."""

    @abstractmethod
    def get(self, ref: Ref | Sequence[Ref], *, timeout: float | None = None) -> Any:
        """The value behind `ref` (or a list of values for a list of refs); re-raises the
        exception the producing actor call raised."""

    @abstractmethod
    def wait(
        self, refs: Sequence[Ref], *, num_returns: int = 1, timeout: float | None = None
    ) -> tuple[list[Ref], list[Ref]]:
        """Block until `num_returns` of `refs` are ready (or `timeout`): (ready, not_ready)."""

    @abstractmethod
    def kill(self, actor: ActorHandle) -> None:
        """Stop the actor now; calls not yet run fail with `ActorDiedError`."""

    @abstractmethod
    def reserve(self, bundles: Sequence[Mapping[str, float]], strategy: str) -> Reservation:
        """Reserve a placement group or raise `PlacementError` at once if the cluster cannot
        hold it (the message says what was asked and what the cluster has)."""

    @abstractmethod
    def release(self, reservation: Reservation) -> None:
        """Give back a reservation (actors placed in it should be killed first)."""

    @abstractmethod
    def resources(self) -> dict[str, dict[str, float]]:
        """{"total": {...}, "available": {...}} resources of the cluster."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release what this context started (actors, reservations, a Ray session it began)."""


def check_bundles(bundles: Sequence[Mapping[str, float]], strategy: str) -> None:
    """Reject malformed reservation requests (empty, negative, unknown strategy)."""
    if strategy not in PLACEMENT_STRATEGIES:
        raise PlacementError(
            f"unknown placement strategy {strategy!r}; allowed: {', '.join(PLACEMENT_STRATEGIES)}"
        )
    if not bundles:
        raise PlacementError("a placement group needs at least one bundle")
    for i, bundle in enumerate(bundles):
        if not bundle or any(float(v) < 0 for v in bundle.values()):
            raise PlacementError(f"bundle {i} {dict(bundle)} must name non-negative resources")


def bundle_totals(bundles: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Sum of every resource over `bundles`."""
    totals: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def describe_request(bundles: Sequence[Mapping[str, float]], strategy: str) -> str:
    """`8 bundles x {'CPU': 0.25} (SPREAD), total {'CPU': 2.0}` style text for errors."""
    shapes = {tuple(sorted(b.items())) for b in bundles}
    if len(shapes) == 1:
        head = f"{len(bundles)} bundle(s) x {dict(bundles[0])}"
    else:
        head = f"{len(bundles)} bundles {[dict(b) for b in bundles]}"
    return f"{head} ({strategy}), total {_fmt(bundle_totals(bundles))}"


def shortfall(asked: Mapping[str, float], have: Mapping[str, float]) -> dict[str, float]:
    """Resources in `asked` that `have` cannot cover, with the amount asked."""
    return {k: v for k, v in asked.items() if v > float(have.get(k, 0.0)) + 1e-9}


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {round(float(v), 4):g}" for k, v in sorted(resources.items())) + "}"


def fmt_resources(resources: Mapping[str, float], keys: Sequence[str] | None = None) -> str:
    """Resources as `{CPU: 2, memory: ...}` text, restricted to `keys` when given."""
    if keys is not None:
        resources = {k: float(resources.get(k, 0.0)) for k in keys}
    return _fmt(resources)
