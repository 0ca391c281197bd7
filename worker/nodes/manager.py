"""NodeManager: materializes VirtualNodes as FederatedNode actors, at most a cap at once.

How and why actors are recycled (rather than killed and started again) is in the
`worker.nodes` package docstring.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from fedcore.data import ClientPartition, Dataset
from worker.context import ActorHandle, ExecutionContext, Ref, Reservation

from .federated import FederatedNode
from .virtual import NodeConfig, VirtualNode

log = logging.getLogger(__name__)


@dataclass
class NodeStats:
    """What the manager did: actors started/killed, clients loaded/saved, peak alive."""

    created: int = 0
    killed: int = 0
    materializations: int = 0
    dematerializations: int = 0
    alive: int = 0
    max_alive: int = 0


@dataclass
class _Slot:
    index: int
    handle: ActorHandle | None = None
    client: int | None = None


class NodeManager:
    """Materializes clients as FederatedNode actors on first use, at most
    `max_materialized` at once, inside a placement group reserved by `start()`.

    `call(client, method, *args)` never blocks on training: loads, saves and calls are
    queued on the actors in order and return references.
    """

    def __init__(self, context: ExecutionContext, config: NodeConfig, dataset: Dataset | Ref,
                 partition: ClientPartition, clients: Sequence[int], *, max_materialized: int,
                 strategy: str = "SPREAD", cpus_per_node: float = 0.25, recycle: bool = True,
                 name_prefix: str | None = None, keep_state: bool = True) -> None:
        if max_materialized < 1:
            raise ValueError(f"placement.max_materialized must be >= 1, got {max_materialized}")
        self.context = context
        self.config = config
        ids = clients if isinstance(clients, range) else [int(c) for c in clients]
        self.virtual_nodes = dict(zip(ids, map(VirtualNode, ids, repeat(config)), strict=True))
        self._dataset = dataset
        self._partition = partition
        self.capacity = min(max_materialized, len(self.virtual_nodes))
        self.strategy = strategy
        self.cpus_per_node = cpus_per_node
        # [training] num_gpus: each actor slot's bundle reserves that share of a GPU
        self.gpus_per_node = float(config.training.num_gpus)
        self.recycle = recycle
        # False when the caller hands every call the model to start from (the round engine
        # holds each node's model): an actor then only binds a client's data on a switch,
        # with no save of the old client's weights and no load of the new one's
        self.keep_state = keep_state
        self.name_prefix = name_prefix or f"fedpilot/{config.job_id}/{os.getpid()}-{id(self):x}"
        self.stats = NodeStats()
        self._slots = [_Slot(i) for i in range(self.capacity)]
        self._lru: OrderedDict[int, _Slot] = OrderedDict()
        self._next_slot = 0  # train_batch's round robin
        #: how many slots train_batch spreads over: as many actors as can train at once
        #: (a batch already pays for its call; more actors only take memory and CPU)
        self.batch_slots = self.capacity
        self._states: dict[int, Ref] = {}
        self._reservation: Reservation | None = None
        self._dataset_ref: Ref | None = None
        self._lock = threading.RLock()

    def start(self) -> Reservation:
        """Reserve the placement group (one bundle per slot); raises `PlacementError` at once
        when the cluster cannot hold it. No actor exists before this succeeds."""
        with self._lock:
            if self._reservation is None:
                bundle = {"CPU": self.cpus_per_node}
                if self.gpus_per_node > 0:
                    bundle["GPU"] = self.gpus_per_node
                bundles = [bundle] * self.capacity
                self._reservation = self.context.reserve(bundles, self.strategy)
                is_ref = not isinstance(self._dataset, Dataset)
                self._dataset_ref = self._dataset if is_ref else self.context.put(self._dataset)
            return self._reservation

    def call(self, client: int, method: str, *args: Any) -> Ref:
        """Call `method(*args)` on `client`'s actor, materializing it first if needed."""
        with self._lock:
            slot = self._materialize(int(client))
            assert slot.handle is not None
            return slot.handle.call(method, *args)

    def train_batch(self, clients: Sequence[int], round_index: int, model: Any) -> list[Ref]:
        """Train `clients` in one call on the next actor slot (round robin), each from
        `model`; one reference per client's update. Only for a manager whose callers bring
        the model (keep_state=False): the slot's actor binds each client in turn, so it no
        longer holds the client the LRU thought it did."""
        if self.keep_state:
            raise RuntimeError("train_batch needs keep_state=False (the caller brings every "
                               "model); clients that keep state train one call each")
        with self._lock:
            missing = [c for c in clients if int(c) not in self.virtual_nodes]
            if missing:
                raise KeyError(f"clients {missing[:5]} are not this manager's clients")
            if self._reservation is None:
                raise RuntimeError("NodeManager.start() must reserve the placement group first")
            slot = self._slots[self._next_slot % max(1, min(self.batch_slots,
                                                            len(self._slots)))]
            self._next_slot += 1
            if slot.client is not None:
                self._lru.pop(slot.client, None)
                slot.client = None
            if slot.handle is None:
                self._start_actor(slot)
            assert slot.handle is not None
            batch = [(int(c), self._partition.train_indices[int(c)],
                      self._partition.test_indices[int(c)]) for c in clients]
            self.stats.materializations += len(batch)
            if len(batch) == 1:  # (Ray would hand back a one-value call's tuple whole)
                slot.handle.bind(*batch[0])
                return [slot.handle.call("train", round_index, model)]
            return slot.handle.call_many("train_batch", len(batch), round_index, model, batch)

    def warm(self, slots: int, timeout: float = 600.0) -> None:
        """Start the actors of the first `slots` slots together and wait until each one
        has taken a training step (`FederatedNode.warm`): a cluster's actors start in
        parallel before its first round, not inside it, one by one."""
        with self._lock:
            if self._reservation is None:
                raise RuntimeError("NodeManager.start() must reserve the placement group first")
            started: list[Ref] = []
            for slot in self._slots[:max(0, slots)]:
                if slot.handle is None:
                    self._start_actor(slot)
                    assert slot.handle is not None
                    started.append(slot.handle.warm())
        if started:
            self.context.get(started, timeout=timeout)

    def close(self) -> None:
        """Kill every actor and release the placement group."""
        with self._lock:
            for slot in self._slots:
                if slot.handle is not None:
                    self._kill(slot)
            self._lru.clear()
            if self._reservation is not None:
                self.context.release(self._reservation)
                self._reservation = None

    def __enter__(self) -> NodeManager:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _materialize(self, client: int) -> _Slot:
        if client not in self.virtual_nodes:
            raise KeyError(f"client {client} is not one of this manager's clients")
        slot = self._lru.get(client)
        if slot is not None:
            self._lru.move_to_end(client)
            return slot
        if self._reservation is None:
            raise RuntimeError("NodeManager.start() must reserve the placement group first")
        # a manager whose callers bring every model binds a client to an actor for the
        # price of its indices: its calls share the `batch_slots` actors that train at
        # once, no more start (Ray, 2 CPUs, 7 clients a cluster: the final personalized
        # score started 6 more actors a cluster, 30 s after a job's last round)
        limit = len(self._slots) if self.keep_state else max(1, self.batch_slots)
        slot = next((s for s in self._slots[:limit] if s.client is None), None)
        if slot is None:
            evicted = next(c for c, s in self._lru.items() if s.index < limit)
            slot = self._lru.pop(evicted)
            self._dematerialize(evicted, slot)
        if slot.handle is None:
            self._start_actor(slot)
        assert slot.handle is not None
        train_idx = self._partition.train_indices[client]
        test_idx = self._partition.test_indices[client]
        if self.keep_state:
            slot.handle.load(client, train_idx, test_idx, self._states.get(client))
        else:
            slot.handle.bind(client, train_idx, test_idx)
        slot.client = client
        self._lru[client] = slot
        self.stats.materializations += 1
        log.debug("event=node_materialized job=%s client=%d slot=%d", self.config.job_id,
                  client, slot.index)
        return slot

    def _dematerialize(self, client: int, slot: _Slot) -> None:
        assert slot.handle is not None
        slot.client = None
        self.stats.dematerializations += 1
        if not self.keep_state:
            if not self.recycle:
                self._kill(slot)
            return
        self._states[client] = slot.handle.save()
        if not self.recycle:
            # the save must finish before the actor dies (kill does not wait for the queue)
            self.context.wait([self._states[client]], num_returns=1)
            self._kill(slot)
        log.debug("event=node_dematerialized job=%s client=%d slot=%d recycle=%s",
                  self.config.job_id, client, slot.index, self.recycle)

    def _start_actor(self, slot: _Slot) -> None:
        assert self._reservation is not None
        name = f"{self.name_prefix}/node-{self.stats.created}"
        slot.handle = self.context.actor(
            FederatedNode, self.config, self._dataset_ref, name=name,
            placement=self._reservation.bundle(slot.index), num_cpus=self.cpus_per_node)
        self.stats.created += 1
        self.stats.alive += 1
        self.stats.max_alive = max(self.stats.max_alive, self.stats.alive)
        log.info("event=actor_created job=%s name=%s slot=%d cpus=%g gpus=%g", self.config.job_id,
                 name, slot.index, self.cpus_per_node, self.gpus_per_node)

    def _kill(self, slot: _Slot) -> None:
        assert slot.handle is not None
        handle, slot.handle, slot.client = slot.handle, None, None
        self.context.kill(handle)
        try:  # returns once the actor is really gone, so a successor never overlaps it
            self.context.get(handle.ping(), timeout=60)
        except Exception:  # any failure here means "dead", which is what we wait for
            pass
        self.stats.killed += 1
        self.stats.alive -= 1
