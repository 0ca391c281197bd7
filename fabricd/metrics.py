"""Prometheus metrics of one daemon, served as text at ``[metrics] endpoint``/metrics.

Every daemon owns its own ``CollectorRegistry`` (several daemons may share a test
process). Event counters are bumped by tiny hooks in the update and membership code;
state that already lives in the daemon (connected clusters, bytes in flight, control
requests) is read at scrape time on the trio thread, so the HTTP thread never walks a
dict that trio is changing. Label values are bounded: clusters are certificate holders,
reasons and events come from fixed tables. ``docs/observability.md`` lists every metric.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIServer

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fedcore.logs import get_logger

log = get_logger("fabricd.metrics")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

# Membership rejections name the exception first ("ForeignCertificate: ..."); anything
# else is "other", so a lying peer cannot mint label values.
_MEMBERSHIP_REASONS = {
    "ForeignCertificate": "foreign_certificate",
    "PeerMismatch": "peer_mismatch",
    "CertificateExpired": "certificate_expired",
    "CertificateRevoked": "certificate_revoked",
    "WrongRole": "wrong_role",
    "NotAMember": "invalid_certificate",
    "ProtocolError": "bad_reply",
    "EOFError": "bad_reply",
}
# Update rejections, by how the receiver words them (fabricd/updates.py).
_UPDATE_REASONS = (
    ("bad update header", "bad_header"),
    ("expected UpdateHeader", "bad_header"),
    ("busy:", "busy"),
    ("no body data", "timeout"),
    ("body ended", "truncated"),
    ("DigestMismatch", "digest_mismatch"),
    ("LengthMismatch", "length_mismatch"),
    ("over the limit", "too_large"),
    ("no executor attached", "no_consumer"),
    ("went away", "delivery_failed"),
    ("did not answer the delivery", "delivery_timeout"),
    ("refused it", "delivery_refused"),
)
#: what a rate-floor cut is counted under (fabricd_streams_cut, status streams_cut)
CUT_PROTOCOLS = ("update", "control", "relay")
MEMBERSHIP_EVENTS = ("connected", "accepted", "rejected", "refused_by_peer", "disconnected")


def membership_reason(reason: str) -> str:
    """A fixed label for a membership rejection reason."""
    head = reason.split(":", 1)[0].strip()
    if head in _MEMBERSHIP_REASONS:
        return _MEMBERSHIP_REASONS[head]
    if "revoked" in reason:
        return "certificate_revoked"
    if "expired" in reason:
        return "certificate_expired"
    if reason.startswith("bad membership reply") or reason.startswith("expected MemberAck"):
        return "bad_reply"
    return "other"


def update_reason(reason: str) -> str:
    """A fixed label for an update rejection reason (``other`` if the wording is new)."""
    for needle, label in _UPDATE_REASONS:
        if needle in reason:
            return label
    return "other"


@dataclass
class StateSnapshot:
    """What the daemon knows right now, taken on the trio thread for one scrape."""

    clusters: dict[str, bool] = field(default_factory=dict)  # cluster id -> connected
    inflight_bytes: int = 0
    control_served: int = 0
    control_refused: int = 0
    bridge_rejected_frames: int = 0
    send_retries: int = 0
    revoked_serials: int = 0
    uptime_s: float = 0.0


class _StateCollector(Collector):
    def __init__(self, snapshot: Callable[[], StateSnapshot | None]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterator[Any]:
        # Registering must not call collect(): that would block on the trio thread.
        return iter(())

    def collect(self) -> Iterator[Any]:
        snap = self._snapshot()
        if snap is None:
            return
        up = GaugeMetricFamily("fabricd_cluster_connected",
                               "1 if the member cluster is connected now, 0 if known but not connected",
                               labels=["cluster"])
        for cluster, connected in sorted(snap.clusters.items()):
            up.add_metric([cluster], 1.0 if connected else 0.0)
        yield up
        yield GaugeMetricFamily("fabricd_connected_clusters", "member clusters connected now",
                                value=sum(snap.clusters.values()))
        yield GaugeMetricFamily("fabricd_update_inflight_bytes",
                                "bytes of incoming updates being received (reserved against limits.max_inflight_bytes)",
                                value=snap.inflight_bytes)
        control = CounterMetricFamily("fabricd_control_requests", "control requests served or refused",
                                      labels=["outcome"])
        control.add_metric(["served"], snap.control_served)
        control.add_metric(["refused"], snap.control_refused)
        yield control
        yield CounterMetricFamily("fabricd_update_send_retries",
                                  "sends retried after a broken stream or a busy answer",
                                  value=snap.send_retries)
        yield CounterMetricFamily("fabricd_bridge_rejected_frames", "malformed frames refused on the bridge socket",
                                  value=snap.bridge_rejected_frames)
        yield GaugeMetricFamily("fabricd_revoked_serials", "certificate serials on the revocation list",
                                value=snap.revoked_serials)
        yield GaugeMetricFamily("fabricd_uptime_seconds", "seconds since the daemon started",
                                value=snap.uptime_s)


class DaemonMetrics:
    """The daemon's metrics and the hooks that feed them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.info = Gauge("fabricd_info", "this daemon (value 1)", ["cluster", "peer_id", "role"], registry=r)
        self.sent_bytes = Counter("fabricd_update_sent_bytes", "update body bytes acknowledged by a remote cluster",
                                  ["cluster"], registry=r)
        self.sent = Counter("fabricd_update_sent", "updates acknowledged by a remote cluster", ["cluster"], registry=r)
        self.received_bytes = Counter("fabricd_update_received_bytes",
                                      "update body bytes received and verified from a remote cluster",
                                      ["cluster"], registry=r)
        self.received = Counter("fabricd_update_received", "updates received, verified and delivered",
                                ["cluster"], registry=r)
        self.in_flight = Gauge("fabricd_updates_in_flight", "update streams open now", ["direction"], registry=r)
        self.latency = Histogram("fabricd_update_seconds",
                                 "seconds per update: sent = header to ack, received = header to delivery",
                                 ["direction"], buckets=LATENCY_BUCKETS, registry=r)
        self.path_bytes = Counter("fabricd_update_path_bytes", "update body bytes acknowledged, by the path they "
                                  "took: dataplane, dataplane_relayed (spliced by a gateway), direct or relayed (libp2p)",
                                  ["cluster", "path"], registry=r)
        self.refusals = Counter("fabricd_refusals", "things refused, by stage (membership, stream, update) and reason",
                                ["stage", "reason"], registry=r)
        self.membership = Counter("fabricd_membership_events", "membership events", ["event"], registry=r)
        self.cut = Counter("fabricd_streams_cut", "streams and relay circuits cut for falling below "
                           "limits.min_transfer_rate after their grace, by protocol", ["protocol"], registry=r)
        #: the same, for ``fabricd status`` (streams_cut)
        self.cuts = dict.fromkeys(CUT_PROTOCOLS, 0)
        for direction in ("sent", "received"):
            self.in_flight.labels(direction)
        for event in MEMBERSHIP_EVENTS:
            self.membership.labels(event)
        for protocol in CUT_PROTOCOLS:
            self.cut.labels(protocol)

    # ---- hooks (cheap, never raise) -------------------------------------------------------

    def update_sent(self, cluster: str, nbytes: int, seconds: float) -> None:
        self.sent_bytes.labels(cluster).inc(nbytes)
        self.sent.labels(cluster).inc()
        self.latency.labels("sent").observe(seconds)

    def update_received(self, cluster: str, nbytes: int, seconds: float) -> None:
        self.received_bytes.labels(cluster).inc(nbytes)
        self.received.labels(cluster).inc()
        self.latency.labels("received").observe(seconds)

    def update_path(self, cluster: str, path: str, nbytes: int) -> None:
        self.path_bytes.labels(cluster, path).inc(nbytes)

    def stream_opened(self, direction: str) -> None:
        self.in_flight.labels(direction).inc()

    def stream_closed(self, direction: str) -> None:
        self.in_flight.labels(direction).dec()

    def update_rejected(self, reason: str) -> None:
        self.refusals.labels("update", update_reason(reason)).inc()

    def stream_cut(self, protocol: str) -> None:
        self.cut.labels(protocol).inc()
        self.cuts[protocol] += 1

    def stream_refused(self) -> None:
        self.refusals.labels("stream", "not_a_member").inc()

    def member_event(self, event: str, reason: str = "") -> None:
        self.membership.labels(event if event in MEMBERSHIP_EVENTS else "other").inc()
        if event == "rejected":
            self.refusals.labels("membership", membership_reason(reason)).inc()


#: The default hook target of a service no daemon has wired up (e.g. in unit tests).
UNWIRED = DaemonMetrics()


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> (host, port); ValueError says what is wrong."""
    match = re.fullmatch(r"\[([0-9a-fA-F:.]+)\]:(\d{1,5})|([^:\[\]\s]+):(\d{1,5})", text)
    if match is None:
        raise ValueError("HOST:PORT such as 127.0.0.1:9100 (port 0 picks a free one)")
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    if port > 65535:
        raise ValueError(f"a port from 0 to 65535, not {port}")
    return host, port


class MetricsServer:
    """``/metrics`` over HTTP from prometheus_client's server thread, owned by a trio task."""

    def __init__(self, metrics: DaemonMetrics, endpoint: str,
                 snapshot: Callable[[], StateSnapshot]) -> None:
        self.metrics = metrics
        self.host, self.port = parse_endpoint(endpoint)
        self._snapshot = snapshot
        self._token: trio.lowlevel.TrioToken | None = None
        self.address = ""

    def _snapshot_from_thread(self) -> StateSnapshot | None:
        if self._token is None:
            return None
        try:
            return trio.from_thread.run_sync(self._snapshot, trio_token=self._token)
        except (trio.RunFinishedError, trio.Cancelled):
            return None
        except Exception as exc:  # noqa: BLE001 - a scrape must not fail on a state read
            log.error("metrics.snapshot_failed", reason=f"{type(exc).__name__}: {exc}")
            return None

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        collector = _StateCollector(self._snapshot_from_thread)
        self.metrics.registry.register(collector)
        server: WSGIServer
        thread: threading.Thread
        server, thread = start_http_server(self.port, self.host, registry=self.metrics.registry)
        bound_host, bound_port = str(server.server_address[0]), int(server.server_address[1])
        self.address = f"[{bound_host}]:{bound_port}" if ":" in bound_host else f"{bound_host}:{bound_port}"
        log.info("metrics.serving", url=f"http://{self.address}/metrics")
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            # Stop the HTTP thread before the daemon's state goes away; a scrape that is
            # under way when trio stops gets no state families, never an exception.
            self._token = None
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(server.shutdown)
            server.server_close()
            thread.join(5)
            self.metrics.registry.unregister(collector)
            log.info("metrics.stopped", url=f"http://{self.address}/metrics")
