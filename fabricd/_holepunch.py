"""DCUtR hole punching between members behind NAT (``[network] reachability`` private or
auto): a relayed link is upgraded to a direct one where the two NATs let it.

py-libp2p 0.8.1's ``circuit_v2/dcutr.py`` does the protocol (CONNECT with each side's
predicted public address - its NAT's address as a gateway observed it, at its listen
port - then SYNC, and both dial at once from their listen ports, so that each NAT sees
an outgoing SYN before the other's arrives: TCP simultaneous open). Here it is:

- behind ``Membership.guard`` like every other protocol: a stranger's DCUtR stream is
  refused before a byte is read, and a handler's error never reaches the host;
- driven by the library's own loop (every relayed link, at most 3 attempts a peer until
  a connection to it closes), and counted: ``fabricd status`` relay ``holepunch``
  (attempts, upgraded, failed) and each cluster's ``link`` ("upgraded": its connection
  is one a punch made; fabricd._relay.link_kind).

What a member can make this daemon do: dial the addresses its CONNECT names (at most
MAX_ADDRS of them, TCP only, three rounds a session, one session at a time and three
until a connection to it closes: ``_answer``), each a TCP
SYN and a Noise handshake that fails against anything but that member. The relayed link
stays until the direct one has carried 60 s (the library's grace), then closes; the
large-update data plane keeps its own path (fabricd/_dataplane.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStoreError
from libp2p.relay.circuit_v2 import dcutr
from libp2p.tools.anyio_service.context import background_trio_service
from multiaddr import Multiaddr

from fabricd._relay import _relayed, is_circuit
from fedcore.logs import get_logger

log = get_logger("fabricd.holepunch")

#: addresses of a peer's CONNECT that are dialled (the library takes up to 20)
MAX_ADDRS = 4
#: seconds a peer's circuit addresses stay in the peerstore when put back (host.connect's)
PEERSTORE_TTL = 120
#: listen addresses never offered to a peer (a dial there reaches the dialler's own machine)
UNSPECIFIED = ("0.0.0.0", "::")


def _listen_addrs(host: Any) -> list[tuple[int, str, int]]:
    """The host's own TCP listen addresses. The library reads them from ``get_addrs``,
    which a private daemon answers with its /p2p-circuit addresses only (fabricd._relay:
    nobody should dial behind its NAT), so it found no port to predict the public address
    from nor to dial from; the transport's addresses are the listen sockets themselves."""
    out = []
    for addr in host.get_transport_addrs():
        parsed = dcutr._tcp_ip_port(addr)
        if parsed is not None:
            out.append(parsed)
    return out


dcutr._local_tcp_listen_addrs = _listen_addrs  # every DCUtR in this process is a HolePunch


class HolePunch(dcutr.DCUtRProtocol):
    """The library's DCUtR with the daemon's guard, a cap on the addresses dialled and
    counts (module docstring)."""

    def __init__(self, host: IHost, guard: Callable[..., Any]) -> None:
        super().__init__(host)
        self.counts = dict.fromkeys(("holepunch_attempts", "holepunch_upgraded", "holepunch_failed",
                                     "holepunch_refused"), 0)
        #: the direct connections punches made (a connection gone is gone from here too)
        self.made: weakref.WeakSet[Any] = weakref.WeakSet()
        #: peers whose DCUtR session this daemon answers now, and how many it answered
        #: since its last connection to them closed
        self._answering: set[str] = set()
        self._answered: dict[str, int] = {}
        # the library's run() registers self._handle_dcutr_stream: this one is guarded
        self._handle_dcutr_stream = guard("dcutr", self._answer)  # type: ignore[method-assign]

    async def _answer(self, stream: Any) -> None:
        """A peer's DCUtR session, one at a time per peer and at most the library's own
        attempt budget (3) until a connection to it closes: each session makes this
        daemon dial the peer's addresses (the library runs any number at once)."""
        peer = str(stream.muxed_conn.peer_id)
        if peer in self._answering or self._answered.get(peer, 0) >= dcutr.MAX_HOLE_PUNCH_ATTEMPTS:
            self.counts["holepunch_refused"] += 1
            log.info("holepunch.refused", peer=peer, reason="a session under way, or "
                     f"{dcutr.MAX_HOLE_PUNCH_ATTEMPTS} since the link was made")
            await stream.reset()
            return
        self._answering.add(peer)
        self._answered[peer] = self._answered.get(peer, 0) + 1
        try:
            await dcutr.DCUtRProtocol._handle_dcutr_stream(self, stream)
        finally:
            self._answering.discard(peer)

    def on_peer_disconnected(self, peer_id: ID) -> None:
        super().on_peer_disconnected(peer_id)
        self._answered.pop(str(peer_id), None)

    async def _get_observed_addrs(self) -> list[bytes]:
        """The library's: our NAT's public address (as a gateway observed it) at our listen
        port, else - no outside observation, e.g. two sites behind one NAT, or loopback -
        our listen addresses themselves (it reads those from ``get_addrs``, which a private
        daemon answers with circuits only, and so sent none)."""
        predicted = await super()._get_observed_addrs()
        if predicted:
            return predicted
        return [Multiaddr(f"/ip{family}/{ip}/tcp/{port}").to_bytes()
                for family, ip, port in _listen_addrs(self.host) if ip not in UNSPECIFIED][:MAX_ADDRS]

    def _decode_observed_addrs(self, addr_bytes: list[bytes]) -> list[Multiaddr]:
        out = [a for a in super()._decode_observed_addrs(addr_bytes[:MAX_ADDRS * 4])
               if dcutr._tcp_ip_port(a) is not None]
        return out[:MAX_ADDRS]

    async def _perform_hole_punch(self, peer_id: ID, addrs: list[Multiaddr],
                                  as_responder: bool = False) -> bool:
        self.counts["holepunch_attempts"] += 1
        why = f"no direct connection to {len(addrs)} address(es)"
        try:
            ok = await super()._perform_hole_punch(peer_id, addrs, as_responder=as_responder)
        except Exception as exc:  # noqa: BLE001 - a failed punch leaves the relayed link
            ok, why = False, f"{type(exc).__name__}: {exc}"
        self._forget_predicted(peer_id)
        direct = [c for c in self.host.get_network().get_connections(peer_id) if not _relayed(c)]
        if ok and direct:
            self.counts["holepunch_upgraded"] += 1
            self.made.update(direct)
            log.info("holepunch.upgraded", peer=str(peer_id))
        else:
            self.counts["holepunch_failed"] += 1
            log.info("holepunch.failed", peer=str(peer_id), reason=why)
        return ok

    def _forget_predicted(self, peer_id: ID) -> None:
        """The library keeps the peer's predicted public addresses in the peerstore; they
        pass its NAT only in a simultaneous open, so a later plain dial there (the link
        lost) would wait out its timeout before the relays are tried: the peer keeps the
        /p2p-circuit addresses it announces, and only those."""
        store = self.host.get_peerstore()
        try:
            addrs = store.addrs(peer_id)
        except PeerStoreError:  # nothing (left) to forget
            return
        circuits = [a for a in addrs if is_circuit(a)]
        if circuits and len(circuits) < len(addrs):
            store.clear_addrs(peer_id)
            store.add_addrs(peer_id, circuits, PEERSTORE_TTL)

    def upgraded(self, conns: Iterable[Any]) -> bool:
        """Whether any of ``conns`` is a connection a punch made."""
        return any(c in self.made for c in conns)

    async def serve(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with background_trio_service(self):
            await self.event_started.wait()
            task_status.started()
            await trio.sleep_forever()

    def status(self) -> dict[str, int]:
        return dict(self.counts)
