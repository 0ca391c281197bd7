"""Circuit relay v2 between members: gateways relay for sites behind NAT.

py-libp2p 0.8.1 ships the protocol (``libp2p/relay/circuit_v2``), but its swarm never dials
a ``/p2p-circuit`` address and its transport brings a discovery service of its own, so the
parts are wired here by hand:

- ``RelayService`` (``[network] relay_service = true``, a gateway with a public address):
  the hop protocol behind ``Membership.guard`` - a stranger's reservation or circuit gets
  PERMISSION_DENIED and nothing else - with fabricd's limits: reservations (a member
  reserves for its own peer id only), circuits per member as source and as destination,
  bytes and seconds per circuit. Relayed bytes are counted (``fabricd status`` relay).
- ``RelayClient`` (``reachability = "private"`` or ``"auto"``): keeps a reservation at each
  bootstrap gateway that serves relays (renewed, and made again whenever the link to the
  gateway is new), answers the gateway's stop protocol - the circuit becomes a libp2p
  connection (Noise + yamux, membership checked on it like on any other) - and gives the
  ``/p2p-circuit`` addresses discovery announces.
- ``dial``: a member dials a ``/p2p-circuit`` address.

- DCUtR hole punching (fabricd/_holepunch.py) upgrades a relayed link between two members
  behind NAT to a direct one where both NATs allow it (``link_kind`` "upgraded").
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost, INetStream
from libp2p.connection_types import ConnectionType
from libp2p.host.ping import ID as PING_ID
from libp2p.host.ping import perform_ping_roundtrip
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.network.stream.exceptions import StreamEOF, StreamError
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID, STOP_PROTOCOL_ID, CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode, to_proto_status
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

from fabricd import _dialback as dialback
from fabricd import _fastpath
from fabricd._sender import NoRoute, open_stream
from fabricd._streams import LINGER_SECONDS, Handler, close_quietly, reset_quietly
from fabricd.admission import RATE_GRACE, RateFloor
from fabricd.config import Relay
from fabricd.metrics import UNWIRED, DaemonMetrics
from fedcore.logs import get_logger

log = get_logger("fabricd.relay")

Guard = Callable[[str, Handler, Callable[[INetStream, str], Awaitable[None]] | None], Handler]

RESERVATION_TTL = 3600
#: a reservation is renewed this long before it expires (or at once on a new link)
RENEW_MARGIN = 600.0
#: a gateway that refused a reservation, or offers no relay, is asked again after this
RETRY_REFUSED = 30.0
#: reachability auto: how often a gateway is asked to dial this daemon back
RECHECK_SECONDS = dialback.RECHECK_SECONDS
RELAY_READ = 1024 * 1024
HOP_TIMEOUT = 10.0
CIRCUIT = "/p2p-circuit"
#: multistream-select's message choosing Noise (varint length, "/noise\n")
NOISE_CHOSEN = b"\x07/noise\n"


def is_circuit(addr: Any) -> bool:
    return CIRCUIT in str(addr)


def _relayed(conn: Any) -> bool:
    try:
        if conn.get_connection_type() == ConnectionType.RELAYED:
            return True
        return any(is_circuit(a) for a in conn.get_transport_addresses())
    except Exception:  # noqa: BLE001 - an odd connection object counts as direct
        return False


def connections(host: IHost, peer_id: str) -> list[Any]:
    """This host's connections to ``peer_id`` (none for a peer id that is not base58: the
    swarm's lookup itself cannot fail)."""
    try:
        return list(host.get_network().get_connections(ID.from_base58(peer_id)))
    except ValueError:
        return []


def link_kind(host: IHost, peer_id: str) -> str:
    """"direct", "relayed" (only relayed connections to the peer), "upgraded" (direct since
    DCUtR punched through both NATs: fabricd/_holepunch.py; the peer's other ports, its
    data plane's among them, are still out of reach) or "none"."""
    conns = connections(host, peer_id)
    if not conns:
        return "none"
    if all(_relayed(c) for c in conns):
        return "relayed"
    punch = getattr(host, "_dcutr_protocol", None)  # the library's DCUtR registers itself there
    made = getattr(punch, "upgraded", None)
    return "upgraded" if made is not None and made(c for c in conns if not _relayed(c)) else "direct"


def relay_of(host: IHost, peer_id: str) -> str | None:
    """The gateway carrying this host's relayed link to ``peer_id`` (None: no such link)."""
    for conn in connections(host, peer_id):
        if _relayed(conn):
            for addr in conn.get_transport_addresses():
                head = str(addr).partition(CIRCUIT)[0]
                if "/p2p/" in head:
                    return head.rsplit("/p2p/", 1)[1]
    return None


class Bandwidth:
    """What a gateway passes on in all, circuits and splices: at most ``rate`` bytes a
    second (0 = unlimited), a token bucket of one second's bytes. Bytes are charged when
    read and the reader waits off the debt (``delay``), so a burst of one second passes at
    once and a steady stream at the rate. Thread-safe: splices copy in threads."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._level = float(rate)
        self._at = time.monotonic()
        #: seconds readers were held back, in all
        self.throttled = 0.0

    def delay(self, n: int) -> float:
        """Seconds to wait before passing on ``n`` bytes just read (charged now)."""
        if not self.rate:
            return 0.0
        with self._lock:
            now = time.monotonic()
            self._level = min(float(self.rate), self._level + (now - self._at) * self.rate) - n
            self._at = now
            wait = max(0.0, -self._level / self.rate)
            self.throttled += wait
            return wait


def _status_name(code: int) -> str:
    try:
        return StatusCode(code).name
    except ValueError:
        return str(code)


class _Frames:
    """One direction of a circuit, cut into the frames its two members exchange -
    multistream-select's varint-prefixed messages until "/noise" is chosen, then Noise's
    2-byte-prefixed ones (at most 64 KiB) - with a clock for the frame under way: a frame
    begun must arrive at the minimum rate after a grace, so a member dripping into a
    circuit holds it that long at most (an idle circuit, between frames, waits)."""

    def __init__(self, min_rate: float) -> None:
        self.min_rate = min_rate
        self.noise = False
        #: the frame's length prefix (in multistream-select, its first bytes too)
        self.head = b""
        #: its bytes still to come (-1: its length prefix is not complete)
        self.left = -1
        self.floor: RateFloor | None = None
        self.got = 0

    def wait(self) -> float:
        """Seconds the next read may take (inf between frames)."""
        return self.floor.wait_budget(self.got, math.inf) if self.floor else math.inf

    def feed(self, data: bytes) -> str | None:
        """Take bytes read; why to cut the circuit (too slow), or None."""
        i = 0
        while i < len(data):
            if self.floor is None:
                self.floor, self.got, self.head, self.left = RateFloor(self.min_rate), 0, b"", -1
            if self.left < 0:
                self.head += data[i:i + 1]
                take = 1
                self.left = self._length()
            else:
                take = min(self.left, len(data) - i)
                if not self.noise and len(self.head) < len(NOISE_CHOSEN):
                    self.head += data[i:i + take][:len(NOISE_CHOSEN)]
                self.left -= take
            i += take
            self.got += take
            if self.left == 0:
                self.noise = self.noise or self.head == NOISE_CHOSEN
                self.floor = None
        return self.floor.too_slow(self.got) if self.floor else None

    def _length(self) -> int:
        if self.noise:
            return int.from_bytes(self.head, "big") if len(self.head) == 2 else -1
        if self.head[-1] & 0x80:
            return -1
        return sum((b & 0x7F) << (7 * k) for k, b in enumerate(self.head))


class CircuitStream:
    """A circuit's stream as the byte stream of a raw connection, read ahead the way
    fabricd._fastpath reads TCP: the inner Noise session's 2-byte and 64 KiB reads come from
    a 1 MiB buffer (whole frames decrypted straight out of it), not from a yamux read each
    (measured: ~6x the receiver's CPU per byte without it)."""

    read = _fastpath._buffered_read

    def __init__(self, stream: INetStream) -> None:
        self.net = stream
        self.stream = self  # _buffered_read refills through self.stream.receive_some
        self.read_lock = trio.Lock()

    async def receive_some(self, n: int) -> bytes:
        try:
            return await self.net.read(n)
        except StreamEOF:
            return b""
        except StreamError as exc:
            raise trio.BrokenResourceError(str(exc)) from exc

    async def write(self, data: bytes) -> None:
        await self.net.write(data)

    async def close(self) -> None:
        await self.net.close()

    def get_remote_address(self) -> None:
        return None


def _raw(stream: INetStream, initiator: bool, ma: multiaddr.Multiaddr) -> RawConnection:
    return RawConnection(stream=CircuitStream(stream), initiator=initiator,  # type: ignore[arg-type]
                         connection_type=ConnectionType.RELAYED, addresses=[ma])


def _tag(host: IHost, peer_id: ID, muxed: Any, ma: multiaddr.Multiaddr) -> None:
    """Mark the swarm connection relayed (the generic upgrade cannot tell)."""
    for conn in host.get_network().get_connections(peer_id):
        if conn is muxed or getattr(conn, "muxed_conn", None) is muxed:
            conn.set_transport_info([ma], ConnectionType.RELAYED)  # type: ignore[attr-defined]


async def _hop(host: IHost, relay: str, msg: HopMessage) -> tuple[INetStream, HopMessage]:
    stream = await open_stream(host, relay, PROTOCOL_ID)
    try:
        with trio.fail_after(HOP_TIMEOUT):
            await write_delimited_msg(stream, msg)
            return stream, await read_delimited_msg(stream, HopMessage)
    except BaseException:
        await reset_quietly(stream)
        raise


async def dial(host: IHost, circuit: str, peer_id: ID, reach: float = math.inf,
               handshakes: float = math.inf) -> None:
    """A libp2p connection to ``peer_id`` through the relay ``circuit`` names
    (``<relay addr>/p2p/<relay>/p2p-circuit/p2p/<peer>``); ConnectionError saying why not.
    The relay must answer within ``reach`` seconds, the connection's handshakes through the
    circuit it opened then get ``handshakes`` seconds of their own: on a loaded machine
    they, not the relay, are the slow part, and a circuit given up then is work thrown away
    on three daemons."""
    relay_addr = circuit.partition(CIRCUIT)[0]
    relay_info = info_from_p2p_addr(multiaddr.Multiaddr(relay_addr))
    relay = str(relay_info.peer_id)
    try:
        with trio.fail_after(reach):
            if not host.get_network().get_connections(relay_info.peer_id):
                await host.connect(relay_info)
            stream, resp = await _hop(host, relay, HopMessage(
                type=HopMessage.CONNECT, peer=CircuitPeerId(id=peer_id.to_bytes())))
    except trio.TooSlowError:
        raise ConnectionError(f"relay {relay_addr} did not answer in {reach:.0f} s") from None
    except Exception as exc:  # noqa: BLE001 - whatever ended it, the relay is the cause
        raise ConnectionError(f"relay {relay_addr} unreachable: {type(exc).__name__}: {exc}") from exc
    if resp.status != to_proto_status(StatusCode.OK):
        await reset_quietly(stream)
        raise ConnectionError(f"relay {relay} refused a circuit to {peer_id}: {_status_name(resp.status)}")
    ma = multiaddr.Multiaddr(circuit)
    try:
        with trio.fail_after(handshakes):
            conn = await host.upgrade_outbound_connection(_raw(stream, True, ma), peer_id)
    except trio.TooSlowError:
        await reset_quietly(stream)
        raise ConnectionError(f"no connection to {peer_id} through relay {relay} in {handshakes:.0f} s "
                              "(its handshakes did not finish)") from None
    except BaseException:
        await reset_quietly(stream)
        raise
    _tag(host, peer_id, conn, ma)


def dial_circuits_too(host: IHost, timeout: float) -> None:
    """Make the host's swarm reach a peer through its /p2p-circuit addresses as well (its own
    dial skips them), for every stream opened to a peer not connected: its direct addresses
    first (half of ``timeout`` when it has relays too), then each relay with its share of
    ``timeout`` to answer - those this daemon is connected to first (a relay just killed is
    tried last, not for its whole share) - so a dead or silent relay leaves the next its
    time, and a relay that opened the circuit leaves the handshakes ``timeout`` (``dial``);
    the error names each. One dial per peer at a time: the lease, a resent request,
    discovery and the membership exchange all ask for a link at once when one is lost,
    and wait for that dial (its connection, or its error) instead of each making a circuit."""
    swarm = host.get_network()
    direct = swarm.dial_peer
    own = f"/p2p/{host.get_id()}{CIRCUIT}"  # a gateway reaches a member directly or not at all
    #: peer -> (the dial under way finished, its error)
    under_way: dict[ID, tuple[trio.Event, list[ConnectionError]]] = {}

    def _linked(circuit: str) -> bool:
        try:
            return bool(swarm.get_connections(info_from_p2p_addr(multiaddr.Multiaddr(
                circuit.partition(CIRCUIT)[0])).peer_id))
        except Exception:  # noqa: BLE001 - a malformed address: its dial says why, last
            return False

    async def dial_peer(peer_id: ID) -> list[Any]:
        while peer_id in under_way:
            done, error = under_way[peer_id]
            await done.wait()
            if swarm.get_connections(peer_id):
                return swarm.get_connections(peer_id)
            if error:  # its error, anew for each caller (NoRoute stays NoRoute: not retried at once)
                raise (NoRoute if isinstance(error[0], NoRoute) else ConnectionError)(str(error[0]))
            # that dial was given up (its caller's deadline): this caller dials
        under_way[peer_id] = (trio.Event(), [])
        try:
            return await _dial(peer_id)
        except Exception as exc:  # whatever it was, those waiting on this dial are told (then raised)
            under_way[peer_id][1].append(exc if isinstance(exc, ConnectionError)
                                         else ConnectionError(f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            under_way.pop(peer_id)[0].set()

    async def _dial(peer_id: ID) -> list[Any]:
        addrs = host.get_peerstore().addrs(peer_id)
        circuits = [str(a) for a in addrs if is_circuit(a) and own not in str(a)]
        circuits.sort(key=lambda c: not _linked(c))  # a gateway this daemon still reaches first
        if not circuits:
            return await direct(peer_id)
        failures = []
        if not all(is_circuit(a) for a in addrs):
            with trio.move_on_after(timeout / 2):
                try:
                    return await direct(peer_id)
                except Exception as exc:  # noqa: BLE001 - the relays may still reach it
                    failures.append(f"{type(exc).__name__}: {exc}")
        for circuit in circuits:
            try:
                await dial(host, circuit, peer_id, reach=timeout / len(circuits), handshakes=timeout)
                return swarm.get_connections(peer_id)
            except Exception as exc:  # noqa: BLE001 - the next relay may do
                failures.append(str(exc) if isinstance(exc, ConnectionError) else f"{type(exc).__name__}: {exc}")
        raise NoRoute("; ".join(failures))

    swarm.dial_peer = dial_peer  # type: ignore[method-assign]


class _HopMessages:
    """A hop stream as the library's handler reads it: its messages (RESERVE, CONNECT: a
    few hundred bytes) must all have come within the rate floor's grace - a member dripping
    one, or holding the stream open after a reservation, is cut at the grace, not at the
    library's 30 s per message (and not never: it reads message after message) - and once
    the stream carries a circuit, reads are the circuit's (_Frames keeps its floor)."""

    def __init__(self, stream: INetStream) -> None:
        self.stream = stream
        self.until = trio.current_time() + RATE_GRACE
        self.circuit = False
        self.cut = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    async def read(self, n: int | None = None) -> bytes:
        if self.circuit:
            return await self.stream.read(n)
        with trio.move_on_at(self.until):
            return await self.stream.read(n)
        self.cut = True
        raise trio.TooSlowError


class RelayService(CircuitV2Protocol):
    """The hop side of circuit relay v2 on a gateway, for members only (module docstring)."""

    def __init__(self, host: IHost, cfg: Relay, min_rate: float = 256 * 1024) -> None:
        limits = RelayLimits(duration=cfg.circuit_seconds, data=cfg.circuit_bytes,
                             max_circuit_conns=cfg.max_circuits, max_reservations=cfg.max_reservations,
                             reservation_ttl=RESERVATION_TTL)
        super().__init__(host, limits, allow_hop=True)
        self.max_circuits = cfg.max_circuits
        self.min_rate = min_rate
        #: relay.max_bytes_per_second, shared with the gateway's splices (fabricd/_splice.py)
        self.bandwidth = Bandwidth(cfg.max_bytes_per_second)
        self.metrics: DaemonMetrics = UNWIRED
        #: open circuits by source member (entries removed at zero: bounded by the members)
        self.by_source: dict[str, int] = {}
        self.counts = dict.fromkeys(("reservations_granted", "reservations_refused", "circuits_opened",
                                     "circuits_refused", "strangers_refused", "bytes_relayed"), 0)

    def register(self, guard: Guard) -> None:
        self.host.set_stream_handler(PROTOCOL_ID, guard("relay.hop", self._handle_hop_stream, self._refuse))

    async def _handle_hop_stream(self, stream: INetStream) -> None:
        hop = _HopMessages(stream)
        await super()._handle_hop_stream(hop)  # type: ignore[arg-type]
        if hop.cut:
            log.warning("relay.hop_cut", peer=str(stream.muxed_conn.peer_id),
                        reason=f"hop messages not whole within the {RATE_GRACE:g} s grace")
            self.metrics.stream_cut("relay")
            await reset_quietly(stream)

    async def _refuse(self, stream: INetStream, reason: str) -> None:
        self.counts["strangers_refused"] += 1
        await write_delimited_msg(stream, HopMessage(type=HopMessage.STATUS,
                                                     status=to_proto_status(StatusCode.PERMISSION_DENIED)))

    def status(self) -> dict[str, float]:
        self.resource_manager._clean_expired()
        return {**self.counts, "reservations": len(self.resource_manager._reservations),
                "circuits_open": sum(self.by_source.values()), "max_bytes_per_second": self.bandwidth.rate,
                "throttled_seconds": round(self.bandwidth.throttled, 3)}

    async def _handle_reserve(self, stream: INetStream, msg: HopMessage) -> None:
        peer = stream.muxed_conn.peer_id
        msg.peer.id = peer.to_bytes()  # a member reserves for itself, never for another peer id
        rm = self.resource_manager
        granted = rm.has_reservation(peer) or rm.can_accept_reservation(peer)
        self.counts["reservations_granted" if granted else "reservations_refused"] += 1
        if not granted:
            log.warning("relay.reservation_refused", peer=str(peer), reason="network.relay_max_reservations "
                        f"({self.limits.max_reservations}) reached")
        await super()._handle_reserve(stream, msg)

    async def _handle_connect(self, stream: INetStream, msg: HopMessage) -> None:
        src = str(stream.muxed_conn.peer_id)
        dst = ID(msg.peer.id)
        why = ""
        if self.by_source.get(src, 0) >= self.max_circuits:
            why = f"network.relay_max_circuits ({self.max_circuits}) open from this member"
        elif not self.resource_manager.can_accept_connection(dst):
            why = f"{dst} holds no reservation here, or has relay_max_circuits circuits open"
        if why:
            self.counts["circuits_refused"] += 1
            log.warning("relay.circuit_refused", peer=src, to=str(dst), reason=why)
            code = StatusCode.RESOURCE_LIMIT_EXCEEDED if "from this" in why else StatusCode.NO_RESERVATION
            await self._send_status(stream, code, why)
            await close_quietly(stream)
            return
        self.counts["circuits_opened"] += 1
        self.by_source[src] = self.by_source.get(src, 0) + 1
        if isinstance(stream, _HopMessages):
            stream.circuit = True
        try:
            await super()._handle_connect(stream, msg)
        finally:
            left = self.by_source.pop(src) - 1
            if left:
                self.by_source[src] = left

    async def _relay_data(self, src_stream: INetStream, dst_stream: INetStream, peer_id: ID,
                          deadline: float | None = None, circuit_data_limit: list[int] | None = None) -> None:
        """One direction of a circuit (replaces the library's: 1 MiB reads instead of 64 KiB,
        bytes counted, ``circuit_bytes = 0`` unlimited, a half-close passed on, only this
        circuit's streams closed - the library's closed every circuit to the same peer - and
        a frame cut short below the minimum rate cuts the circuit: see _Frames)."""
        clean = False
        frames = _Frames(self.min_rate)
        at = trio.current_time() + (deadline - time.monotonic()) if deadline is not None else float("inf")
        with trio.move_on_at(at):
            try:
                while True:
                    data = b""
                    with trio.move_on_after(frames.wait()):
                        try:
                            data = await src_stream.read(RELAY_READ)
                        except StreamEOF:
                            clean = True
                            break
                    too_slow = frames.feed(data)
                    if too_slow is not None:
                        log.warning("relay.circuit_cut", peer=str(peer_id), reason=too_slow)
                        self.metrics.stream_cut("relay")
                        break
                    if not data:
                        continue
                    if circuit_data_limit is not None:
                        circuit_data_limit[0] -= len(data)
                        if circuit_data_limit[0] < 0:
                            log.warning("relay.circuit_cut", peer=str(peer_id), reason="network.relay_circuit_bytes")
                            break
                    self.counts["bytes_relayed"] += len(data)
                    began = trio.current_time()
                    await trio.sleep(self.bandwidth.delay(len(data)))
                    with trio.fail_after(self.write_timeout):
                        await dst_stream.write(data)
                    if frames.floor is not None:  # the relay's own waits are not the sender's
                        frames.floor.started += trio.current_time() - began
            except Exception as exc:  # noqa: BLE001 - any end of one circuit, never of the host
                log.info("relay.circuit_ended", peer=str(peer_id), reason=f"{type(exc).__name__}: {exc}")
        for key, pair in list(self._active_relays.items()):
            if src_stream in pair or dst_stream in pair:
                del self._active_relays[key]
        if clean:
            # half-close: the other direction goes on, for a moment (a libp2p connection
            # ends both ways; a member must not keep half a circuit open by trickling on)
            await close_quietly(dst_stream)
            await trio.sleep(LINGER_SECONDS)
        await reset_quietly(src_stream)
        await reset_quietly(dst_stream)


class _StopSide(CircuitV2Protocol):
    async def handle_incoming_connection(self, stream: INetStream, remote_peer_id: bytes) -> None:
        """The library's, with the circuit's stream read ahead (CircuitStream)."""
        peer_id = ID(remote_peer_id)
        ma = multiaddr.Multiaddr(f"/p2p/{stream.muxed_conn.peer_id}{CIRCUIT}/p2p/{peer_id}")  # via that relay
        try:
            muxed = await self.host.upgrade_inbound_connection(_raw(stream, False, ma), ma)
        except BaseException:
            await reset_quietly(stream)
            raise
        _tag(self.host, peer_id, muxed, ma)


class RelayClient:
    """Reservations at the bootstrap gateways and the stop side of circuits (module docstring)."""

    def __init__(self, host: IHost, gateways: tuple[str, ...], private: bool,
                 silent_after: float = Relay.silent_after, auto: bool = False) -> None:
        self.host = host
        self.gateways = gateways
        #: a gateway is pinged every half of this; one silent this long (frozen, its machine
        #: gone) has its connection closed, and the circuits through it with it: members
        #: redial through another relay instead of waiting on a TCP connection nobody reads
        self.silent_after = silent_after
        self.private = private
        #: reachability = "auto": private or public as gateways' dial-backs find it
        #: (fabricd/_dialback.py); until the first answer, both kinds of address are announced
        self.auto = auto
        #: (private?, why, when: monotonic) of the last dial-back answered
        self.verdict: tuple[bool, str, float] | None = None
        #: told each verdict (the data plane: behind NAT or not)
        self.on_verdict: Callable[[bool], None] = lambda private: None
        #: gateway -> when it last left a dial-back unanswered (asked again RETRY_REFUSED after)
        self.unanswered: dict[str, float] = {}
        #: told a gateway went silent (the data plane ends its connections spliced there)
        self.on_silent: Callable[[str], None] = lambda relay: None
        own = self.own_addrs = host.get_addrs
        # While private, identify, heartbeats and the DHT record give only /p2p-circuit
        # addresses: nobody (the DHT included) wastes a dial on an address behind the NAT
        setattr(host, "get_addrs", lambda: [multiaddr.Multiaddr(a) for a in self.addrs()]  # noqa: B010
                if self.private else own())
        #: relay peer id -> (gateway address, expiry, the connection it was made on)
        self.held: dict[str, tuple[str, float, Any]] = {}
        #: relay peer id -> (why not, when to ask again)
        self.refused: dict[str, tuple[str, float]] = {}
        self._stop = _StopSide(host, allow_hop=False)

    def register(self, guard: Guard) -> None:
        self.host.set_stream_handler(STOP_PROTOCOL_ID, guard("relay.stop", self._stop._handle_stop_stream, None))

    def addrs(self) -> list[str]:
        """The /p2p-circuit addresses to announce (none once a dial-back found us public)."""
        if self.auto and self.verdict is not None and not self.verdict[0]:
            return []
        own = str(self.host.get_id())
        return [f"{gateway}{CIRCUIT}/p2p/{own}" for gateway, _, _ in self.held.values()]

    def status(self) -> dict[str, Any]:
        now = time.time()
        found = {}
        if self.auto:
            found = {"found": "unknown (no dial-back answered yet)" if self.verdict is None else
                     ("private" if self.verdict[0] else "public") + (f": {self.verdict[1]}" if self.verdict[1] else "")}
        return {"reservations": {relay: round(expires - now) for relay, (_, expires, _) in self.held.items()},
                "refused": {relay: why for relay, (why, _) in self.refused.items()}, **found}

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        pinged: dict[str, float] = {}
        while True:
            for gateway in self.gateways:
                if not (self.auto and self.verdict is not None and not self.verdict[0]):
                    await self._keep(gateway)  # (found public: no reservation needed)
                if self.auto and (self.verdict is None or self.verdict[2] < time.monotonic() - RECHECK_SECONDS):
                    await self._check(gateway)
                if pinged.get(gateway, 0.0) < time.monotonic() - self.silent_after / 2:
                    await self._ping(info_from_p2p_addr(multiaddr.Multiaddr(gateway)).peer_id)
                    pinged[gateway] = time.monotonic()
            await trio.sleep(1.0)

    async def _check(self, gateway: str) -> None:
        """Ask ``gateway`` to dial us back at the port we announce (reachability auto)."""
        relay_id = info_from_p2p_addr(multiaddr.Multiaddr(gateway)).peer_id
        relay = str(relay_id)
        port = next((int(a.value_for_protocol("tcp")) for a in self.own_addrs() if "/tcp/" in str(a)), 0)
        if (not port or self.unanswered.get(relay, -RETRY_REFUSED) > time.monotonic() - RETRY_REFUSED
                or not any(not _relayed(c) for c in self.host.get_network().get_connections(relay_id))):
            return
        result = await dialback.ask(self.host, relay, port)
        if result is None:  # no dial-back there (no relay service), or a refusal: not every second
            self.unanswered[relay] = time.monotonic()
            return
        private = not result.reachable
        if self.verdict is None or self.verdict[0] != private:
            log.info("relay.reachability", found="private" if private else "public", gateway=relay,
                     address=result.address, reason=result.reason or "dialled back")
        self.verdict = (private, result.reason, time.monotonic())
        self.private = private
        self.on_verdict(private)

    async def _ping(self, relay_id: ID) -> None:
        """Close the connections to a gateway that does not answer a ping in silent_after."""
        conns = self.host.get_network().get_connections(relay_id)
        if not conns:
            return
        try:
            with trio.fail_after(self.silent_after):
                stream = await self.host.new_stream(relay_id, [PING_ID])
                await perform_ping_roundtrip(stream)
            await close_quietly(stream)
            return
        except trio.TooSlowError:
            pass
        except Exception:  # noqa: BLE001 - a refused or broken stream is no silence: its end follows
            return
        log.warning("relay.silent", relay=str(relay_id), after_s=self.silent_after,
                    action="connection closed; links through it redial through another relay")
        self.on_silent(str(relay_id))
        for conn in conns:
            with trio.move_on_after(1):
                # the socket first: writes blocked on it end, where yamux's goodbye would wait
                await conn.muxed_conn.secured_conn.close()  # type: ignore[attr-defined]
            with trio.move_on_after(1):
                await conn.close()

    async def _keep(self, gateway: str) -> None:
        relay_id = info_from_p2p_addr(multiaddr.Multiaddr(gateway)).peer_id
        relay = str(relay_id)
        conns = self.host.get_network().get_connections(relay_id)
        held = self.held.get(relay)
        if not conns:
            self.held.pop(relay, None)
            return
        now = time.monotonic()
        if held is not None and any(c is held[2] for c in conns) and held[1] - time.time() > RENEW_MARGIN:
            return
        if self.refused.get(relay, ("", 0.0))[1] > now:
            return
        try:
            link = next((c for c in conns if not _relayed(c)), None)
            if link is None:
                # reached only through another relay (a restarted gateway dials its members
                # back so), and a gateway refuses hops over a relayed link: dial it directly
                link = await self.host.get_network().dial_addr(
                    info_from_p2p_addr(multiaddr.Multiaddr(gateway)).addrs[0], relay_id)
            stream, resp = await _hop(self.host, relay, HopMessage(
                type=HopMessage.RESERVE, peer=CircuitPeerId(id=self.host.get_id().to_bytes())))
            await close_quietly(stream)
            if resp.status != to_proto_status(StatusCode.OK):
                raise ConnectionError(_status_name(resp.status))
        except Exception as exc:  # noqa: BLE001 - no relay there, a limit, a broken link: asked again later
            why = f"{type(exc).__name__}: {exc}"
            self.held.pop(relay, None)
            self.refused[relay] = (why, now + RETRY_REFUSED)
            log.warning("relay.reservation_failed", relay=relay, reason=why, retry_s=RETRY_REFUSED)
            return
        self.refused.pop(relay, None)
        self.held[relay] = (gateway, float(resp.reservation.expire), link)
        if held is None:
            log.info("relay.reserved", relay=relay, addr=self.addrs()[-1])
