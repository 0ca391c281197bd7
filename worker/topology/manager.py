"""Routing messages between the nodes of a topology, by object reference.

`TopologyManager` is told which graph nodes run here (`local_nodes`); a message to a local
node is just its object reference put in the receiver's mailbox (on Ray, the object store
keeps the data; several readers share it; it is freed once the mailbox is cleared at the
end of the round and the last reader is done). A message to a remote node is encoded as
safetensors and handed to a `RemoteTransport`, which the multi-cluster executor provides
(fabricd's bridge). Callers send and receive the same way whatever the locality.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import networkx as nx

from worker.context import ExecutionContext, Ref

from .messages import decode_message, encode_message

log = logging.getLogger(__name__)

NodeId = Hashable
"""A graph node: an int for a client, a str for an aggregator."""


class RoutingError(RuntimeError):
    """A message cannot be routed or did not arrive; the message names the nodes and round."""


class RemoteTransport(Protocol):
    """Carries messages to and from nodes on other clusters (e.g. through fabricd)."""

    def send(self, src: NodeId, dst: NodeId, weights_bytes: bytes, round: int) -> None:
        """Deliver `weights_bytes` (safetensors) from local `src` to remote `dst`."""

    def receive(self, dst: NodeId, round: int, senders: Sequence[NodeId]
                ) -> list[tuple[NodeId, bytes]]:
        """Block until local `dst` has one message for `round` from each remote sender in
        `senders`; return them as (sender, safetensors bytes). Raise TimeoutError if not."""


@dataclass
class Traffic:
    """Bytes and messages moved, split by path."""

    bytes_intra: int = 0
    bytes_inter: int = 0
    messages_intra: int = 0
    messages_inter: int = 0


class TopologyManager:
    """Mailboxes of object references for local nodes, a transport for remote ones."""

    def __init__(self, graph: nx.Graph, context: ExecutionContext,
                 local_nodes: Collection[NodeId] | None = None,
                 transport: RemoteTransport | None = None) -> None:
        self.graph = graph
        self.context = context
        self.local_nodes = frozenset(graph.nodes if local_nodes is None else local_nodes)
        unknown = [n for n in self.local_nodes if n not in graph]
        if unknown:
            raise RoutingError(f"local nodes {sorted(map(str, unknown))} are not in the "
                               f"{graph.graph.get('kind', '')} topology")
        self.remote_nodes = frozenset(n for n in graph.nodes if n not in self.local_nodes)
        if self.remote_nodes and transport is None:
            raise RoutingError(
                f"{len(self.remote_nodes)} node(s) of the topology run elsewhere (e.g. "
                f"{sorted(map(str, self.remote_nodes))[:3]}) but no RemoteTransport was given"
            )
        self.transport = transport
        self._mailboxes: dict[tuple[NodeId, int], dict[NodeId, Ref]] = {}
        self._lock = threading.Lock()
        self.traffic = Traffic()

    def is_local(self, node: NodeId) -> bool:
        return node in self.local_nodes

    def neighbours(self, node: NodeId) -> list[NodeId]:
        """Graph neighbours of `node`, clients (ints) first in id order, then aggregators."""
        return sorted(self.graph.neighbors(node), key=_node_key)

    def send(self, src: NodeId, dst: NodeId, message: Ref, round: int, *, nbytes: int) -> None:
        """Deliver the message behind reference `message` from local `src` to `dst`.

        `nbytes` is the tensor size the reference stands for (counted as intra traffic);
        remote deliveries count the encoded bytes.
        """
        self.broadcast(src, [dst], message, round, nbytes=nbytes)

    def broadcast(self, src: NodeId, dsts: Sequence[NodeId], message: Ref, round: int, *,
                  nbytes: int) -> None:
        """`send` to each of `dsts`; the value is fetched and encoded once for remote ones."""
        if src not in self.local_nodes:
            raise RoutingError(f"node {src!r} is not local; it cannot send in round {round}")
        payload: bytes | None = None
        for dst in dsts:
            if dst not in self.graph:
                raise RoutingError(f"round {round}: {src!r} sends to unknown node {dst!r}")
            if dst in self.local_nodes:
                with self._lock:
                    box = self._mailboxes.setdefault((dst, round), {})
                    if src in box:
                        raise RoutingError(f"round {round}: second message {src!r} -> {dst!r}")
                    box[src] = message
                    self.traffic.bytes_intra += nbytes
                    self.traffic.messages_intra += 1
                continue
            if payload is None:
                payload = encode_message(self.context.get(message))
            assert self.transport is not None
            self.transport.send(src, dst, payload, round)
            with self._lock:
                self.traffic.bytes_inter += len(payload)
                self.traffic.messages_inter += 1
            log.debug("event=message_sent_remote src=%s dst=%s round=%d bytes=%d",
                      src, dst, round, len(payload))

    def receive(self, dst: NodeId, round: int, senders: Sequence[NodeId]
                ) -> list[tuple[NodeId, Ref]]:
        """One message reference per sender for local `dst` in `round`, sorted by sender.

        Local senders must have sent already; remote ones are awaited through the
        transport, decoded and put in the object store.
        """
        if dst not in self.local_nodes:
            raise RoutingError(f"node {dst!r} is not local; it cannot receive in round {round}")
        local = [s for s in senders if s in self.local_nodes]
        remote = [s for s in senders if s not in self.local_nodes]
        with self._lock:
            box = dict(self._mailboxes.get((dst, round), {}))
        missing = [s for s in local if s not in box]
        if missing:
            raise RoutingError(f"round {round}: {dst!r} has no message from local node(s) "
                               f"{missing}; they must send before {dst!r} receives")
        got = [(s, box[s]) for s in local]
        if remote:
            assert self.transport is not None
            arrived = dict(self.transport.receive(dst, round, remote))
            absent = [s for s in remote if s not in arrived]
            if absent:
                raise RoutingError(f"round {round}: {dst!r} did not receive from remote "
                                   f"node(s) {absent}")
            for src in remote:
                message = decode_message(arrived[src], source=f"node {src!r}")
                got.append((src, self.context.put(message)))
        return sorted(got, key=lambda item: _node_key(item[0]))

    def end_round(self, round: int) -> None:
        """Forget the mailboxes of `round` and earlier (their references are released)."""
        with self._lock:
            for key in [k for k in self._mailboxes if k[1] <= round]:
                del self._mailboxes[key]

    def take_traffic(self) -> Traffic:
        """The traffic counted since the last call, and reset the counters."""
        with self._lock:
            snapshot, self.traffic = self.traffic, Traffic()
        return snapshot

    def pending(self) -> int:
        """References still held in mailboxes (0 after `end_round` of the last round)."""
        with self._lock:
            return sum(len(box) for box in self._mailboxes.values())


def _node_key(node: NodeId) -> tuple[int, int, str]:
    if isinstance(node, int):
        return (0, node, "")
    return (1, 0, str(node))
