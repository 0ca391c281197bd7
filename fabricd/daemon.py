"""``run(config)``: the daemon's lifetime.

load config -> check identity and certificate -> start the libp2p host -> register
handlers -> start services in order (membership, discovery, bridge) -> serve until
SIGTERM/SIGINT -> stop services in reverse order -> close the host.
"""

from __future__ import annotations

import functools
import os
import signal
import time
import uuid
from dataclasses import dataclass
from typing import Any

import blake3
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from fabricd import _muxguard, _taskdump
from fabricd._dataplane import DataPlane
from fabricd._dialback import DialBackService
from fabricd._holepunch import HolePunch
from fabricd._host import HostStack, open_host_stack
from fabricd._relay import RelayClient, RelayService
from fabricd._sender import (
    Body,
    BodyRefused,
    DigestGate,
    FillingBuffer,
    Gate,
    RepeatedBody,
    backoff,
)
from fabricd._splice import SpliceService
from fabricd.bridge import BridgeServer, RequestFailed
from fabricd.config import Config
from fabricd.control import ControlService
from fabricd.discovery import ClusterRecordValidator, Discovery
from fabricd.errors import FabricdError
from fabricd.executors import ExecutorLauncher
from fabricd.identity import peer_id_of, raw_private_key, read_identity
from fabricd.membership import Membership
from fabricd.metrics import DaemonMetrics, MetricsServer, StateSnapshot
from fabricd.revocation import RevocationGossip, Revocations
from fabricd.signing import ReplayWindow, seal, unseal
from fabricd.updates import INLINE_HASH_BYTES, UpdateService
from fedcore.logs import get_logger
from proto.bridge import ControlResult, ProbeReply, SendResult
from proto.certs import RevocationList, load_ca_public, public_key_bytes, verify_certificate
from proto.errors import NotAMember, ProtocolError
from proto.ids import PROBE_JOB_ID
from proto.messages import UpdateHeader, is_transient_rejection
from proto.stream import body_digest, claimed_digest

log = get_logger("fabricd.daemon")

#: times a round.run is sent again after its link was lost before the reply
LINK_RESENDS = 3
#: seconds before resolving again once a link was lost: a new link's membership exchange
#: takes a moment, and a peer whose exchange met the old link's end is hung up after 0.5 s
RELINK_PAUSE = 1.0


class _ConnectionLost(FabricdError):
    """A libp2p-level failure (dial, stream, reset) while sending to a peer."""


class StartupError(FabricdError):
    """The daemon cannot start; the message names the file or setting to fix."""


@dataclass
class Credentials:
    key_pair: KeyPair
    certificate: bytes
    ca_public: bytes


def load_credentials(config: Config) -> Credentials:
    """Identity, certificate and CA key from the config, cross-checked; StartupError if wrong."""
    from fabricd.identity import IdentityError

    try:
        key_pair = read_identity(config.identity_key)
    except IdentityError as exc:
        raise StartupError(str(exc)) from None
    try:
        ca_public = public_key_bytes(load_ca_public(config.ca_public_key))
    except (ValueError, OSError) as exc:
        raise StartupError(f"{config.path}: identity.ca_public_key: {exc}") from None
    try:
        certificate = config.certificate.read_bytes()
    except FileNotFoundError:
        request = config.path.parent / "signing-request.json"
        hint = (f"send {request} to the CA operator (`fabricd certs issue --ca CA_DIR --request "
                f"{request.name} --out membership.cert`) and put the result there"
                if request.is_file() else "issue one with `fabricd certs issue`")
        raise StartupError(f"{config.certificate}: no membership certificate yet; {hint}") from None
    peer_id = str(peer_id_of(key_pair))
    try:
        revoked = RevocationList.load(config.revocation_list)
    except ValueError as exc:
        raise StartupError(f"{config.path}: identity.revocation_list: {exc}") from None
    try:
        cert = verify_certificate(certificate, ca_public, now=time.time(), revoked=revoked,
                                  expected_peer_id=peer_id)
    except NotAMember as exc:
        raise StartupError(f"{config.certificate}: this daemon's certificate is not valid: {exc}") from None
    if cert.cluster_id != config.cluster_id:
        raise StartupError(f"{config.path}: cluster.id is {config.cluster_id!r} but {config.certificate} "
                           f"is for cluster {cert.cluster_id!r}")
    if cert.role != config.role:
        raise StartupError(f"{config.path}: cluster.role is {config.role!r} but {config.certificate} "
                           f"has role {cert.role!r}")
    return Credentials(key_pair, certificate, ca_public)


class Daemon:
    """One running fabricd: the host stack plus its services (see module docstring)."""

    def __init__(self, config: Config, creds: Credentials) -> None:
        self.config = config
        self.creds = creds
        self.peer_id = str(peer_id_of(creds.key_pair))
        self.started_at = time.time()
        self.stack: HostStack | None = None
        self.membership: Membership
        self.discovery: Discovery
        self.updates: UpdateService
        self.control_service: ControlService
        self.bridge: BridgeServer
        self.launcher: ExecutorLauncher
        self.metrics = DaemonMetrics()
        self.metrics.info.labels(config.cluster_id, self.peer_id, config.role).set(1)
        self.metrics_server = (MetricsServer(self.metrics, config.metrics_endpoint, self.snapshot)
                               if config.metrics_endpoint else None)

    # ---- lifetime ----------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        # Listen for SIGTERM/SIGINT from the very start, so a signal during start-up is
        # queued and answered with an orderly shutdown right after, not a hard kill.
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            await self._run(signals, task_status)

    async def _run(self, signals: Any, task_status: Any) -> None:
        cfg = self.config
        lim = cfg.limits
        async with open_host_stack(self.creds.key_pair, list(cfg.listen), list(cfg.announce),
                                   lim.heartbeat_interval) as stack:
            self.stack = stack
            host = stack.host
            revocations = Revocations(cfg.revocation_list, self.creds.ca_public)
            self.membership = Membership(host, certificate=self.creds.certificate,
                                         ca_public=self.creds.ca_public,
                                         revocations=revocations,
                                         auth_timeout=lim.auth_timeout)
            membership = self.membership
            _muxguard.trust(lambda peer: membership.member_certificate(peer) is not None)
            stack.dht.register_validator(ClusterRecordValidator.namespace,
                                         ClusterRecordValidator(self.membership))
            # Strict: every stored key is validated; keys outside a registered namespace are refused.
            stack.dht.strict_validation = True
            self.launcher = ExecutorLauncher(
                cluster_id=cfg.cluster_id, bridge_socket=cfg.bridge_socket,
                ray_address=cfg.ray_address, log_dir=cfg.path.parent,
                num_cpus=cfg.ray_num_cpus, object_store_memory=cfg.ray_object_store_memory,
                metrics_endpoint=cfg.metrics_executor_endpoint,
                allow_models=cfg.allow_models, data_roots=cfg.data_roots,
                datasets=cfg.datasets, spares=lim.dataplane_spare_bytes > 0)
            self.bridge = BridgeServer(cfg.bridge_socket, self, cluster_id=cfg.cluster_id,
                                       max_payload=lim.max_update_bytes,
                                       control_timeout=lim.control_timeout,
                                       delivery_timeout=lim.stream_timeout,
                                       launcher=self.launcher if cfg.role == "cluster" else None,
                                       max_outgoing_bytes=lim.max_inflight_bytes)
            self.bridge.on_job_left = self._job_left
            self.updates = UpdateService(host, self.membership, self.bridge, cluster_id=cfg.cluster_id,
                                         max_update_bytes=lim.max_update_bytes,
                                         max_inflight_bytes=lim.max_inflight_bytes,
                                         chunk_bytes=lim.chunk_bytes, stream_timeout=lim.stream_timeout,
                                         min_rate=lim.min_transfer_rate,
                                         dedup_ids_per_member=lim.dedup_ids_per_member,
                                         dedup_round_window=lim.dedup_round_window)
            signing_key = Ed25519PrivateKey.from_private_bytes(raw_private_key(self.creds.key_pair))
            replay = ReplayWindow()
            self.control_service = ControlService(
                host, self.membership, self.bridge, timeout=lim.control_timeout,
                cluster_id=cfg.cluster_id, placements=self.updates.placements,
                min_rate=lim.min_transfer_rate,
                seal=lambda body, audience: seal(body, self.creds.certificate, signing_key,
                                                 audience=audience),
                unseal=lambda body, peer: unseal(body, sender_peer=peer, audience=cfg.cluster_id,
                                                 replay=replay,
                                                 ca_public=self.creds.ca_public,
                                                 revoked=self.membership.revoked))
            self.discovery = Discovery(
                stack, self.membership, cluster_id=cfg.cluster_id, capacity=cfg.capacity,
                bootstrap=cfg.bootstrap, signing_key=signing_key,
                heartbeat_interval=lim.heartbeat_interval, heartbeat_timeout=lim.heartbeat_timeout,
            )
            self.membership.metrics = self.updates.metrics = self.control_service.metrics = self.metrics
            self.revocation_gossip = RevocationGossip(
                stack.pubsub, revocations, lambda peer: self.membership.member_certificate(peer) is not None,
                self.peer_id)
            self.dataplane: DataPlane | None = None
            self.holepunch: HolePunch | None = None
            if lim.dataplane_min_bytes:
                self.dataplane = DataPlane(
                    host, listen_ip=_listen_ip(cfg.listen[0]),
                    is_member=lambda peer: self.membership.member_certificate(peer) is not None,
                    serve=self.updates.serve_dataplane, state_dir=cfg.path.parent)
                self.updates.use_dataplane(self.dataplane, lim.dataplane_min_bytes, lim.dataplane_digest,
                                           lim.dataplane_small_bytes, lim.dataplane_spare_bytes)
                self.dataplane.register(self.membership.guard)
            self.relay_service = RelayService(host, cfg.relay, lim.min_transfer_rate) if cfg.relay.service else None
            if self.relay_service is not None:
                self.relay_service.metrics = self.metrics
                self.relay_service.register(self.membership.guard)
                self.dialback = DialBackService(host)  # members set to reachability "auto" ask it
                self.dialback.register(self.membership.guard)
                if self.dataplane is not None:  # members behind NAT get the data plane spliced
                    self.dataplane.splices = _splices(host, cfg, self.relay_service, self.dataplane)
                    self.dataplane.splices.metrics = self.metrics
                    self.dataplane.splices.register(self.membership.guard)
            if cfg.relay.reachability != "public":
                private = cfg.relay.reachability == "private"
                relays = self.discovery.relays = RelayClient(host, cfg.bootstrap, private, cfg.relay.silent_after,
                                                             auto=not private)
                relays.register(self.membership.guard)
                if cfg.relay.hole_punching:  # DCUtR upgrades a relayed link where both NATs allow
                    self.holepunch = HolePunch(host, self.membership.guard)
                if self.dataplane is not None:
                    dataplane = self.dataplane
                    dataplane.behind_nat = private
                    dataplane.splice_relayed = not private
                    dataplane.gateways = lambda: list(relays.held)
                    relays.on_verdict = lambda found_private: setattr(dataplane, "behind_nat", found_private)
                    relays.on_silent = dataplane.gateway_lost
            self.updates.register()
            self.control_service.register()
            self.membership.guard_all_handlers()

            scopes: list[tuple[str, trio.CancelScope]] = []
            async with trio.open_nursery() as nursery:
                services = [("membership", self.membership.serve),
                            ("discovery", self.discovery.serve),
                            ("revocations", self.revocation_gossip.serve),
                            ("bridge", self.bridge.serve),
                            ("executor_reaper", self.launcher.reap_loop),
                            # kill -USR1: what every task waits on, to a file (fabricd/_taskdump.py)
                            ("taskdump", functools.partial(_taskdump.serve, cfg.path.parent))]
                if self.dataplane is not None:
                    services.insert(3, ("dataplane", self.dataplane.run))
                if self.discovery.relays is not None:
                    services.insert(2, ("relay_client", self.discovery.relays.serve))
                if self.holepunch is not None:
                    services.insert(3, ("holepunch", self.holepunch.serve))
                if self.metrics_server is not None:
                    # first up, last down: a scrape sees the whole shutdown
                    services.insert(0, ("metrics", self.metrics_server.serve))
                for name, serve in services:
                    scope = await nursery.start(_scoped, serve)
                    scopes.append((name, scope))
                    log.info("service.started", service=name)
                log.info("daemon.ready", cluster=cfg.cluster_id, peer=self.peer_id,
                         addrs=",".join(self.listen_addrs()), bridge=str(cfg.bridge_socket))
                task_status.started(self)
                async for signum in signals:
                    log.info("daemon.signal", signal=signal.Signals(signum).name)
                    break
                log.info("daemon.stopping", cluster=cfg.cluster_id)
                self.launcher.stop_all()
                for name, scope in reversed(scopes):
                    scope.cancel()
                    await trio.sleep(0)
                    log.info("service.stopped", service=name)
        log.info("daemon.stopped", cluster=cfg.cluster_id)

    def _job_left(self, job_id: str) -> None:
        """A job's last executor/scheduler left this daemon's bridge: forget its delivered
        message ids (a new run of the same job id reuses them) and expect its executor to
        exit."""
        self.updates.forget_job(job_id)
        # The job is over here: a new run of the same id may be started by any scheduler.
        self.control_service.owners.forget(job_id)
        self.launcher.left(job_id)

    def listen_addrs(self) -> list[str]:
        assert self.stack is not None
        out = []
        for addr in self.stack.host.get_addrs():
            text = str(addr)
            out.append(text if "/p2p/" in text else f"{text}/p2p/{self.peer_id}")
        return out

    # ---- bridge backend ----------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        m = self.membership
        return {
            "cluster_id": self.config.cluster_id,
            "peer_id": self.peer_id,
            "role": self.config.role,
            "listen_addrs": self.listen_addrs(),
            "uptime_s": round(time.time() - self.started_at, 3),
            "clusters": self.discovery.table(),
            "refused": [{"cluster_id": r.cluster_id, "peer_id": r.peer_id, "reason": r.reason,
                         "verified": r.verified}
                        for r in [*m.refusals.values(), *m.unverified.values()]],
            "preauth_dropped": m.preauth_dropped,
            "streams_cut": dict(self.metrics.cuts),
            "unauthenticated_peers": len(m.pending),
            "connections": len(self.stack.host.get_network().connections) if self.stack else 0,
            "jobs": self.updates.counters(),
            "bridge_clients": self.bridge.describe(),
            "bridge_rejected_frames": self.bridge.rejected_frames,
            "revoked_serials": len(m.revoked),
            "dht": {"routing_table_peers": self.stack.dht.get_routing_table_size() if self.stack else 0,
                    "record_published": self.discovery.record_published_at is not None},
            "control": {"served": self.control_service.served, "refused": self.control_service.refused},
            "metrics_endpoint": self.metrics_server.address if self.metrics_server else "",
            "transfer": {**self.updates.transfer_status(), "outgoing_bytes": self.bridge.outgoing.used,
                         "outgoing_peak_bytes": self.bridge.outgoing.peak},
            "relay": {"reachability": self.config.relay.reachability,
                      **({"service": {**self.relay_service.status(), **self._splice_status(),
                                      **self.dialback.counts}}
                         if self.relay_service else {}),
                      **(self.discovery.relays.status() if self.discovery.relays else {}),
                      **({"holepunch": self.holepunch.status()} if self.holepunch else {})},
            "gossip": {"rejected_heartbeats": self.discovery.rejected_heartbeats,
                       "dial_hints": len(self.discovery.dial_hints)},
        }

    def _splice_status(self) -> dict[str, int]:
        splices = self.dataplane.splices if self.dataplane is not None else None
        return splices.status() if splices is not None else {}

    def snapshot(self) -> StateSnapshot:
        """The state the metrics endpoint reports (called on the trio thread)."""
        clusters = {row["cluster_id"]: bool(row["connected"]) for row in self.discovery.table()
                    if row["cluster_id"] != self.config.cluster_id}
        return StateSnapshot(
            clusters=clusters, inflight_bytes=self.updates.inflight,
            control_served=self.control_service.served, control_refused=self.control_service.refused,
            bridge_rejected_frames=self.bridge.rejected_frames,
            send_retries=getattr(self.updates, "send_retries", 0), revoked_serials=len(self.membership.revoked),
            uptime_s=time.time() - self.started_at)

    async def resolve(self, cluster_id: str) -> str:
        """The peer id of member cluster ``cluster_id``, connected and verified.

        RequestFailed says "not a member" (with the reason) or "unknown cluster".
        """
        if cluster_id == self.config.cluster_id:
            raise RequestFailed(f"cluster {cluster_id!r} is this daemon itself")
        m = self.membership
        info = self.discovery.clusters.get(cluster_id)
        refusal = m.refusals.get(cluster_id)
        peer_id: str | None = None
        addrs: tuple[str, ...] = ()
        if info is not None and (refusal is None or refusal.peer_id != info.peer_id):
            peer_id, addrs = info.peer_id, info.addrs
        elif refusal is not None:
            peer_id, addrs = refusal.peer_id, refusal.addrs
        else:
            record = await self.discovery.lookup(cluster_id)
            if record is not None:
                peer_id, addrs = record.peer_id, record.addrs
        if peer_id is None:
            # A claim made with an unverified certificate only explains the failure; it is
            # never used to route to (or to refuse) a cluster.
            claims = [r for r in m.unverified.values() if r.cluster_id == cluster_id]
            if claims:
                raise RequestFailed(f"unknown cluster {cluster_id!r}: not a member as far as this daemon "
                                    f"knows; peer {claims[-1].peer_id} claimed it with a certificate "
                                    f"that did not verify: {claims[-1].reason}")
            known = sorted(self.discovery.clusters)
            raise RequestFailed(f"unknown cluster {cluster_id!r}: not connected and no DHT record "
                                f"(known clusters: {', '.join(known) or 'none'})")
        if m.member_certificate(peer_id) is None:
            try:
                # dialled even with no addresses here: the peerstore may have some (identify's,
                # when the link came in through a relay before any heartbeat), and if it has
                # none the dial error says so at once, where a verdict would wait for nothing
                await self.discovery.connect_to(peer_id, addrs)
                await m.wait_verdict(peer_id)
            except NotAMember as exc:
                raise RequestFailed(f"cluster {cluster_id!r} (peer {peer_id}) is not a member: {exc}") from None
            except Exception as exc:  # noqa: BLE001 - dial errors of many kinds
                if refusal is not None:
                    raise RequestFailed(f"cluster {cluster_id!r} (peer {peer_id}) is not a member: "
                                        f"{refusal.reason}") from None
                raise RequestFailed(f"cannot reach cluster {cluster_id!r} (peer {peer_id}): "
                                    f"{type(exc).__name__}: {exc}") from None
        cert = m.member_certificate(peer_id)
        if cert is None or cert.cluster_id != cluster_id:
            reason = refusal.reason if refusal is not None else "no valid certificate"
            raise RequestFailed(f"cluster {cluster_id!r} (peer {peer_id}) is not a member: {reason}")
        return peer_id

    async def probe(self, cluster_id: str, nbytes: int) -> ProbeReply:
        limit = self.config.limits.max_update_bytes
        if nbytes > limit:
            raise RequestFailed(f"a probe may send at most limits.max_update_bytes = {limit} bytes "
                                f"(asked for {nbytes})")
        peer_id = await self.resolve(cluster_id)
        empty = self._probe_header(cluster_id, 0, blake3.blake3(b"").digest())
        rtt_start = time.perf_counter()
        await self._send_probe(peer_id, cluster_id, empty, b"")
        rtt_ms = (time.perf_counter() - rtt_start) * 1000
        # Making and hashing the body is the sender's preparation, like an executor's
        # serialization: done in a thread (the event loop keeps serving) and not timed.
        body, digest = await trio.to_thread.run_sync(_probe_body, nbytes)
        header = self._probe_header(cluster_id, len(body), digest)
        paths = dict(self.updates.bytes_by_path)
        start, cpu_start = time.perf_counter(), time.process_time()
        await self._send_probe(peer_id, cluster_id, header, body)
        seconds = time.perf_counter() - start
        # the path the body took: the one whose acknowledged bytes grew by the most
        grown = {k: v - paths.get(k, 0) for k, v in self.updates.bytes_by_path.items()}
        path = max(grown, key=lambda k: grown[k], default="") if any(grown.values()) else ""
        log.info("probe.done", cluster=cluster_id, peer=peer_id, bytes=nbytes, seconds=round(seconds, 4),
                 cpu_s=round(time.process_time() - cpu_start, 4), rtt_ms=round(rtt_ms, 3), path=path)
        return ProbeReply(cluster_id=cluster_id, rtt_ms=rtt_ms, bytes=nbytes, seconds=seconds,
                          throughput_mb_s=(nbytes / seconds / 1e6) if seconds > 0 else 0.0, path=path)

    def _probe_header(self, cluster_id: str, nbytes: int, digest: bytes) -> UpdateHeader:
        return UpdateHeader(job_id=PROBE_JOB_ID, round=0, source_node=self.config.cluster_id,
                            target_node=cluster_id, message_id=uuid.uuid4().hex,
                            tensor_count=0, byte_length=nbytes, blake3=digest)

    async def _send_probe(self, peer_id: str, cluster_id: str, header: UpdateHeader, body: Body) -> None:
        ack = await self._send(peer_id, cluster_id, header, body)
        if ack.status != "ok":
            raise RequestFailed(f"cluster {cluster_id!r} rejected the probe: {ack.reason}")

    async def _send(self, peer_id: str, cluster_id: str, header: UpdateHeader, body: Body,
                    gate: Gate | None = None) -> Any:
        try:
            return await self._send_once(peer_id, cluster_id, header, body, gate)
        except _ConnectionLost as lost:
            # The connection went away under us (e.g. the peer just revoked us and hung up):
            # one fresh resolve re-runs the membership exchange and learns why. If it fails
            # too, how the link was lost is said as well: a peer that cannot be redialled
            # (a relay gone) may end the resolve only in a verdict timeout that names nothing.
            await trio.sleep(0.5)
            try:
                peer_id = await self.resolve(cluster_id)
            except RequestFailed as exc:
                raise RequestFailed(f"{exc}; the update under way was lost: {lost}") from None
            try:
                return await self._send_once(peer_id, cluster_id, header, body, gate)
            except _ConnectionLost as exc:
                raise RequestFailed(f"update to cluster {cluster_id!r} failed: {exc}") from None

    async def _send_once(self, peer_id: str, cluster_id: str, header: UpdateHeader, body: Body,
                         gate: Gate | None = None) -> Any:
        try:
            return await self.updates.send(peer_id, header, body, gate)
        except BodyRefused:
            raise
        except NotAMember as exc:
            raise RequestFailed(f"cluster {cluster_id!r} is not a member: {exc}") from None
        except ProtocolError as exc:
            raise RequestFailed(f"update to cluster {cluster_id!r} failed: {exc}") from None
        except trio.TooSlowError:
            raise RequestFailed(f"cluster {cluster_id!r} did not acknowledge the update in time") from None
        except Exception as exc:  # noqa: BLE001 - libp2p stream/dial errors
            raise _ConnectionLost(f"{type(exc).__name__}: {exc}") from None

    async def send_update(self, target_cluster: str, header: UpdateHeader,
                          payload: bytes | bytearray | memoryview | FillingBuffer) -> SendResult:
        if not isinstance(payload, FillingBuffer) and len(payload) < INLINE_HASH_BYTES:
            algorithm, _, expected = claimed_digest(header)
            digest = body_digest(header, payload)
            if digest != expected:
                return self._refused(header, f"payload {algorithm} {digest.hex()} does not match the "
                                             f"header's {expected.hex()}; nothing was sent")
            return await self._send_checked(target_cluster, header, payload, None)
        # A large payload is checked against its header's claim before its last chunk goes
        # out (DigestGate: hashed while it is being sent, and may still be arriving from the
        # bridge), so a mismatching or incomplete one is never delivered.
        async with trio.open_nursery() as nursery:
            gate = DigestGate(payload, header, nursery)
            with trio.CancelScope() as sending:
                if isinstance(payload, FillingBuffer):
                    # the client hung up mid-payload: stop wherever the send waits (a
                    # stalled stream write, a busy peer's slot), so its budget is freed now;
                    # the stream is reset, and a receiver delivers no partial body
                    payload.on_fail(sending.cancel)
                result = await self._send_checked(target_cluster, header, payload, gate)
            nursery.cancel_scope.cancel()  # a gate the data plane settled never started
        if sending.cancelled_caught and isinstance(payload, FillingBuffer):
            return self._refused(header, f"the payload did not arrive in full from the bridge client "
                                         f"({payload.failed}); nothing was delivered")
        return result

    def _refused(self, header: UpdateHeader, reason: str) -> SendResult:
        log.warning("bridge.rejected", job=header.job_id, message_id=header.message_id, reason=reason)
        return SendResult(message_id=header.message_id, ok=False, reason=reason, bytes=0)

    async def _send_checked(self, target_cluster: str, header: UpdateHeader,
                            payload: bytes | bytearray | memoryview | FillingBuffer, gate: Gate | None) -> SendResult:
        try:
            peer_id = await self.resolve(target_cluster)
            ack = await self._send(peer_id, target_cluster, header, payload, gate)
        except RequestFailed as exc:  # unreachable or silent: it may be back in a moment
            return SendResult(message_id=header.message_id, ok=False, reason=str(exc), bytes=0,
                              retry=True)
        except BodyRefused as exc:
            return self._refused(header, str(exc))
        ok = ack.status in ("ok", "duplicate")
        reason = "" if ack.status == "ok" else f"{ack.status}: {ack.reason}"
        return SendResult(message_id=header.message_id, ok=ok, reason=reason,
                          bytes=header.byte_length if ack.status == "ok" else 0,
                          retry=not ok and is_transient_rejection(ack.reason))

    async def send_control(self, target_cluster: str, request_id: str, body: dict[str, Any]) -> ControlResult:
        # a round.run whose stream broke before the reply (its link lost with a relay) is
        # sent again, over the link resolve makes anew: the executor answers a round it ran
        # or runs with that round's report (worker.executor.service), never runs it twice.
        # Once a link was lost, a failed resolve (the new link, or its membership exchange,
        # not there yet) is tried again within the same resends; it never sends to a peer
        # that has not proved membership.
        resends = LINK_RESENDS if body.get("kind") == "round.run" else 0
        lost = ""
        for attempt in range(resends + 1):
            try:
                peer_id = await self.resolve(target_cluster)
                resp = await self.control_service.send(peer_id, request_id, body, audience=target_cluster)
            except RequestFailed as exc:
                if not lost or attempt == resends:
                    return ControlResult(request_id=request_id, ok=False, body={}, reason=f"{exc}{lost}")
                log.warning("control.resent", cluster=target_cluster, request_id=request_id, reason=str(exc))
                await trio.sleep(RELINK_PAUSE)
                continue
            except NotAMember as exc:
                return ControlResult(request_id=request_id, ok=False, body={},
                                     reason=f"cluster {target_cluster!r} is not a member: {exc}")
            except Exception as exc:  # noqa: BLE001 - libp2p stream/dial errors, protocol errors
                reason = f"control request to {target_cluster!r} failed: {type(exc).__name__}: {exc}"
                if attempt == resends or isinstance(exc, trio.TooSlowError):
                    return ControlResult(request_id=request_id, ok=False, body={}, reason=reason)
                log.warning("control.resent", cluster=target_cluster, request_id=request_id, reason=reason)
                lost = f"; the request under way was lost: {reason}"
                await trio.sleep(backoff(attempt))
                continue
            return ControlResult(request_id=request_id, ok=resp.ok, body=resp.body, reason=resp.reason)
        raise AssertionError("unreachable")


def _probe_body(nbytes: int) -> tuple[RepeatedBody, bytes]:
    """``nbytes`` of incompressible-looking data (one random MiB repeated, never built in
    full: a probe holds 1 MiB however large it is) and their BLAKE3 (the receiver checks
    it; this daemon made the body, so it sends it unhashed)."""
    body = RepeatedBody(os.urandom(min(nbytes, 1 << 20)), nbytes)
    digest = blake3.blake3()
    for chunk in body.chunks(1 << 20):
        digest.update(chunk)
    return body, digest.digest()


def _listen_ip(addr: str) -> str:
    """The IPv4 address of a listen multiaddr (the data plane listens there too)."""
    parts = addr.split("/")
    return parts[2] if len(parts) > 2 and parts[1] == "ip4" else "0.0.0.0"


async def _scoped(serve: Any, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve)
            task_status.started(scope)


def _splices(host: Any, cfg: Config, relay: RelayService, dataplane: DataPlane) -> SpliceService:
    return SpliceService(host, cfg.relay, lambda: dataplane.port,
                         lambda peer: relay.resource_manager.has_reservation(ID.from_base58(peer)),
                         cfg.limits.min_transfer_rate, relay.bandwidth)
