"""Gossipsub without silent drops.

py-libp2p 0.8.1 drops gossip silently in four places: a per-peer outbound queue of 32
RPCs, RPCs over 1 MiB, a 10 msg/s per-peer-per-topic rate limit, and a subscription
channel of 32 messages. ``ReliableGossip`` works around each one:

- the rate limit is raised in ``_host.build_gossipsub`` (1000 msg/s);
- the subscription channel is enlarged before subscribing;
- ``publish`` waits while any peer's outbound queue is half full (backpressure
  instead of loss) and raises ``MessageTooLarge`` for messages over
  ``MAX_GOSSIP_BYTES`` - the sender is told, and large data goes on update streams.
"""

from __future__ import annotations

from typing import Any

import trio
from libp2p.pubsub import pubsub as _pubsub_module
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.rpc_queue import OutBoundQueueSize

from proto.errors import MessageTooLarge

#: Leaves room for the RPC envelope and signature under the library's 1 MiB RPC limit.
MAX_GOSSIP_BYTES = 512 * 1024
SUBSCRIPTION_BUFFER = 4096
_QUEUE_HIGH_WATER = OutBoundQueueSize // 2


class ReliableGossip:
    """Publish and subscribe on one Pubsub with backpressure instead of silent loss."""

    def __init__(self, pubsub: Pubsub, *, max_wait: float = 30.0) -> None:
        self.pubsub = pubsub
        self.max_wait = max_wait

    async def subscribe(self, topic: str) -> Any:
        _pubsub_module.SUBSCRIPTION_CHANNEL_SIZE = SUBSCRIPTION_BUFFER  # type: ignore[attr-defined]
        return await self.pubsub.subscribe(topic)

    def _busiest_queue(self) -> int:
        queues = getattr(self.pubsub, "peer_queues", {})
        return max((len(q) for q in queues.values()), default=0)

    async def publish(self, topic: str, data: bytes) -> None:
        """Publish ``data``; waits while a peer's outbound queue is half full.

        Raises MessageTooLarge over MAX_GOSSIP_BYTES and trio.TooSlowError if the queues
        do not drain within ``max_wait`` seconds - never drops silently.
        """
        if len(data) > MAX_GOSSIP_BYTES:
            raise MessageTooLarge(
                f"gossip message of {len(data)} bytes on {topic!r} is over the {MAX_GOSSIP_BYTES}-byte "
                "limit; send large data as an update stream")
        with trio.fail_after(self.max_wait):
            while self._busiest_queue() >= _QUEUE_HIGH_WATER:
                await trio.sleep(0.001)
        await self.pubsub.publish(topic, data)
        await trio.lowlevel.checkpoint()
