"""Construction and tuning of the libp2p host, Gossipsub router and Kademlia DHT.

py-libp2p 0.8.1 defaults we change, and why:
- yamux ``MAX_MESSAGE_SIZE`` 64 KiB -> 4 MiB: 4 MiB writes measured ~545 MB/s vs ~160 MB/s.
  It is a module global, so it applies to every yamux connection in this process.
- yamux credit: a stream's reader grants its sender more window once half of it was read
  (go-yamux's rule), where the library sent a WINDOW_UPDATE frame after nearly every read
  of a small message (its release-on-read and "partial slack" paths): a frame back for each
  one, and through a relay four (the inner session's update crosses the hop too). Measured
  on the private testbed of test_relay_job at rest (2 gateways, 4 private daemons, 40 s):
  daemons' CPU 3.4-3.9 -> 2.2-2.3 s each, the relaying gateway's 5.3-6.1 -> 2.9 s.
- ``max_connections_per_peer=1``: otherwise ``connect()`` waits 250 ms for more.
- Gossipsub heartbeat 120 s -> ``heartbeat_interval`` (1 s), so meshes form quickly.
- ``max_connections`` 300 -> 1024 and pruning above 768: unauthenticated peers are
  bounded by fabricd._preauth (MAX_PENDING_PEERS, auth_timeout), so a flood of
  strangers can neither fill the connection table nor trigger pruning of members
  (members are also protected from pruning once verified).
- The auto-connector is off (see ``_disable_auto_connector``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetStream
from libp2p.crypto.keys import KeyPair
from libp2p.custom_types import TProtocol
from libp2p.host.exceptions import StreamFailure
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.stream_muxer.yamux import yamux as _yamux
from libp2p.tools.anyio_service.context import background_trio_service

from fabricd import _fastpath
from fedcore.logs import get_logger

log = get_logger("fabricd.host")

GOSSIPSUB_PROTOCOLS = ("/meshsub/1.1.0", "/meshsub/1.0.0")
YAMUX_FRAME = 4 * 1024 * 1024 + _yamux.HEADER_SIZE
YAMUX_WINDOW = 16 * 1024 * 1024
MAX_CONNECTIONS = 1024
PRUNE_ABOVE = 768


def tune_yamux(max_message_size: int = YAMUX_FRAME, window: int = YAMUX_WINDOW) -> None:
    """Raise yamux's frame size and initial window, install the Noise/TCP fast path."""
    _yamux.MAX_MESSAGE_SIZE = max_message_size
    _yamux.DEFAULT_WINDOW_SIZE = window
    _yamux.YamuxStream._auto_tune_and_send_window_update = _grant_half_read  # type: ignore[method-assign]
    _fastpath.apply()


async def _grant_half_read(self: Any, *, bytes_read: int = 0) -> None:
    """Give the sender back the window the reader consumed, once that is half of it."""
    async with self.window_lock:
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        consumed = self.target_recv_window - (self.recv_window + buffered)
        if consumed < self.target_recv_window // 2:
            return
        self.recv_window += consumed
    await self.send_window_update(consumed, skip_lock=True)


@dataclass
class HostStack:
    host: IHost
    pubsub: Pubsub
    gossipsub: GossipSub
    dht: KadDHT


def build_host(key_pair: KeyPair, announce: list[str] | None = None) -> IHost:
    tune_yamux()
    kwargs: dict[str, Any] = {}
    if announce:
        kwargs["announce_addrs"] = [multiaddr.Multiaddr(a) for a in announce]
    host = new_host(
        key_pair=key_pair,
        muxer_preference="YAMUX",
        connection_config=ConnectionConfig(max_connections_per_peer=1, max_connections=MAX_CONNECTIONS,
                                           high_watermark=PRUNE_ABOVE),
        **kwargs,
    )
    _disable_auto_connector(host)
    _shorten_dial_blacklist(host)
    return host


NEGATIVE_DIAL_TTL = 2.0  # seconds libp2p refuses to redial a peer whose addresses all failed


def _shorten_dial_blacklist(host: IHost) -> None:
    """libp2p 0.8.1 refuses every dial to a peer for 60 s after one dial to it failed (its
    swarm's negative peer cache). A cluster restarted during a job would then stay
    unreachable for a minute after its daemon is back (measured: 55 s for a restarted
    bootstrap daemon). fabricd.discovery paces its own redials (one per peer in flight,
    1 s apart after a failure), so the cache only needs to absorb bursts."""
    cache = getattr(host.get_network(), "_negative_peer_cache", None)
    if cache is not None and hasattr(cache, "_ttl"):
        cache._ttl = NEGATIVE_DIAL_TTL


def _disable_auto_connector(host: IHost) -> None:
    """fabricd dials only bootstrap peers and verified members (fabricd.discovery).

    libp2p's auto-connector dials every peer in the peerstore whenever the connection
    count is below its target: any address a stranger ever advertised (identify, DHT
    replies) would be dialled - a reflection vector - so it is switched off.
    """
    connector = getattr(host.get_network(), "auto_connector", None)
    if connector is not None:

        async def never() -> None:
            return None

        connector.maybe_connect = never


class _ConnectedOnly:
    """The host as the DHT sees it: streams to peers this daemon is connected to, no dial.

    py-libp2p's Kademlia lookups open a stream to every peer a FIND_NODE reply names, at
    the addresses the reply gives: a member could make every daemon dial any address (the
    reflection the auto-connector was switched off for), and a lookup dialled members that
    fabricd.discovery's tie-break left to the other side (two connections for one pair).
    Members are linked by discovery; the DHT uses those links."""

    def __init__(self, host: IHost) -> None:
        self._host = host

    def __getattr__(self, name: str) -> Any:
        return getattr(self._host, name)

    async def new_stream(self, peer_id: ID, protocol_ids: Sequence[TProtocol]) -> INetStream:
        if not self._host.get_network().get_connections(peer_id):
            raise StreamFailure(f"DHT: not connected to {peer_id} (it dials no one)")
        return await self._host.new_stream(peer_id, protocol_ids)


def build_gossipsub(heartbeat_interval: float) -> GossipSub:
    return GossipSub(
        protocols=list(GOSSIPSUB_PROTOCOLS),  # type: ignore[arg-type]
        degree=6,
        degree_low=4,
        degree_high=12,
        heartbeat_initial_delay=0.1,
        heartbeat_interval=heartbeat_interval,  # type: ignore[arg-type]
        # Heartbeats are one per second per daemon; allow bursts well above that.
        max_messages_per_topic_per_second=1000.0,
        # Eclipse protection wants >= 3 distinct IPs; a test mesh on 127.0.0.1 has one.
        eclipse_protection_enabled=False,
    )


@asynccontextmanager
async def open_host_stack(key_pair: KeyPair, listen: list[str], announce: list[str] | None,
                          heartbeat_interval: float) -> AsyncIterator[HostStack]:
    """Run a listening host with Pubsub/Gossipsub and a server-mode DHT until the block exits."""
    host = build_host(key_pair, announce)
    gossipsub = build_gossipsub(heartbeat_interval)
    pubsub = Pubsub(host, gossipsub)
    dht = KadDHT(_ConnectedOnly(host), DHTMode.SERVER, enable_random_walk=False)  # type: ignore[arg-type]
    try:
        async with host.run([multiaddr.Multiaddr(a) for a in listen]):
            async with background_trio_service(pubsub), background_trio_service(gossipsub):
                async with background_trio_service(dht):
                    await pubsub.wait_until_ready()
                    yield HostStack(host=host, pubsub=pubsub, gossipsub=gossipsub, dht=dht)
            await trio.lowlevel.checkpoint()
    except* RuntimeError as group:
        # py-libp2p 0.8.1: a pubsub message that arrives while Pubsub's service is stopping
        # is handed to its closed nursery, and the RuntimeError escapes from the
        # connection's task (3 of 15 stops of a host that was being sent gossip, here). The
        # host is going away anyway: that is not a failure of the stop; anything else is.
        rest = group.subgroup(lambda e: not isinstance(e, BaseExceptionGroup) and not _late_arrival(e))
        if rest is not None:
            raise rest from None
        log.info("host.stopped", late_messages=len(_leaves(group)),
                 reason="pubsub messages arrived while it stopped; dropped")


def _late_arrival(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and "Nursery is closed to new arrivals" in str(exc)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out
