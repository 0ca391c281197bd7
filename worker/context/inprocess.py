"""`InProcessContext`: the execution context for tests — threads, futures, no Ray.

Each actor owns a single-thread executor, so its calls run one at a time in order, as on
Ray. References are `concurrent.futures.Future`s.
Placement groups are accounted against the CPUs this context was told it has, so a
request the "cluster" cannot hold fails exactly as it would on Ray.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

from .base import (
    ActorDiedError,
    ActorHandle,
    ContextError,
    ExecutionContext,
    Placement,
    PlacementError,
    Ref,
    Reservation,
    bundle_totals,
    check_bundles,
    describe_request,
    fmt_resources,
    shortfall,
)

log = logging.getLogger(__name__)


def _resolve(value: Any) -> Any:
    return value.result() if isinstance(value, Future) else value


def _call_resolved(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return fn(*(_resolve(a) for a in args), **{k: _resolve(v) for k, v in kwargs.items()})


class InProcessActorHandle(ActorHandle):
    """An actor living on its own single-thread executor in this process."""

    def __init__(self, name: str | None, cls: type, args: tuple[Any, ...],
                 kwargs: dict[str, Any], placement: Placement | None) -> None:
        super().__init__(name)
        self.placement = placement
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"actor-{name}")
        self._instance: Future[Any] = self._executor.submit(_call_resolved, cls, args, kwargs)
        self._dead = False

    def call(self, method: str, *args: Any, **kwargs: Any) -> Ref:
        if self._dead:
            raise ActorDiedError(f"actor {self.name!r} was killed; cannot call {method}()")

        def run() -> Any:
            try:
                instance = self._instance.result()
            except BaseException as exc:
                raise ActorDiedError(
                    f"actor {self.name!r} failed to start, cannot call {method}(): {exc!r}"
                ) from exc
            return _call_resolved(getattr(instance, method), args, kwargs)

        try:
            return self._executor.submit(run)
        except RuntimeError as exc:  # executor shut down between the check and submit
            raise ActorDiedError(f"actor {self.name!r} was killed; cannot call {method}()") from exc

    def call_many(self, method: str, n: int, *args: Any) -> list[Ref]:
        whole = self.call(method, *args)
        parts: list[Future[Any]] = [Future() for _ in range(n)]

        def split(done: Future[Any]) -> None:
            if done.cancelled():
                error: BaseException | None = ActorDiedError(
                    f"actor {self.name!r} was killed before {method}() ran")
            else:
                error = done.exception()
            values: Any = None
            if error is None:
                values = done.result()
                if len(values) != n:
                    error = ContextError(f"actor {self.name!r}: {method}() returned "
                                         f"{len(values)} values, {n} were expected")
            for i, part in enumerate(parts):
                if error is not None:
                    part.set_exception(error)
                else:
                    part.set_result(values[i])

        whole.add_done_callback(split)
        return list(parts)

    def _kill(self) -> None:
        self._dead = True
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def alive(self) -> bool:
        return not self._dead


class InProcessContext(ExecutionContext):
    """Threads and futures standing in for a Ray cluster of `num_cpus` CPUs."""

    def __init__(self, num_cpus: float | None = None) -> None:
        self.num_cpus = float(num_cpus if num_cpus is not None else (os.cpu_count() or 1))
        self._lock = threading.Lock()
        self._reserved: dict[int, Reservation] = {}
        self._actors: dict[int, InProcessActorHandle] = {}
        self._ids = itertools.count()
        self.actors_created = 0

    def actor(self, cls: type, *args: Any, name: str | None = None,
              placement: Placement | None = None, num_cpus: float | None = None,
              **kwargs: Any) -> ActorHandle:
        if placement is not None:
            with self._lock:
                if id(placement.reservation) not in self._reserved:
                    raise PlacementError(
                        f"actor {name!r} asks for a placement group that was released or never "
                        "reserved in this context"
                    )
            cpus = float(placement.resources.get("CPU", 0.0))
            if num_cpus is not None and num_cpus > cpus + 1e-9:
                raise PlacementError(
                    f"actor {name!r} asks num_cpus={num_cpus} but its bundle has CPU={cpus}"
                )
        handle = InProcessActorHandle(name, cls, args, kwargs, placement)
        with self._lock:
            self._actors[next(self._ids)] = handle
            self.actors_created += 1
        log.debug("event=actor_started context=inprocess name=%s class=%s", name, cls.__name__)
        return handle

    def put(self, value: Any) -> Ref:
        future: Future[Any] = Future()
        future.set_result(value)
        return future

    def get(self, ref: Ref | Sequence[Ref], *, timeout: float | None = None) -> Any:
        if isinstance(ref, list | tuple):
            return [self.get(r, timeout=timeout) for r in ref]
        if not isinstance(ref, Future):
            raise TypeError(f"InProcessContext.get expects a Future, got {type(ref).__name__}")
        return ref.result(timeout=timeout)

    def wait(self, refs: Sequence[Ref], *, num_returns: int = 1,
             timeout: float | None = None) -> tuple[list[Ref], list[Ref]]:
        if num_returns > len(refs):
            raise ValueError(f"num_returns={num_returns} exceeds the {len(refs)} refs given")
        pending = list(refs)
        ready: list[Ref] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(ready) < num_returns:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = futures_wait(pending, timeout=left, return_when=FIRST_COMPLETED)
            if not done:
                break
            ready += [r for r in pending if r in done]
            pending = [r for r in pending if r not in done]
        return ready, pending

    def kill(self, actor: ActorHandle) -> None:
        if not isinstance(actor, InProcessActorHandle):
            raise TypeError(f"not an in-process actor: {actor!r}")
        actor._kill()
        log.debug("event=actor_killed context=inprocess name=%s", actor.name)

    def alive_actors(self) -> int:
        """How many actors started by this context have not been killed."""
        with self._lock:
            return sum(1 for a in self._actors.values() if a.alive)

    def reserve(self, bundles: Sequence[Mapping[str, float]], strategy: str) -> Reservation:
        check_bundles(bundles, strategy)
        asked = bundle_totals(bundles)
        with self._lock:
            total = {"CPU": self.num_cpus}
            available = self._available_locked()
            missing = shortfall(asked, available)
            if strategy == "STRICT_SPREAD" and len(bundles) > 1:
                missing["nodes"] = float(len(bundles))
            if missing:
                raise PlacementError(
                    f"cannot reserve placement group: asked {describe_request(bundles, strategy)}; "
                    f"in-process cluster has 1 node, total {fmt_resources(total, list(asked))}, "
                    f"available {fmt_resources(available, list(asked))} (short of "
                    f"{fmt_resources(missing)}). Ask for fewer or smaller bundles."
                )
            reservation = Reservation(tuple(dict(b) for b in bundles), strategy)
            self._reserved[id(reservation)] = reservation
        log.info("event=placement_reserved context=inprocess request=%s",
                 describe_request(bundles, strategy))
        return reservation

    def release(self, reservation: Reservation) -> None:
        with self._lock:
            self._reserved.pop(id(reservation), None)

    def resources(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {"total": {"CPU": self.num_cpus}, "available": self._available_locked()}

    def _available_locked(self) -> dict[str, float]:
        used = bundle_totals([b for r in self._reserved.values() for b in r.bundles])
        return {"CPU": self.num_cpus - used.get("CPU", 0.0)}

    def shutdown(self) -> None:
        with self._lock:
            actors = list(self._actors.values())
            self._actors.clear()
            self._reserved.clear()
        for actor in actors:
            actor._kill()

    def __enter__(self) -> InProcessContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
