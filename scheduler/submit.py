"""`fedpilot-scheduler submit`: run a job over a mesh, or over an embedded local testbed."""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from scheduler.run.driver import ClusterInfo, Driver, JobFailed
from scheduler.rundir.results import RoundRecord, write_results

if TYPE_CHECKING:
    from proto.job import JobSpec

log = logging.getLogger("fedpilot.scheduler")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "submit", help="run a federated job across clusters",
        description="Run the job in JOB_TOML across the clusters of a mesh (--mesh, through "
                    "the scheduler's own fabricd) or on an embedded testbed of N local "
                    "clusters (--local N). Results go to --out (default runs/<job-id>/).")
    p.add_argument("job", metavar="JOB_TOML", help="the job file (see docs/job.md)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--mesh", metavar="SCHEDULER_TOML",
                       help="config of the scheduler's running fabricd (role scheduler)")
    where.add_argument("--local", metavar="N", type=int,
                       help="start N cluster daemons + a scheduler daemon on 127.0.0.1 with a "
                            "fresh CA, run the job, tear everything down")
    p.add_argument("--backend", choices=("ray", "inprocess"), default="ray",
                   help="with --local: each cluster's executor runs an embedded Ray "
                        "(default) or threads in one process (fast, for tests)")
    p.add_argument("--clusters", metavar="ID,ID",
                   help="with --mesh: run on exactly these clusters (default: all connected)")
    p.add_argument("--out", metavar="DIR", help="results directory (default runs/<job-id>)")
    p.add_argument("--resume", metavar="DIR",
                   help="continue the job from the last checkpoint in run directory DIR "
                        "(written with [faults] checkpoint_every); results stay in DIR")
    p.add_argument("--wait", metavar="SECONDS", type=float, default=60.0,
                   help="how long to wait for clusters to join (default 60)")
    p.add_argument("--round-timeout", metavar="SECONDS", type=float, default=900.0,
                   help="fail a round that takes longer than this (default 900)")
    p.add_argument("--capacity", metavar="N", type=int,
                   help="with --local: clients each cluster may host (default: enough for the "
                        "others to hold every client when one cluster is lost, and at least "
                        "1.2 x an even share, so placement has room to keep communities "
                        "together)")
    p.add_argument("--allow-module", metavar="MODULE", action="append", default=[],
                   help="with --local: the testbed's clusters also allow job classes from "
                        "MODULE (repeatable; the job's own model and aggregator modules are "
                        "allowed already)")
    p.add_argument("--data-root", metavar="DIR", action="append", default=[],
                   help="with --local: the testbed's clusters also allow reading data under "
                        "DIR (repeatable; the job's dataset directory is allowed already)")
    p.add_argument("--slow", metavar="ID=FACTOR", action="append", default=[],
                   help="with --local: run cluster ID's daemon, executor and Ray under a CPU "
                        "quota of 1/FACTOR of a fair share of this machine's CPUs (CPUs / "
                        "clusters, at most one; cgroup v2 cpu.max, else v1 "
                        "cpu.cfs_quota_us; says so when this machine allows neither), e.g. "
                        "cluster-2=4 (repeatable)")
    p.add_argument("--workdir", metavar="DIR",
                   help="with --local: keep the testbed's configs and logs here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--metrics", metavar="HOST:PORT",
                   help="serve the job's metrics (fedpilot_scheduler_*, docs/observability.md) "
                        "in Prometheus format at http://HOST:PORT/metrics, and a live page of the job "
                        "(mesh, placement, accuracy and traffic by round) at http://HOST:PORT/")
    p.set_defaults(func=run)


class ProgressBar:
    """Rounds, accuracy and bytes; redraws in place on a terminal, one line per round else."""

    def __init__(self, stream: TextIO, width: int = 24) -> None:
        self.stream = stream
        self.width = width
        self.tty = stream.isatty()
        self.inter = 0
        self.intra = 0

    def __call__(self, record: RoundRecord, total: int, note: str = "") -> None:
        self.inter += record.bytes_inter
        self.intra += record.bytes_intra
        done = int(self.width * record.round / max(1, total))
        bar = "#" * done + "." * (self.width - done)
        line = (f"[{bar}] round {record.round}/{total}  acc {record.accuracy:.3f}  "
                f"pers {record.personalized_accuracy:.3f}  inter {self.inter / 1e6:.2f} MB  "
                f"intra {self.intra / 1e6:.2f} MB  {record.seconds:.1f}s/round")
        if record.stalls:  # the aggregator went back to its best model, its step halved
            line += (f"  restored ({record.stalls} stall{'s' * (record.stalls > 1)}: "
                     "aggregation.on_stall)")
        if note:  # not learning: the line says so and names the key (scheduler/run/health.py)
            line += f"  ! {note}"
        if self.tty:
            end = "\n" if record.round >= total else ""
            self.stream.write("\r" + line + end)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def still_learning_line(still: dict[str, Any], spec: JobSpec) -> str:
    """The line that says the job ended while its accuracy was still rising."""
    return (f"still learning: accuracy rose {still['gain']:.3f} over the last "
            f"{still['rounds']} rounds ({still['from']:.3f} -> {still['to']:.3f}); more rounds "
            f"would likely raise it: training.federated_learning_rounds (now "
            f"{spec.training.federated_learning_rounds})")


def slow_factors(values: list[str]) -> dict[str, float]:
    """--slow ID=FACTOR options as {cluster id: factor > 1}."""
    out = {}
    for value in values:
        cid, _, factor = value.partition("=")
        try:
            out[cid] = float(factor)
        except ValueError:
            out[cid] = 0.0
        if not cid or not out[cid] > 1.0:
            raise JobFailed(f"--slow {value!r}: expected ID=FACTOR with FACTOR > 1, "
                            "e.g. cluster-2=4")
    return out


def local_capacity(clients: int, clusters: int) -> int:
    """The testbed's default capacity per cluster: the survivors of one lost cluster hold
    every client (the job rides through a lost site, as `on_cluster_loss = "continue"`
    promises), and never less than 1.2 x an even share."""
    share = math.ceil(1.2 * clients / clusters)
    return max(share, math.ceil(clients / (clusters - 1))) if clusters > 1 else share


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    from scheduler.jobfile import load_job

    try:
        summary = submit(load_job(args.job), str(args.job), args)
    except KeyboardInterrupt:
        print("interrupted: stopping the testbed", file=sys.stderr)
        return 130
    print(json.dumps(summary))
    return 0


def options(**values: Any) -> argparse.Namespace:
    """`submit`'s options with the CLI's own defaults, then `values` (for `fedpilot.run`)."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["submit", "-", "--local", "1"])
    args.local = None
    unknown = sorted(set(values) - set(vars(args)))
    if unknown:
        raise TypeError(f"unknown submit option(s) {', '.join(unknown)}; known: "
                        + ", ".join(sorted(k for k in vars(args) if k not in ("func", "job"))))
    vars(args).update(values)
    return args


def submit(spec: JobSpec, source: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run `spec` as `fedpilot-scheduler submit` does with `args` (see `options`); the
    summary it prints. Raises KeyboardInterrupt after tearing down on Ctrl-C or SIGTERM."""
    from fedcore.data.preflight import check_before_start, with_checked_learning_rate
    from scheduler.run.mesh import BridgeChannel, wait_for_clusters
    from scheduler.rundir.status import RunRecorder

    # labels and model, before any daemon or Ray starts; a DP job's model measured too, for
    # the noise it will add (as `plan` shows it)
    dp_job = spec.privacy.dp != "none"
    checked = check_before_start(spec, source, measure=dp_job)
    model_bytes = checked.model_bytes
    # a user model the job's learning rate leaves at a uniform guess trains at a smaller
    # one (training.learning_rate_check)
    spec, lowered = with_checked_learning_rate(spec, checked)
    if lowered:
        print(lowered, file=sys.stderr)
    if dp_job:
        from scheduler.plan_cli import privacy_line, privacy_noise

        print(privacy_line(privacy_noise(spec, model_bytes)), file=sys.stderr)
    out = Path(args.resume or args.out or Path("runs") / spec.job_id)
    checkpoint = None
    if args.resume:
        from scheduler.run.checkpoint import load_checkpoint

        checkpoint = load_checkpoint(out)
        if checkpoint.spec.get("job", {}).get("id") != spec.job_id:
            raise JobFailed(f"{out} holds a checkpoint of job "
                            f"{checkpoint.spec.get('job', {}).get('id')!r}, not {spec.job_id!r}")
        if checkpoint.round >= spec.training.federated_learning_rounds:
            raise JobFailed(f"{out}'s checkpoint is at round {checkpoint.round}; the job has "
                            f"{spec.training.federated_learning_rounds} rounds: nothing to do")
        print(f"resuming {spec.job_id} after round {checkpoint.round} from {out}",
              file=sys.stderr)
    testbed = None
    channel = None
    metrics = None
    live = None
    if args.metrics:
        from fedcore.metrics import RunMetrics
        from scheduler.rundir.live import LiveState

        metrics = RunMetrics("scheduler")
        live = LiveState(out, spec.job_id)
        address = metrics.serve(args.metrics, routes=live.routes())
        print(f"metrics: http://{address}/metrics  live page: http://{address}/", file=sys.stderr)
    # SIGTERM tears down like Ctrl-C (only the main thread may set a handler: a notebook's
    # fedpilot.run from another thread keeps the default)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    # Ctrl-C (SIGINT) tears the job down even when submit was started with SIGINT ignored,
    # as a shell does for a command it runs in the background (`... &`, nohup)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler) if main_thread else None
    started = time.perf_counter()
    try:
        clusters: list[ClusterInfo]
        if args.local is not None:
            from scheduler.testbed import LocalTestbed, job_allowances

            backend = "local" if args.backend == "ray" else "inprocess"
            capacity = args.capacity or local_capacity(spec.data.number_of_clients, args.local)
            # whoever starts --local is every cluster's operator: the job's own classes and
            # data are allowed (on a --mesh, real operators decide in their cluster.toml)
            allow = job_allowances(spec, modules=args.allow_module, data_roots=args.data_root)
            testbed = LocalTestbed(args.local, backend=backend, workdir=args.workdir,
                                   capacity=capacity, allow=allow, slow=slow_factors(args.slow))
            print(f"starting a local testbed: {args.local} cluster daemon(s) + scheduler "
                  f"({args.backend} executors) in {testbed.root}", file=sys.stderr)
            print(allow.describe(), file=sys.stderr)
            clusters = testbed.start(timeout=args.wait)
            for cid, note in testbed.slow_notes.items():
                print(f"slow cluster {cid}: {note}", file=sys.stderr)
            socket_path = testbed.bridge_socket("scheduler")
        else:
            from scheduler.testbed import config_socket

            socket_path = config_socket(args.mesh)  # the scheduler's own daemon's bridge
            expected = args.clusters.split(",") if args.clusters else None
            clusters = wait_for_clusters(socket_path, expected=expected, timeout=args.wait)
        print(f"clusters: {', '.join(c.cluster_id for c in clusters)}", file=sys.stderr)
        channel = BridgeChannel(socket_path, job_id=spec.job_id)
        # out/summary.json and metrics.csv follow the job round by round (`status RUN_DIR`)
        recorder = RunRecorder.for_job(out, spec, backend=args.backend, metrics=metrics)
        if checkpoint is not None:  # metrics.csv keeps the rounds before the checkpoint once
            recorder.summary.rounds.extend(RoundRecord.from_dict(d, source="checkpoint")
                                           for d in checkpoint.rounds)
        bar = None if args.quiet else ProgressBar(sys.stderr)

        def progress(record: RoundRecord, total: int) -> None:
            if driver.summary is not None:  # losses and returns so far
                recorder.follow_faults(driver.summary.faults)
            recorder(record, total)
            if bar is not None:
                bar(record, total, driver.health.note)

        def stage(line: str) -> None:
            if not args.quiet:
                print(line, file=sys.stderr, flush=True)

        driver = Driver(spec, clusters, channel, backend=args.backend, progress=progress,
                        stage=stage,
                        timeout=args.round_timeout, run_dir=out, resume=checkpoint)
        if live is not None:
            live.driver = driver
        try:
            result = driver.run()
        except BaseException as exc:
            if driver.summary is not None:
                recorder.follow_faults(driver.summary.faults)
            recorder.failed(str(exc) or type(exc).__name__,
                            lost=sorted(getattr(exc, "lost", None) or ()))  # ClusterLost names them
            raise
        finally:
            driver.close()
        write_results(out, result.summary, placement=result.placement, model_bytes=result.model)
        s = result.summary
        if s.still_learning and not args.quiet:
            print(still_learning_line(s.still_learning, spec), file=sys.stderr)
        return {
            "job_id": s.job_id, "out": str(out), "clusters": [c.cluster_id for c in clusters],
            "rounds": len(s.rounds), "final_accuracy": round(s.final_accuracy, 4),
            "personalized_accuracy": round(s.personalized_accuracy, 4),
            "bytes_inter_total": s.bytes_inter_total, "bytes_intra_total": s.bytes_intra_total,
            "seconds": round(time.perf_counter() - started, 1)}
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)
        if channel is not None:
            channel.close()
        if testbed is not None:
            testbed.close()
        if metrics is not None:
            metrics.close()
