"""TopologyManager on Ray: messages are object references, shared by readers, and released
once the round's mailboxes are cleared and the readers are done."""

from __future__ import annotations

import time

import numpy as np
import pytest

from worker.topology import Message, TopologyManager, star

pytestmark = pytest.mark.slow


def reference_counts() -> dict[bytes, object]:
    import ray

    return ray._private.worker.global_worker.core_worker.get_all_reference_counts()  # type: ignore[no-any-return]


def nbytes_of(weights: dict[str, np.ndarray]) -> int:
    return int(sum(a.nbytes for a in weights.values()))


def test_ray_messages_are_shared_object_refs_freed_after_the_round(ray_context) -> None:  # type: ignore[no-untyped-def]
    import ray

    ctx = ray_context
    topo = TopologyManager(star(3), ctx)
    weights = {"w": np.ones((1024, 1024), dtype=np.float32)}  # 4 MiB, in the object store
    ref = ctx.put(Message(weights, 5))
    object_id = ref.hex().encode()
    topo.broadcast("server", [0, 1, 2], ref, 1, nbytes=nbytes_of(weights))
    inboxes = [topo.receive(c, 1, ["server"]) for c in range(3)]
    assert all(isinstance(r, ray.ObjectRef) and r == ref for ((_, r),) in inboxes)
    assert object_id in reference_counts()
    readers = [ctx.remote(nbytes_of_message, r) for ((_, r),) in inboxes]
    assert ctx.get(readers, timeout=60) == [4 * 1024 * 1024] * 3
    topo.end_round(1)
    del ref, inboxes, readers
    assert topo.pending() == 0
    # the owner drops task-argument references when it processes the task replies, which
    # may trail `get` by a moment: wait for that, then the object must be gone
    for _ in range(200):
        if object_id not in reference_counts():
            break
        time.sleep(0.05)
    assert object_id not in reference_counts(), reference_counts().get(object_id)


def nbytes_of_message(message: Message) -> int:
    return int(sum(np.asarray(a).nbytes for a in message.weights.values()))
