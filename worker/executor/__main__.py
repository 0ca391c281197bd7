"""`python -m worker.executor`: one cluster's executor process, started by fabricd.

It connects to the daemon's bridge, registers for one job, answers the scheduler's
control messages and exits after `job.stop`, when the bridge goes away (its daemon died)
or when the scheduler's lease runs out (the scheduler died). Leaving releases the job's
actors first; the exit does not wait for threads parked on a round (they are woken, but
a Ray call may not return).
"""

from __future__ import annotations

import argparse
import logging
import os
import threading

from fedcore.logs import LOG_FORMAT_ENV, LOG_FORMATS, setup_logging
from worker.executor.bridge import BridgeLink
from worker.executor.service import ExecutorService

log = logging.getLogger("fedpilot.executor")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m worker.executor",
        description="Run one cluster's share of a federated job (started by fabricd).")
    parser.add_argument("--bridge", required=True, help="fabricd's bridge socket path")
    parser.add_argument("--cluster-id", required=True, help="this cluster's id")
    parser.add_argument("--job", required=True, help="the job id to serve")
    parser.add_argument("--ray", default="local",
                        help="'local' (embedded Ray), 'auto' or an address (join a cluster), "
                             "or 'inprocess' (no Ray; threads)")
    parser.add_argument("--num-cpus", type=float, default=None,
                        help="CPUs for an embedded Ray (default: all)")
    parser.add_argument("--object-store-memory", type=int, default=None,
                        help="bytes of object store for an embedded Ray (default: Ray's)")
    parser.add_argument("--metrics", metavar="HOST:PORT", default="",
                        help="serve this job's executor metrics (fedpilot_executor_*) at "
                             "http://HOST:PORT/metrics (cluster.toml [metrics] executor_endpoint)")
    parser.add_argument("--dataset", metavar="NAME=KIND:PATH", action="append", default=[],
                        help="a dataset this cluster holds, for jobs with data.placement = "
                             "'pinned' (cluster.toml [datasets]; repeatable)")
    parser.add_argument("--spare-bytes", type=int, default=None, metavar="BYTES",
                        help="memfd bytes this process makes ahead, in idle time, for its next "
                             "large update (one spare, default 256 MiB; 0: none; fabricd passes 0 "
                             "when cluster.toml limits.dataplane_spare_bytes = 0)")
    parser.add_argument("--log-format", choices=LOG_FORMATS,
                        default=os.environ.get(LOG_FORMAT_ENV, "kv"),
                        help="key=value (kv, text) or json lines; default: the daemon's "
                             f"(${LOG_FORMAT_ENV}), else kv")
    args = parser.parse_args(argv)
    datasets: dict[str, str] = {}
    for item in args.dataset:
        name, sep, dataset = item.partition("=")
        if not sep or not name or not dataset:
            parser.error(f"--dataset {item!r}: expected NAME=KIND:PATH")
        datasets[name] = dataset
    args.datasets = datasets
    if args.spare_bytes is not None and args.spare_bytes < 0:
        parser.error(f"--spare-bytes {args.spare_bytes}: expected 0 (none) or a number of bytes")
    return args


def apply_spare_bytes(spare_bytes: int | None) -> None:
    """``--spare-bytes``: the bound of this process's memfds made ahead (None: the default)."""
    if spare_bytes is not None:
        from proto import bridge

        bridge.SEND_SPARES.limit = spare_bytes


def daemon_job_counters(bridge: str, job_id: str) -> dict[str, int]:
    """fabricd's own byte counters for `job_id` (asked over a second bridge connection)."""
    from proto.bridge import BridgeClient, StatusReply, StatusRequest

    try:
        with BridgeClient(bridge, role="cli", timeout=10) as client:
            reply, _ = client.request(StatusRequest())
    except (OSError, ConnectionError) as exc:
        log.warning("event=daemon_counters_unavailable reason=%s", exc)
        return {}
    if not isinstance(reply, StatusReply):
        return {}
    counters = reply.status.get("jobs", {}).get(job_id, {})
    return {str(k): int(v) for k, v in counters.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_format)
    apply_spare_bytes(args.spare_bytes)
    from worker.executor.runtime import open_context, runtime_factory

    context = open_context(args.ray, num_cpus=args.num_cpus,
                           object_store_memory=args.object_store_memory)
    service = ExecutorService(cluster_id=args.cluster_id,
                              make_runtime=runtime_factory(context, args.cluster_id,
                                                           datasets=args.datasets),
                              daemon_counters=lambda job: daemon_job_counters(args.bridge, job))

    def on_control(msg):  # type: ignore[no-untyped-def]
        return True, service.handle(dict(msg.body)), ""

    finished = threading.Event()

    def on_replied(msg):  # type: ignore[no-untyped-def]
        # exit once job.stop's own reply is written: another message's reply (a lease
        # renewal answered meanwhile) must not end the process before it
        if msg.body.get("kind") == "job.stop" and service.stopped.is_set():
            finished.set()

    def on_delivery(msg, payload):  # type: ignore[no-untyped-def]
        return service.deliver(job_id=msg.job_id, round=msg.round, source_node=msg.source_node,
                               target_node=msg.target_node, source_cluster=msg.source_cluster,
                               payload=payload, message_id=msg.message_id)

    link = BridgeLink(args.bridge, cluster_id=args.cluster_id, job_id=args.job,
                      on_delivery=on_delivery, on_control=on_control, on_replied=on_replied,
                      on_control_arrived=lambda msg: service.renew())
    service.link = link
    if args.metrics:
        from fedcore.metrics import RunMetrics

        metrics = RunMetrics("executor", cluster=args.cluster_id)
        try:
            address = metrics.serve(args.metrics)
            service.metrics = metrics
            log.info("event=metrics_serving cluster=%s address=%s", args.cluster_id, address)
        except OSError as exc:  # e.g. another job's executor holds the port: run without
            log.warning("event=metrics_unavailable cluster=%s endpoint=%s reason=%s",
                        args.cluster_id, args.metrics, exc)
    log.info("event=executor_ready cluster=%s job=%s ray=%s", args.cluster_id, args.job, args.ray)
    try:
        while not finished.wait(0.5):
            if link.wait_closed(0):
                service.abort("the bridge to fabricd closed (the daemon is gone)")
                log.error("event=executor_exit cluster=%s reason=bridge_closed", args.cluster_id)
                return 1
            if service.lease_left() < 0:
                service.abort(f"no word from the scheduler for {service.lease_seconds:.0f} s "
                              "(lease expired: the scheduler is gone)")
                log.error("event=executor_exit cluster=%s reason=lease_expired", args.cluster_id)
                return 3
        log.info("event=executor_exit cluster=%s reason=job_stopped", args.cluster_id)
        return 0
    finally:
        link.close()
        context.shutdown()


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    # threads parked in a round (or in a Ray call) must not keep a finished executor alive
    os._exit(code)
