"""Finding and watching the other clusters.

- Bootstrap and reconnect: dial the configured bootstrap peers and every cluster we
  have seen, until connected (so a restarted peer, or a restart of our own, rejoins).
- Gossipsub heartbeats on TOPIC_HEARTBEAT every ``heartbeat_interval``: accepted only
  when the forwarding peer is a verified member, the signed source matches the
  heartbeat's peer id, and the heartbeat carries a valid member certificate for that
  source and cluster. A verified heartbeat from a cluster we are not connected to is a
  hint to dial it (membership is then checked directly); hints are bounded in number and
  addresses, so forged heartbeats cannot make us dial attacker-chosen addresses. A
  member silent for ``heartbeat_timeout`` is marked as left.
- Kademlia: each daemon stores a ClusterRecord signed with its identity key under
  ``/fedpilot/<cluster_id>``; the validator accepts only records whose certificate the
  federation CA signed for that peer and cluster.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

import multiaddr
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.records.validator import Validator

from fabricd import _relay
from fabricd._bounded import BoundedDict, Throttle
from fabricd._host import HostStack
from fabricd._member_tables import peer_addrs
from fabricd.gossip import ReliableGossip
from fabricd.membership import Membership
from fedcore.logs import get_logger
from proto.certs import Certificate, verify_certificate
from proto.codec import decode, encode
from proto.errors import ProtocolError
from proto.ids import DHT_NAMESPACE, TOPIC_HEARTBEAT, dht_key
from proto.messages import ClusterRecord, Heartbeat

log = get_logger("fabricd.discovery")

HEARTBEAT_MAX_BYTES = 16 * 1024
RECORD_MAX_BYTES = 16 * 1024
DIAL_TIMEOUT = 10.0
#: a member we learnt of (not a bootstrap peer) is dialled at once only by the side with the
#: smaller peer id; the other side waits this long for that dial before dialling itself:
#: longer than a dial that timed out (DIAL_TIMEOUT) plus its retry a second later, else a
#: dial slowed by load meets the other side's (the whole suite on two workers: 5 s left two
#: connections to one member; DIAL_TIMEOUT + 2 s did once in CI, at the suite's end)
DIAL_DEFER = 2 * DIAL_TIMEOUT + 2.0
RECORD_REFRESH = 30.0
#: dial hints kept (peers we heard of but are not connected to) and addresses per hint
MAX_DIAL_HINTS = 256
MAX_HINT_ADDRS = 8
#: verified heartbeat certificates cached (by their bytes) to spare a signature check
CERT_CACHE = 512


@dataclass
class ClusterInfo:
    """One other cluster as this daemon sees it."""

    cluster_id: str
    peer_id: str
    role: str
    addrs: tuple[str, ...] = ()
    capacity: int = 0
    last_heartbeat: float = 0.0
    joined_at: float = field(default_factory=time.time)
    left_at: float | None = None
    joins: int = 0


class ClusterRecordValidator(Validator):
    """DHT validator for ``/fedpilot/<cluster_id>``: CA-certified, self-signed records only."""

    namespace = DHT_NAMESPACE

    def __init__(self, membership: Membership) -> None:
        self._m = membership

    def _record(self, key: str, value: bytes) -> ClusterRecord:
        try:
            record = decode(value, max_size=RECORD_MAX_BYTES)
        except ProtocolError as exc:
            raise ValueError(f"DHT record {key}: {exc}") from None
        if not isinstance(record, ClusterRecord):
            raise ValueError(f"DHT record {key}: expected ClusterRecord, got {record.TYPE}")
        if key != dht_key(record.cluster_id):
            raise ValueError(f"DHT record {key} is for cluster {record.cluster_id!r}")
        try:
            record.verify_member(self._m.ca_public, now=time.time(), revoked=self._m.revoked)
        except ProtocolError as exc:
            raise ValueError(f"DHT record {key} rejected: {exc}") from None
        return record

    def validate(self, key: str, value: bytes) -> None:
        self._record(key, value)

    def select(self, key: str, values: list[bytes]) -> int:
        best, best_at = 0, -1.0
        for i, value in enumerate(values):
            try:
                at = self._record(key, value).issued_at
            except ValueError:
                continue
            if at > best_at:
                best, best_at = i, at
        return best


class Discovery:
    """The cluster table, fed by membership verdicts, heartbeats and DHT records."""

    def __init__(
        self, stack: HostStack, membership: Membership, *, cluster_id: str, capacity: int,
        bootstrap: tuple[str, ...], signing_key: Ed25519PrivateKey, heartbeat_interval: float,
        heartbeat_timeout: float,
    ) -> None:
        self.stack = stack
        self.m = membership
        self.cluster_id = cluster_id
        self.capacity = capacity
        self.bootstrap = bootstrap
        self.signing_key = signing_key
        self.interval = heartbeat_interval
        self.timeout = heartbeat_timeout
        self.clusters: dict[str, ClusterInfo] = {}
        self._seq = 0
        self.dial_hints: BoundedDict[str, tuple[str, ...]] = BoundedDict(MAX_DIAL_HINTS)
        self._next_dial: BoundedDict[str, float] = BoundedDict(MAX_DIAL_HINTS * 4)
        #: since when each peer we would dial has been unconnected (for the dial tie-break)
        self._unconnected_since: BoundedDict[str, float] = BoundedDict(MAX_DIAL_HINTS * 4)
        self._certs: BoundedDict[bytes, Certificate] = BoundedDict(CERT_CACHE)
        self.rejected_heartbeats = 0
        self._throttle = Throttle(log)
        self.gossip = ReliableGossip(stack.pubsub)
        self.record_published_at: float | None = None
        #: reservations at relays (reachability private or auto), announced after our own addresses
        self.relays: _relay.RelayClient | None = None
        membership.on_member = self._on_member
        membership.on_leave = self._on_leave
        _relay.dial_circuits_too(self.host, DIAL_TIMEOUT)

    @property
    def host(self) -> Any:
        return self.stack.host

    def own_addrs(self) -> tuple[str, ...]:
        own = tuple(str(a) for a in self.host.get_addrs())
        relayed = tuple(self.relays.addrs()) if self.relays is not None else ()
        return own + tuple(a for a in relayed if a not in own)

    # ---- table -------------------------------------------------------------------------

    def _on_member(self, peer_id: str, cert: Certificate) -> None:
        info = self.clusters.get(cert.cluster_id)
        if info is None or info.peer_id != peer_id:
            info = self.clusters[cert.cluster_id] = ClusterInfo(cert.cluster_id, peer_id, cert.role)
        info.addrs = peer_addrs(self.host, peer_id) or info.addrs
        info.last_heartbeat = time.time()
        info.joined_at, info.left_at = time.time(), None
        info.joins += 1
        log.info("cluster.joined", cluster=cert.cluster_id, peer=peer_id, role=cert.role, joins=info.joins)

    def _on_leave(self, peer_id: str) -> None:
        for info in self.clusters.values():
            if info.peer_id == peer_id and info.left_at is None:
                info.left_at = time.time()
                log.info("cluster.left", cluster=info.cluster_id, peer=peer_id, cause="disconnected")

    def is_connected(self, info: ClusterInfo) -> bool:
        """Connected = a live, verified connection and a heartbeat within the timeout."""
        if self.m.member_certificate(info.peer_id) is None:
            return False
        fresh = max(info.last_heartbeat, info.joined_at)
        return time.time() - fresh <= self.timeout

    def table(self) -> list[dict[str, Any]]:
        now = time.time()
        rows = []
        for info in sorted(self.clusters.values(), key=lambda i: i.cluster_id):
            links = _links_to(self.host, info.peer_id)
            rows.append({
                "cluster_id": info.cluster_id,
                "peer_id": info.peer_id,
                "role": info.role,
                "connected": self.is_connected(info),
                "addrs": list(info.addrs),
                "capacity": info.capacity,
                "last_heartbeat_age_s": round(now - info.last_heartbeat, 3) if info.last_heartbeat else None,
                "joins": info.joins,
                "links": links,
                "link": _relay.link_kind(self.host, info.peer_id),
            })
            if links > 1:  # one is the rule: which side dialled each, and what each carries
                rows[-1]["link_details"] = _link_details(self.host, info.peer_id)
        return rows

    # ---- services ----------------------------------------------------------------------

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        pubsub = self.stack.pubsub
        pubsub.set_topic_validator(TOPIC_HEARTBEAT, self._validate_heartbeat, False)
        subscription = await self.gossip.subscribe(TOPIC_HEARTBEAT)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive_heartbeats, subscription)
            nursery.start_soon(self._publish_heartbeats)
            nursery.start_soon(self._dial_loop)
            nursery.start_soon(self._watch_timeouts)
            nursery.start_soon(self._publish_record_loop)
            task_status.started()

    def _reject_heartbeat(self, fwd: str, reason: str) -> bool:
        self.rejected_heartbeats += 1
        self._throttle.warning("gossip.rejected", peer=fwd, topic=TOPIC_HEARTBEAT, reason=reason,
                               rejected_total=self.rejected_heartbeats)
        return False

    def _validate_heartbeat(self, forwarder: ID, msg: Any) -> bool:
        fwd = str(forwarder)
        if fwd != str(self.host.get_id()) and self.m.member_certificate(fwd) is None:
            return self._reject_heartbeat(fwd, "forwarder is not a member")
        try:
            hb = decode(bytes(msg.data), max_size=HEARTBEAT_MAX_BYTES)
            source = str(ID(bytes(msg.from_id)))
        except (ProtocolError, ValueError) as exc:
            return self._reject_heartbeat(fwd, str(exc))
        if not isinstance(hb, Heartbeat) or hb.peer_id != source:
            return self._reject_heartbeat(fwd, "not a Heartbeat signed by the peer it names")
        try:
            self._heartbeat_certificate(hb)
        except ProtocolError as exc:
            return self._reject_heartbeat(fwd, f"heartbeat of peer {hb.peer_id} (claims cluster "
                                               f"{hb.cluster_id!r}) has no valid member certificate: {exc}")
        return True

    def _heartbeat_certificate(self, hb: Heartbeat) -> Certificate:
        """The heartbeat's certificate, verified for its publisher and cluster (ProtocolError if not)."""
        cert = self._certs.get(hb.certificate)
        if cert is None or cert.serial in self.m.revoked or time.time() > cert.not_after:
            cert = verify_certificate(hb.certificate, self.m.ca_public, now=time.time(),
                                      revoked=self.m.revoked, expected_peer_id=hb.peer_id)
            self._certs[hb.certificate] = cert
        if cert.cluster_id != hb.cluster_id:
            raise ProtocolError(f"the certificate is for cluster {cert.cluster_id!r}")
        return cert

    async def _receive_heartbeats(self, subscription: Any) -> None:
        while True:
            msg = await subscription.get()
            try:
                hb = decode(bytes(msg.data), max_size=HEARTBEAT_MAX_BYTES)
            except ProtocolError:
                continue
            if not isinstance(hb, Heartbeat) or hb.peer_id == str(self.host.get_id()):
                continue
            cert = self.m.member_certificate(hb.peer_id)
            if cert is None:
                # Not verified directly yet: a hint of where to dial, but only for a
                # publisher whose member certificate the validator checked (no reflection).
                try:
                    self._heartbeat_certificate(hb)
                except ProtocolError:
                    continue
                self.dial_hints[hb.peer_id] = hb.addrs[:MAX_HINT_ADDRS]
                continue
            if cert.cluster_id != hb.cluster_id:
                log.warning("gossip.rejected", peer=hb.peer_id, topic=TOPIC_HEARTBEAT,
                            reason=f"heartbeat claims cluster {hb.cluster_id!r}, certificate says {cert.cluster_id!r}")
                continue
            info = self.clusters.get(cert.cluster_id)
            if info is not None and info.peer_id == hb.peer_id:
                if info.left_at is not None:
                    info.left_at = None
                    log.info("cluster.back", cluster=info.cluster_id, peer=info.peer_id, cause="heartbeat")
                info.last_heartbeat = time.time()
                info.addrs = hb.addrs or info.addrs
                info.capacity = hb.capacity

    async def _publish_heartbeats(self) -> None:
        while True:
            self._seq += 1
            hb = Heartbeat(
                cluster_id=self.cluster_id, peer_id=str(self.host.get_id()),
                addrs=self.own_addrs()[:32], capacity=self.capacity, seq=self._seq,
                sent_at=time.time(), certificate=self.m.certificate,
            )
            try:
                await self.gossip.publish(TOPIC_HEARTBEAT, encode(hb))
            except Exception as exc:  # noqa: BLE001 - publishing is best effort, retried next tick
                log.debug("heartbeat.publish_failed", reason=str(exc))
            await trio.sleep(self.interval)

    async def _watch_timeouts(self) -> None:
        while True:
            await trio.sleep(self.interval / 2)
            for info in self.clusters.values():
                if info.left_at is None and not self.is_connected(info):
                    info.left_at = time.time()
                    log.info("cluster.left", cluster=info.cluster_id, peer=info.peer_id,
                             cause="heartbeat timeout")

    # ---- dialing -----------------------------------------------------------------------

    def _dial_targets(self) -> list[PeerInfo]:
        targets: dict[str, PeerInfo] = {}
        for addr in self.bootstrap:
            try:
                info = _bootstrap_info(addr)
                targets[str(info.peer_id)] = info
            except Exception as exc:  # noqa: BLE001 - validated at start; keep going
                log.warning("bootstrap.bad_addr", addr=addr, reason=str(exc))
        for cinfo in self.clusters.values():
            if cinfo.addrs and cinfo.peer_id not in self.m.refused_by:
                targets.setdefault(cinfo.peer_id, _peer_info(cinfo.peer_id, tuple(cinfo.addrs)))
        for peer_id, addrs in self.dial_hints.items():
            if addrs:
                targets.setdefault(peer_id, _peer_info(peer_id, tuple(addrs)))
        own = str(self.host.get_id())
        return [t for pid, t in targets.items() if pid != own]

    async def _dial_loop(self) -> None:
        own = str(self.host.get_id())
        bootstrap = self._bootstrap_ids()  # fixed for the daemon's life
        async with trio.open_nursery() as nursery:
            while True:
                connected = {str(p) for p in self.host.get_connected_peers()}
                now = time.monotonic()
                for target in self._dial_targets():
                    pid = str(target.peer_id)
                    if pid in connected:
                        self._unconnected_since.pop(pid, None)
                        continue
                    since = self._unconnected_since.setdefault(pid, now)
                    if self._next_dial.get(pid, 0.0) > now:
                        continue
                    if _defers_to(own, pid) and pid not in bootstrap and now - since < DIAL_DEFER:
                        continue
                    self._next_dial[pid] = now + 3600  # until the attempt finishes
                    nursery.start_soon(self._dial, target)
                await trio.sleep(0.25)

    def _bootstrap_ids(self) -> set[str]:
        ids = set()
        for addr in self.bootstrap:
            try:
                ids.add(str(_bootstrap_info(addr).peer_id))
            except Exception:  # noqa: BLE001, S112 - reported by _dial_targets
                continue
        return ids

    async def _dial(self, target: PeerInfo) -> None:
        pid = str(target.peer_id)
        ok = False
        with trio.move_on_after(DIAL_TIMEOUT):
            try:
                await self._connect(target)
                ok = True
            except Exception as exc:  # noqa: BLE001 - unreachable peers are normal
                log.debug("dial.failed", peer=pid, reason=f"{type(exc).__name__}: {exc}")
        refused = pid in self.m.refused_by
        self._next_dial[pid] = time.monotonic() + (10.0 if refused else (1.0 if not ok else 0.5))
        if ok:
            self.dial_hints.pop(pid, None)

    async def connect_to(self, peer_id: str, addrs: tuple[str, ...]) -> None:
        with trio.fail_after(DIAL_TIMEOUT):
            await self._connect(_peer_info(peer_id, tuple(addrs)))

    async def _connect(self, target: PeerInfo) -> None:
        """Direct addresses first, then each relay (_relay.dial_circuits_too)."""
        await self.host.connect(target)

    # ---- DHT records -------------------------------------------------------------------

    def own_record(self) -> ClusterRecord:
        return ClusterRecord(
            cluster_id=self.cluster_id, peer_id=str(self.host.get_id()),
            addrs=self.own_addrs()[:32], capacity=self.capacity, issued_at=time.time(),
            certificate=self.m.certificate,
        ).sign(self.signing_key)

    async def _publish_record_loop(self) -> None:
        """Keep verified members in the DHT routing table and our signed record stored.

        py-libp2p adds a peer to the routing table only when it sends a DHT request, so
        members are added as they are verified; the record is re-put when a member joins
        and every RECORD_REFRESH seconds. Only a cluster has a record: a scheduler's
        daemon (role "scheduler") would have its own put refused by every validator.
        """
        in_table: set[str] = set()
        last_put = 0.0
        publishes = self.m.own.role == "cluster"
        while True:
            added = False
            for info in list(self.clusters.values()):
                if info.peer_id in in_table or self.m.member_certificate(info.peer_id) is None:
                    continue
                try:
                    await self.stack.dht.add_peer(ID.from_base58(info.peer_id))
                    in_table.add(info.peer_id)
                    added = True
                except Exception as exc:  # noqa: BLE001 - retried next second
                    log.debug("dht.add_peer_failed", peer=info.peer_id, reason=str(exc))
            if publishes and in_table and (added or time.monotonic() - last_put > RECORD_REFRESH):
                last_put = time.monotonic()
                try:
                    with trio.move_on_after(10):
                        await self.stack.dht.put_value(dht_key(self.cluster_id), encode(self.own_record()))
                        self.record_published_at = time.time()
                        log.info("dht.record_published", cluster=self.cluster_id, peers=len(in_table))
                except Exception as exc:  # noqa: BLE001 - retried on the next refresh
                    log.info("dht.publish_failed", cluster=self.cluster_id, reason=f"{type(exc).__name__}: {exc}")
            await trio.sleep(1.0)

    async def lookup(self, cluster_id: str) -> ClusterRecord | None:
        """The verified DHT record of ``cluster_id``, or None if the DHT has none."""
        with trio.move_on_after(5):
            try:
                value = await self.stack.dht.get_value(dht_key(cluster_id))
            except Exception as exc:  # noqa: BLE001 - a DHT query fails in many ways: to the caller, not found
                log.info("dht.lookup_failed", cluster=cluster_id, reason=str(exc))
                return None
            if value is None:
                return None
            try:
                record = decode(value, max_size=RECORD_MAX_BYTES)
                if isinstance(record, ClusterRecord):
                    record.verify_member(self.m.ca_public, now=time.time(), revoked=self.m.revoked)
                    return record
            except ProtocolError as exc:
                log.warning("dht.record_rejected", cluster=cluster_id, reason=str(exc))
        return None


@functools.lru_cache(maxsize=4096)
def _peer_info(peer_id: str, addrs: tuple[str, ...]) -> PeerInfo:
    """Parsed once per (peer, addresses): the dial loop asks 4 times a second for every
    known cluster, and parsing multiaddrs each time kept idle daemons busy (measured: the
    largest share of an idle daemon's CPU in a 15-daemon mesh)."""
    return PeerInfo(ID.from_base58(peer_id), [multiaddr.Multiaddr(a) for a in addrs])


@functools.lru_cache(maxsize=256)
def _bootstrap_info(addr: str) -> PeerInfo:
    return info_from_p2p_addr(multiaddr.Multiaddr(addr))


def _defers_to(own: str, peer: str) -> bool:
    """Whether this side leaves the first dial to ``peer`` (the one with the smaller id).

    Two members that learn of each other at the same moment (each other's heartbeat) would
    otherwise dial each other at once, and py-libp2p 0.8.1 keeps both connections: it
    trims a peer's extra connection only when it is added, and neither is older than the
    grace period then (members are protected from trimming afterwards). Each side then
    opens its streams on the connection it prefers - the one with more streams - so the
    pair runs two yamux sessions with their own windows and buffers for one link."""
    return own > peer


def _link_details(host: Any, peer_id: str) -> list[dict[str, Any]]:
    """Each libp2p connection to ``peer_id``: who dialled it, its age and its open streams."""
    now, details = time.time(), []
    for conn in host.get_network().get_connections(ID.from_base58(peer_id)):
        initiator = getattr(conn.muxed_conn, "is_initiator_value", None)  # py-libp2p 0.8.1's yamux
        created = getattr(conn, "_created_at", None)
        details.append({"dialled": "?" if initiator is None else "by us" if initiator else "by them",
                        "age_s": round(now - created, 1) if isinstance(created, float) else None,
                        "streams": len(conn.get_streams())})
    return details


def _links_to(host: Any, peer_id: str) -> int:
    """libp2p connections to ``peer_id`` (one when all is well)."""
    try:
        return len(host.get_network().get_connections(ID.from_base58(peer_id)))
    except ValueError:  # not base58 (the swarm's lookup itself cannot fail)
        return 0
