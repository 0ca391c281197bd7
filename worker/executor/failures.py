"""A round's failure as a message a user can act on: the cause first, then what to change.

The engine aborts a round at its first failure (an actor that died, Ray's memory monitor
killing one, a send that failed, any exception in an engine thread) and raises it; the
control reply carrying it is cut at 1000 characters, so the explanation comes first and
Ray's own (long) text last.
"""

from __future__ import annotations

from proto.job import JobSpec

MEMORY_SIGNS = ("OutOfMemoryError", "out of memory", "memory monitor", "MemoryError")
DEATH_SIGNS = ("ActorDiedError", "RayActorError", "ActorUnavailableError", "WorkerCrashedError")


def explain_failure(exc: BaseException, cluster_id: str, r: int, spec: JobSpec | None) -> str:
    """The round's first failure as one message that starts with the cause and what to
    change (the reply is cut at 1000 characters; Ray's own text comes last)."""
    kinds = " ".join(t.__name__ for t in type(exc).__mro__)
    text = f"{type(exc).__name__}: {exc}"
    what = f"cluster {cluster_id} failed round {r}"
    if any(sign in kinds or sign in text for sign in MEMORY_SIGNS):
        live = spec.placement.max_materialized if spec is not None else "?"
        return (f"{what}: out of memory (Ray's memory monitor killed a training actor). "
                f"Lower [placement] max_materialized (now {live}), use a smaller model, or "
                "bound the embedded Ray in cluster.toml ([ray] num_cpus, object_store_memory). "
                f"Cause: {text}")[:1000]
    if any(sign in kinds or sign in text for sign in DEATH_SIGNS):
        return (f"{what}: a training actor died (see the Ray logs of that cluster; if it was "
                f"killed for memory, lower [placement] max_materialized). Cause: {text}")[:1000]
    return f"{what}: {text}"[:1000]
