"""Gossipsub as fabricd configures it: ~1 s heartbeats, a 1,000-message burst arrives whole,
and a 4 MiB message is refused to the sender (it belongs on an update stream).

The library alone delivers 32 of such a burst (per-peer outbound queue of 32 RPCs,
dropped silently); ReliableGossip's backpressure is what makes this test pass.
"""

from __future__ import annotations

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr

from fabricd._host import open_host_stack
from fabricd.gossip import ReliableGossip
from proto.errors import MessageTooLarge

TOPIC = "fedpilot/test-burst/1"


@pytest.mark.trio
async def test_burst_of_1000_is_delivered_and_4_mib_is_refused_to_the_sender() -> None:
    async with (
        open_host_stack(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"], None, 1.0) as a,
        open_host_stack(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"], None, 1.0) as b,
    ):
        addr = str(b.host.get_addrs()[0])
        if "/p2p/" not in addr:
            addr += f"/p2p/{b.host.get_id()}"
        await a.host.connect(info_from_p2p_addr(multiaddr.Multiaddr(addr)))
        sender, receiver = ReliableGossip(a.pubsub), ReliableGossip(b.pubsub)
        await sender.subscribe(TOPIC)
        sub = await receiver.subscribe(TOPIC)
        # A ~1 s heartbeat (library default: 120 s) grafts the mesh within seconds.
        with trio.fail_after(30):
            while not (a.gossipsub.mesh.get(TOPIC) and b.gossipsub.mesh.get(TOPIC)):
                await trio.sleep(0.05)

        n = 1000
        received: set[bytes] = set()

        async def drain() -> None:
            while len(received) < n:
                received.add(bytes((await sub.get()).data))

        t0 = trio.current_time()
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain)
                for k in range(n):
                    await sender.publish(TOPIC, b"burst-%04d" % k)
        print(f"burst of {n}: {trio.current_time() - t0:.2f} s")
        assert received == {b"burst-%04d" % k for k in range(n)}

        with pytest.raises(MessageTooLarge, match="update stream"):
            await sender.publish(TOPIC, b"x" * (4 * 1024 * 1024))
