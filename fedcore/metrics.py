"""Prometheus metrics of a job as an executor or the scheduler sees it, and their endpoint.

One `RunMetrics` per process (its own registry; several may share a test process). The
round engine calls `observe_round` after every round and `cluster_lost` when a cluster
drops out; `serve("HOST:PORT")` exposes them at /metrics from a daemon thread until
`close()`; `routes` add other paths (the scheduler's live page, scheduler/rundir/live.py).
Names: `fedpilot_executor_*` and `fedpilot_scheduler_*`, listed in docs/observability.md. Labels are the job id (and, for losses, the lost cluster's id).
"""

from __future__ import annotations

import math
import re
import socket
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from proto.rounds import ACCURACY_THRESHOLDS

#: a path's handler: () -> (body, content type)
Route = Callable[[], tuple[bytes, str]]

COMPONENTS = ("executor", "scheduler")
ROUND_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0)


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> (host, port); ValueError says what is wrong."""
    match = re.fullmatch(r"\[([0-9a-fA-F:.]+)\]:(\d{1,5})|([^:\[\]\s]+):(\d{1,5})", text)
    if match is None or int(match.group(2) or match.group(4)) > 65535:
        raise ValueError(f"metrics endpoint {text!r}: expected HOST:PORT such as 127.0.0.1:9101 "
                         "(port 0 picks a free one)")
    return match.group(1) or match.group(3), int(match.group(2) or match.group(4))


class RunMetrics:
    """Round, round and training seconds, accuracy, loss, bytes, actors and cluster losses."""

    def __init__(self, component: str, cluster: str = "") -> None:
        if component not in COMPONENTS:
            raise ValueError(f"component must be one of {', '.join(COMPONENTS)}, not {component!r}")
        self.registry = CollectorRegistry(auto_describe=True)
        p, r = f"fedpilot_{component}", self.registry
        self.info = Gauge(f"{p}_info", "this process (value 1)", ["cluster"], registry=r)
        self.info.labels(cluster).set(1)
        self.round = Gauge(f"{p}_round", "last finished round", ["job"], registry=r)
        self.rounds = Counter(f"{p}_rounds", "rounds finished", ["job"], registry=r)
        self.round_seconds = Histogram(f"{p}_round_seconds", "wall seconds per round", ["job"],
                                       buckets=ROUND_BUCKETS, registry=r)
        self.last_round_seconds = Gauge(f"{p}_last_round_seconds", "wall seconds of the last round",
                                        ["job"], registry=r)
        self.training_seconds = Counter(f"{p}_training_seconds", "seconds spent in local training",
                                        ["job"], registry=r)
        self.accuracy = Gauge(f"{p}_accuracy", "test accuracy after the last round (NaN if not measured here)",
                              ["job"], registry=r)
        self.loss = Gauge(f"{p}_loss", "test loss after the last round (NaN if not measured here)",
                          ["job"], registry=r)
        self.bytes = Counter(f"{p}_bytes", "model bytes moved, inside a cluster (intra) or between clusters (inter)",
                             ["job", "scope"], registry=r)
        self.actors = Gauge(f"{p}_actors_materialized", "client actors alive now", ["job"], registry=r)
        self.cluster_losses = Counter(f"{p}_cluster_losses", "clusters lost during a job",
                                      ["job", "cluster"], registry=r)
        self.epsilon = Gauge(f"{p}_privacy_epsilon", "[privacy] dp: the epsilon spent so far",
                             ["job"], registry=r)
        self.contributions = Counter(f"{p}_contributions", "cluster contributions an "
                                     "aggregation that closes early applied", ["job", "cluster"],
                                     registry=r)
        self.staleness = Histogram(f"{p}_contribution_staleness", "aggregations between a "
                                   "contribution's model and the one it was applied to",
                                   ["job"], buckets=(0, 1, 2, 4, 8, 16, 64), registry=r)
        self.dropped = Counter(f"{p}_contributions_dropped", "contributions dropped: late, or "
                               "beyond aggregation.max_staleness", ["job"], registry=r)
        self.time_to_accuracy = Gauge(f"{p}_time_to_accuracy_seconds", "seconds of rounds "
                                      "until the job's accuracy first reached the threshold",
                                      ["job", "threshold"], registry=r)
        self._elapsed: dict[str, float] = {}  # job -> seconds of its rounds so far
        self._reached: set[tuple[str, float]] = set()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.address = ""

    # ---- what the round engine calls -----------------------------------------------------

    def observe_round(self, job_id: str, record: Any) -> None:
        """Record one finished round from any object with the round fields (`round`,
        `seconds`, `accuracy`, `loss`, `bytes_intra`, `bytes_inter`; optional
        `training_seconds`, `actors_materialized` or `actors_created`)."""
        self.round_finished(
            job_id, int(record.round), seconds=float(record.seconds),
            accuracy=float(record.accuracy), loss=float(record.loss),
            bytes_intra=int(record.bytes_intra), bytes_inter=int(record.bytes_inter),
            training_seconds=getattr(record, "training_seconds", None),
            actors_materialized=getattr(record, "actors_materialized",
                                        getattr(record, "actors_created", None)),
            epsilon=getattr(record, "epsilon", None))
        for cluster, contribution in (getattr(record, "contributions", None) or {}).items():
            self.contributions.labels(job_id, cluster).inc(1 + contribution.get("earlier", 0))
            self.staleness.labels(job_id).observe(contribution.get("staleness", 0))
        self.dropped.labels(job_id).inc(int(getattr(record, "dropped", 0)))
        elapsed = self._elapsed[job_id] = self._elapsed.get(job_id, 0.0) + float(record.seconds)
        for t in ACCURACY_THRESHOLDS:
            if record.accuracy >= t and (job_id, t) not in self._reached:
                self._reached.add((job_id, t))
                self.time_to_accuracy.labels(job_id, f"{t:g}").set(elapsed)

    def round_finished(self, job_id: str, round: int, *, seconds: float, accuracy: float, loss: float,
                       bytes_intra: int, bytes_inter: int, training_seconds: float | None = None,
                       actors_materialized: int | None = None,
                       epsilon: float | None = None) -> None:
        self.round.labels(job_id).set(round)
        self.rounds.labels(job_id).inc()
        self.round_seconds.labels(job_id).observe(max(seconds, 0.0))
        self.last_round_seconds.labels(job_id).set(seconds)
        self.accuracy.labels(job_id).set(accuracy if math.isfinite(accuracy) else math.nan)
        self.loss.labels(job_id).set(loss if math.isfinite(loss) else math.nan)
        self.bytes.labels(job_id, "intra").inc(max(bytes_intra, 0))
        self.bytes.labels(job_id, "inter").inc(max(bytes_inter, 0))
        if training_seconds is not None:
            self.training_seconds.labels(job_id).inc(max(float(training_seconds), 0.0))
        if actors_materialized is not None:
            self.actors.labels(job_id).set(int(actors_materialized))
        if epsilon is not None and math.isfinite(epsilon):  # a job with DP
            self.epsilon.labels(job_id).set(epsilon)

    def cluster_lost(self, job_id: str, cluster: str) -> None:
        self.cluster_losses.labels(job_id, cluster).inc()

    # ---- the endpoint --------------------------------------------------------------------

    def serve(self, endpoint: str, routes: Mapping[str, Route] | None = None) -> str:
        """Serve /metrics (and ``routes``: path -> handler) at ``endpoint`` (HOST:PORT) from
        a daemon thread; the bound address."""
        if self._server is not None:
            return self.address
        host, port = parse_endpoint(endpoint)
        table: dict[str, Route] = {
            "/metrics": lambda: (generate_latest(self.registry), CONTENT_TYPE_LATEST),
            **(routes or {})}
        handler = type("Handler", (_Handler,), {"routes": table})
        server_class = type("Server", (ThreadingHTTPServer,),
                            {"address_family": socket.AF_INET6 if ":" in host else socket.AF_INET,
                             "daemon_threads": True})
        self._server = server_class((host, port), handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http",
                                        daemon=True)
        self._thread.start()
        bound_host, bound_port = str(self._server.server_address[0]), int(self._server.server_address[1])
        self.address = f"[{bound_host}]:{bound_port}" if ":" in bound_host else f"{bound_host}:{bound_port}"
        return self.address

    def close(self) -> None:
        """Stop serving (idempotent); the counters stay readable in-process."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(5)
            self._server = self._thread = None

    def __enter__(self) -> RunMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Handler(BaseHTTPRequestHandler):
    """GET a path of `routes`; 404 names the paths there are, 500 says what failed."""

    routes: dict[str, Route] = {}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0]
        route = self.routes.get(path)
        if route is None:
            self._send(404, f"no page {path}; try {', '.join(sorted(self.routes))}\n".encode(),
                       "text/plain; charset=utf-8")
            return
        try:
            body, content_type = route()
        except Exception as exc:  # a page that cannot be made now: say why, keep serving
            self._send(500, f"{path}: {type(exc).__name__}: {exc}\n".encode(),
                       "text/plain; charset=utf-8")
            return
        self._send(200, body, content_type)

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # one line per scrape is noise
        pass
