"""`RayContext`: the execution context backed by a Ray cluster.

Tasks are `ray.remote` functions, actors are Ray actors (placed in a bundle of a placement
group when asked), references are `ray.ObjectRef`s in Ray's object store. A placement
group the cluster cannot hold fails at once: totals are checked against the cluster
before asking, and the group is only waited for briefly.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .base import (
    ActorHandle,
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


class RayActorHandle(ActorHandle):
    """A Ray actor; `handle.method(*args)` is `actor.method.remote(*args)`."""

    def __init__(self, name: str | None, actor: Any) -> None:
        super().__init__(name)
        self.ray_actor = actor

    def call(self, method: str, *args: Any, **kwargs: Any) -> Ref:
        return getattr(self.ray_actor, method).remote(*args, **kwargs)

    def call_many(self, method: str, n: int, *args: Any) -> list[Ref]:
        refs = getattr(self.ray_actor, method).options(num_returns=n).remote(*args)
        return [refs] if n == 1 else list(refs)


class RayContext(ExecutionContext):
    """Runs on the Ray cluster this process is connected to.

    `address=None` uses the already initialized Ray session (or starts a local one with
    `init_kwargs`); `"auto"` or `"ray://..."` joins an existing cluster. `shutdown()` only
    stops Ray if this context started it.
    """

    def __init__(self, address: str | None = None, *, placement_timeout: float = 5.0,
                 **init_kwargs: Any) -> None:
        self._started = False
        if not ray.is_initialized():
            kwargs = {"include_dashboard": False, "log_to_driver": False, **init_kwargs}
            if address is not None:
                kwargs["address"] = address
            ray.init(**kwargs)
            self._started = True
        self.placement_timeout = placement_timeout
        self._classes: dict[type, Any] = {}
        self._lock = threading.Lock()
        self.actors_created = 0

    def actor(self, cls: type, *args: Any, name: str | None = None,
              placement: Placement | None = None, num_cpus: float | None = None,
              **kwargs: Any) -> ActorHandle:
        with self._lock:
            actor_cls = self._classes.get(cls)
            if actor_cls is None:
                actor_cls = self._classes[cls] = ray.remote(cls)
        options: dict[str, Any] = {"max_restarts": 0}
        if name is not None:
            options["name"] = name
        if placement is not None:
            if placement.reservation.handle is None:
                raise PlacementError(f"actor {name!r}: reservation was not made by a RayContext")
            cpus = float(placement.resources.get("CPU", 0.0))
            options["num_cpus"] = cpus if num_cpus is None else num_cpus
            gpus = float(placement.resources.get("GPU", 0.0))
            if gpus > 0:  # the actor gets the bundle's GPUs (Ray sets CUDA_VISIBLE_DEVICES)
                options["num_gpus"] = gpus
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=placement.reservation.handle,
                placement_group_bundle_index=placement.index,
            )
        else:
            options["num_cpus"] = 0 if num_cpus is None else num_cpus
        actor = actor_cls.options(**options).remote(*args, **kwargs)
        with self._lock:
            self.actors_created += 1
        log.debug("event=actor_started context=ray name=%s class=%s", name, cls.__name__)
        return RayActorHandle(name, actor)

    def put(self, value: Any) -> Ref:
        return ray.put(value)

    def get(self, ref: Ref | Sequence[Ref], *, timeout: float | None = None) -> Any:
        if isinstance(ref, tuple):
            ref = list(ref)
        return ray.get(ref, timeout=timeout)

    def wait(self, refs: Sequence[Ref], *, num_returns: int = 1,
             timeout: float | None = None) -> tuple[list[Ref], list[Ref]]:
        ready, pending = ray.wait(list(refs), num_returns=num_returns, timeout=timeout)
        return list(ready), list(pending)

    def kill(self, actor: ActorHandle) -> None:
        if not isinstance(actor, RayActorHandle):
            raise TypeError(f"not a Ray actor: {actor!r}")
        ray.kill(actor.ray_actor, no_restart=True)
        log.debug("event=actor_killed context=ray name=%s", actor.name)

    def reserve(self, bundles: Sequence[Mapping[str, float]], strategy: str) -> Reservation:
        check_bundles(bundles, strategy)
        asked = bundle_totals(bundles)
        keys = list(asked)
        total = ray.cluster_resources()
        available = ray.available_resources()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        request = describe_request(bundles, strategy)
        have = (f"the cluster has {len(nodes)} node(s), total {fmt_resources(total, keys)}, "
                f"available {fmt_resources(available, keys)}")
        problem = self._impossible(bundles, strategy, asked, total, nodes)
        if problem:
            raise PlacementError(f"cannot reserve placement group: asked {request}; {have}: "
                                 f"{problem}. Ask for fewer or smaller bundles, or add nodes.")
        pg = placement_group([dict(b) for b in bundles], strategy=strategy)
        if not pg.wait(timeout_seconds=self.placement_timeout):
            remove_placement_group(pg)
            now = ray.available_resources()
            raise PlacementError(
                f"cannot reserve placement group: asked {request}; {have} (now available "
                f"{fmt_resources(now, keys)}); not granted within {self.placement_timeout:g}s — "
                "other jobs hold the resources. Wait for them or ask for less."
            )
        log.info("event=placement_reserved context=ray request=%s", request)
        return Reservation(tuple(dict(b) for b in bundles), strategy, handle=pg)

    @staticmethod
    def _impossible(bundles: Sequence[Mapping[str, float]], strategy: str,
                    asked: Mapping[str, float], total: Mapping[str, float],
                    nodes: list[dict[str, Any]]) -> str:
        """Why the cluster can never grant this request ('' when it might)."""
        missing = shortfall(asked, total)
        if missing:
            return f"short of {fmt_resources(missing)} in total"
        node_totals = [n.get("Resources", {}) for n in nodes]
        for i, bundle in enumerate(bundles):
            if not any(not shortfall(bundle, nt) for nt in node_totals):
                return f"bundle {i} {dict(bundle)} fits on no single node"
        if strategy == "STRICT_SPREAD" and len(bundles) > len(nodes):
            return f"STRICT_SPREAD needs {len(bundles)} nodes"
        if strategy == "STRICT_PACK" and not any(not shortfall(asked, nt) for nt in node_totals):
            return "STRICT_PACK needs one node holding every bundle"
        return ""

    def release(self, reservation: Reservation) -> None:
        if reservation.handle is not None:
            remove_placement_group(reservation.handle)

    def resources(self) -> dict[str, dict[str, float]]:
        return {"total": dict(ray.cluster_resources()),
                "available": dict(ray.available_resources())}

    def shutdown(self) -> None:
        if self._started and ray.is_initialized():
            ray.shutdown()
            self._started = False
