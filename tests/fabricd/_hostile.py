"""In-process hostile peers for the security tests: strangers, forgers, lying members."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr

from fabricd._host import build_host
from fabricd._streams import read_message_exact
from proto.certs import issue_certificate, load_ca_private
from proto.codec import frame
from proto.ids import PROTOCOL_MEMBER
from proto.messages import MemberAck, MemberHello


def certificate_for(key_pair: KeyPair, ca_dir: Path, cluster: str, role: str = "cluster") -> bytes:
    return issue_certificate(load_ca_private(ca_dir), key_pair.public_key.to_bytes(), cluster, role,
                             not_before=int(time.time()) - 60)


def peer_info(addr: str) -> PeerInfo:
    return info_from_p2p_addr(multiaddr.Multiaddr(addr))


@asynccontextmanager
async def raw_host(key_pair: KeyPair | None = None, listen: bool = False) -> AsyncIterator[IHost]:
    """A bare libp2p host (no membership service): it answers nothing on /fedpilot/*."""
    host = build_host(key_pair or create_new_key_pair())
    addrs = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")] if listen else []
    async with host.run(addrs):
        yield host


async def hello(host: IHost, peer: ID, certificate: bytes) -> MemberAck:
    """Present ``certificate`` on /fedpilot/member and return the daemon's answer."""
    stream = await host.new_stream(peer, [PROTOCOL_MEMBER])  # type: ignore[list-item]
    await stream.write(frame(MemberHello(certificate=certificate)))
    with trio.fail_after(30):
        ack = await read_message_exact(stream, 1 << 20)
    await stream.close()
    assert isinstance(ack, MemberAck), ack
    return ack


async def stall(host: IHost, peer: ID, protocols: list[str], hold: trio.Event) -> int:
    """Open one stream per protocol and send nothing on it until ``hold`` is set.

    Returns how many streams could be opened (the daemon may reset or refuse some)."""
    opened: list[Any] = []
    for proto in protocols:
        try:
            with trio.fail_after(15):
                opened.append(await host.new_stream(peer, [proto]))  # type: ignore[list-item]
        except Exception:  # noqa: BLE001 - a refused or reset stream is an expected outcome
            continue
    await hold.wait()
    for stream in opened:
        try:
            await stream.reset()
        except Exception:  # noqa: BLE001
            pass
    return len(opened)


async def drip_until_cut(stream: Any, data: bytes, head: int, every: float, timeout: float = 60) -> bool:
    """Write ``data[:head]``, then the rest of ``data`` and zero bytes after it, a byte
    every ``every`` s, until a write fails: True once the other end cut (reset) the
    stream, False if it still takes bytes after ``timeout`` s."""
    with trio.move_on_after(timeout):
        try:
            await stream.write(data[:head])
            rest = data[head:]
            while True:
                await trio.sleep(every)
                await stream.write(rest[:1] or b"\0")
                rest = rest[1:]
        except Exception:  # noqa: BLE001 - a reset (or closed muxer): the cut looked for
            return True
    return False


def is_connected(host: IHost, peer: ID) -> bool:
    return bool(host.get_network().connections.get(peer))


@asynccontextmanager
async def stalled_strangers(target: PeerInfo, count: int, protocols: list[str], *,
                            concurrency: int = 25, timeout: float = 300,
                            ) -> AsyncIterator[tuple[list[IHost], list[str]]]:
    """``count`` strangers (fresh keys, no certificate) connect to ``target`` and each holds
    one stream per protocol open without a byte, until the block ends.

    Yields the hosts that connected and why the others could not (the target may drop a
    connection while it is still being set up)."""
    hold = trio.Event()
    hosts: list[IHost] = []
    refused: list[str] = []

    async def stranger(limiter: trio.CapacityLimiter) -> None:
        async with raw_host() as host:
            async with limiter:
                try:
                    with trio.fail_after(30):
                        await host.connect(target)
                except Exception as exc:  # noqa: BLE001 - e.g. dropped by the target while connecting
                    refused.append(type(exc).__name__)
                    return
                hosts.append(host)
            await stall(host, target.peer_id, protocols, hold)

    async with trio.open_nursery() as nursery:
        limiter = trio.CapacityLimiter(concurrency)
        for _ in range(count):
            nursery.start_soon(stranger, limiter)
        with trio.fail_after(timeout):
            while len(hosts) + len(refused) < count:
                await trio.sleep(0.1)
        try:
            yield hosts, refused
        finally:
            hold.set()


class _Conn:
    def __init__(self, peer: ID) -> None:
        self.peer_id = peer


class MemoryStream:
    """A libp2p stream in memory: from ``peer`` (``muxed_conn.peer_id``, as Noise proved
    it), seen at ``observed`` (None: a relayed link), holding ``incoming``; ``silent``:
    its reads never return. What is written is kept in ``written``."""

    def __init__(self, peer: ID, incoming: bytes, observed: tuple[str, int] | None = None,
                 silent: bool = False) -> None:
        self.muxed_conn = _Conn(peer)
        self.incoming = bytearray(incoming)
        self.observed = observed
        self.silent = silent
        self.written = bytearray()
        self.closed = False

    def get_remote_address(self) -> tuple[str, int] | None:
        return self.observed

    async def read(self, n: int | None = None) -> bytes:
        if self.silent:
            await trio.sleep_forever()
        if not self.incoming:
            raise StreamEOF("end")
        n = n or len(self.incoming)
        out, self.incoming = bytes(self.incoming[:n]), self.incoming[n:]
        return out

    async def write(self, data: Any) -> None:
        self.written += bytes(data)

    async def close(self) -> None:
        self.closed = True

    async def reset(self) -> None:
        self.closed = True
