"""`fedpilot-scheduler status RUN_DIR [--follow]`: a running or finished job from its run directory.

Reads only what the scheduler writes there (`summary.json`, `metrics.csv`; see
`scheduler/rundir/results.py`), so it works from another terminal or machine and never talks to
the mesh. `RunRecorder` is the writing side: given to the driver as its progress callback,
it rewrites both files (atomically) after every round with `status` = running, then
finished or failed. A file caught half-written by another writer is read again, then
skipped for this look, never an error.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from proto.job import JobSpec
from scheduler.errors import SchedulerError
from scheduler.rundir.results import JobSummary, RoundRecord, write_metrics_csv

STATES = ("running", "finished", "failed")
_NUMERIC = ("accuracy", "loss", "personalized_accuracy", "bytes_intra", "bytes_inter", "seconds")


class RunDirError(SchedulerError):
    """RUN_DIR is not a run directory (or cannot be read)."""


@dataclass
class RunStatus:
    """What a run directory says about its job right now."""

    path: Path
    state: str                      # running | finished | failed
    job_id: str = ""
    rounds: list[dict[str, Any]] = field(default_factory=list)
    rounds_total: int | None = None
    clusters: list[dict[str, Any]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)  # topology, aggregation, ...
    error: str = ""
    notes: list[str] = field(default_factory=list)  # e.g. a half-written file

    @property
    def current_round(self) -> int:
        return int(self.rounds[-1]["round"]) if self.rounds else 0

    def bytes_by_cluster(self) -> dict[str, dict[str, int]]:
        """Inter/intra-cluster bytes each cluster sent, summed over the rounds so far."""
        out: dict[str, dict[str, int]] = {}
        for r in self.rounds:
            for cluster, counts in (r.get("by_cluster") or {}).items():
                row = out.setdefault(str(cluster), {"bytes_inter": 0, "bytes_intra": 0})
                for key in row:
                    row[key] += _int(counts.get(key, 0)) if isinstance(counts, dict) else 0
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"run_dir": str(self.path), "state": self.state, "job_id": self.job_id,
                "round": self.current_round, "rounds_total": self.rounds_total,
                "rounds": self.rounds, "clusters": self.clusters,
                "bytes_by_cluster": self.bytes_by_cluster(),
                "bytes_inter_total": sum(_int(r.get("bytes_inter")) for r in self.rounds),
                "bytes_intra_total": sum(_int(r.get("bytes_intra")) for r in self.rounds),
                "details": self.details, "error": self.error, "notes": self.notes}


class RunRecorder:
    """Keeps RUN_DIR's summary.json and metrics.csv current while a job runs.

    Call it as the driver's progress callback, ``recorder(record, rounds_total)`` after each
    round; ``failed(reason)`` if the job fails. `write_results` at the end replaces
    summary.json with the final one (status then reads as finished). Optional ``metrics``
    (a `fedcore.metrics.RunMetrics`) gets every round too.
    """

    def __init__(self, out_dir: str | os.PathLike[str], summary: JobSummary, *,
                 metrics: Any = None) -> None:
        self.out = Path(out_dir)
        self.summary = summary
        self.metrics = metrics
        self.rounds_total: int | None = None
        self.out.mkdir(parents=True, exist_ok=True)
        self._write("running")

    @classmethod
    def for_job(cls, out_dir: str | os.PathLike[str], spec: JobSpec, *, backend: str,
                metrics: Any = None) -> RunRecorder:
        """A recorder for ``spec`` before its plan exists (communities are filled in by
        the final summary)."""
        summary = JobSummary(job_id=spec.job_id, backend=backend,
                             placement_strategy=spec.placement.strategy,
                             topology=spec.topology.kind, aggregation=spec.aggregation.name,
                             compression=spec.transfer.compression, communities=0)
        recorder = cls(out_dir, summary, metrics=metrics)
        recorder.rounds_total = spec.training.federated_learning_rounds
        recorder._write("running")
        return recorder

    def __call__(self, record: RoundRecord, rounds_total: int) -> None:
        self.summary.rounds.append(record)
        self.rounds_total = rounds_total
        if self.metrics is not None:
            self.metrics.observe_round(self.summary.job_id, record)
        self._write("running")

    def follow_faults(self, faults: Sequence[dict[str, Any]]) -> None:
        """The driver's fault events so far (written with the next round; every new loss
        is counted in the metrics)."""
        if self.metrics is not None:
            for event in faults[len(self.summary.faults):]:
                if event.get("event") == "lost":
                    self.metrics.cluster_lost(self.summary.job_id, str(event.get("cluster")))
        self.summary.faults = [dict(f) for f in faults]

    def finished(self) -> None:
        self._write("finished")

    def failed(self, reason: str, lost: Sequence[str] = ()) -> None:
        """The job failed; ``lost`` are the clusters it lost (counted in the metrics)."""
        if self.metrics is not None:
            for cluster in lost:
                self.metrics.cluster_lost(self.summary.job_id, cluster)
        self._write("failed", error=reason)

    def _write(self, state: str, error: str = "") -> None:
        self.summary.finish()
        data = {**self.summary.to_dict(), "status": state, "rounds_total": self.rounds_total}
        if error:
            data["error"] = error
        # metrics.csv first: a reader that finds the new summary also finds its rounds
        write_metrics_csv(self.out / "metrics.csv", self.summary.rounds)
        tmp = self.out / ".summary.json.tmp"
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, self.out / "summary.json")


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise RunDirError(f"{path}: cannot read it: {exc}") from None


def _read_summary(path: Path, notes: list[str]) -> dict[str, Any] | None:
    for attempt in range(3):
        text = _read_text(path)
        if text is None:
            return None
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            time.sleep(0.1 * (attempt + 1))  # being rewritten: look again
            continue
        if isinstance(data, dict):
            return data
        raise RunDirError(f"{path}: not a job summary (a JSON object was expected)")
    notes.append(f"{path.name} is being written; shown from metrics.csv")
    return None


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    text = _read_text(path)
    if not text:
        return []
    rows = []
    for raw in csv.DictReader(io.StringIO(text)):
        row: dict[str, Any] = {}
        try:
            row["round"] = int(raw["round"])
            for key in _NUMERIC:
                value = raw.get(key)
                if value is None or value == "":
                    raise ValueError(key)  # a line cut short by a writer mid-round
                row[key] = int(value) if key.startswith("bytes") else float(value)
        except (KeyError, TypeError, ValueError):
            continue
        rows.append(row)
    return rows


def read_run(run_dir: str | Path) -> RunStatus:
    """The status of the job whose results are in ``run_dir``; RunDirError if it is none."""
    path = Path(run_dir)
    if not path.is_dir():
        raise RunDirError(f"{path}: no such directory (a run directory is runs/<job-id>/)")
    notes: list[str] = []
    summary = _read_summary(path / "summary.json", notes)
    csv_rounds = _read_metrics(path / "metrics.csv")
    if summary is None and not csv_rounds and not (path / "metrics.csv").exists():
        if notes:
            return RunStatus(path, "running", notes=notes)
        raise RunDirError(f"{path}: no summary.json or metrics.csv; not a run directory "
                          "(give runs/<job-id>/ or the --out of submit)")
    summary = summary or {}
    summary_rounds = [r for r in summary.get("rounds") or [] if isinstance(r, dict) and "round" in r]
    rounds = summary_rounds if len(summary_rounds) >= len(csv_rounds) else csv_rounds
    state = summary.get("status")
    if state not in STATES:
        # Before the driver wrote a status field, summary.json appeared only at the end.
        state = "finished" if summary else "running"
    total = summary.get("rounds_total")
    clusters = [c for c in summary.get("clusters") or [] if isinstance(c, dict)]
    details: dict[str, Any] = {k: summary[k] for k in ("backend", "topology", "aggregation", "placement_strategy",
                                       "compression", "communities", "replans", "migrations",
                                       "contributions_dropped", "time_to_accuracy")
               if k in summary}
    return RunStatus(path, str(state), job_id=str(summary.get("job_id") or path.name),
                     rounds=rounds, rounds_total=_int(total) if total is not None else None,
                     clusters=clusters, details=details, error=str(summary.get("error") or ""),
                     notes=notes)


def _mb(n: int) -> str:
    return f"{n / 1e6:.3f}"


def _num(x: Any, digits: int = 4) -> str:
    try:
        value = float(x)
    except (TypeError, ValueError):
        return "-"
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def round_line(r: dict[str, Any]) -> str:
    return (f"{int(r['round']):>5}  {_num(r.get('accuracy')):>8}  {_num(r.get('loss')):>8}  "
            f"{_mb(_int(r.get('bytes_inter'))):>10}  {_mb(_int(r.get('bytes_intra'))):>10}  "
            f"{_num(r.get('seconds'), 2):>8}")


ROUND_HEADER = f"{'round':>5}  {'accuracy':>8}  {'loss':>8}  {'inter MB':>10}  {'intra MB':>10}  {'seconds':>8}"


def headline(s: RunStatus) -> str:
    of = f" of {s.rounds_total}" if s.rounds_total else ""
    text = f"job {s.job_id}: {s.state}, round {s.current_round}{of}"
    if s.rounds:
        text += f", accuracy {_num(s.rounds[-1].get('accuracy'))}"
    return text + (f" - {s.error}" if s.error else "")


def format_status(s: RunStatus) -> str:
    lines = [headline(s)]
    if s.details:
        lines.append("  " + ", ".join(f"{k}={v}" for k, v in s.details.items()))
    if s.rounds:
        lines += ["", ROUND_HEADER] + [round_line(r) for r in s.rounds]
    by_cluster = s.bytes_by_cluster()
    info = {str(c.get("cluster_id")): c for c in s.clusters}
    if by_cluster or info:
        lines += ["", "clusters:"]
        for cid in sorted(set(by_cluster) | set(info)):
            c, b = info.get(cid, {}), by_cluster.get(cid, {})
            parts = [f"{cid}:"]
            if c:
                parts.append(f"clients={_int(c.get('clients'))} actors={_int(c.get('actors_materialized'))}")
            if b:
                parts.append(f"inter sent {_mb(b['bytes_inter'])} MB, intra {_mb(b['bytes_intra'])} MB")
            if _int(c.get("daemon_bytes_sent")) or _int(c.get("daemon_bytes_received")):
                parts.append(f"daemon sent {_mb(_int(c.get('daemon_bytes_sent')))} MB, "
                             f"received {_mb(_int(c.get('daemon_bytes_received')))} MB")
            lines.append("  " + " ".join(parts))
    d = s.to_dict()
    lines += ["", f"total: inter {_mb(d['bytes_inter_total'])} MB, intra {_mb(d['bytes_intra_total'])} MB, "
                  f"{_num(sum(float(r.get('seconds') or 0) for r in s.rounds), 1)} s"]
    lines += [f"note: {n}" for n in s.notes]
    return "\n".join(lines) + "\n"


def follow(run_dir: str | Path, out: TextIO, *, interval: float, timeout: float | None,
           on_status: Callable[[RunStatus], None] | None = None) -> RunStatus:
    """Print the status, then one line per new round until the job is finished or failed
    (``on_status`` sees every look, e.g. to write TensorBoard scalars)."""
    start = time.monotonic()
    status = read_run(run_dir)
    if on_status is not None:
        on_status(status)
    out.write(format_status(status))
    out.flush()
    shown = status.current_round
    while status.state == "running":
        if timeout is not None and time.monotonic() - start > timeout:
            out.write(f"still running after {timeout:g} s; stopped following\n")
            break
        time.sleep(interval)
        try:
            status = read_run(run_dir)
        except RunDirError:
            continue  # e.g. the directory is being replaced; look again
        if on_status is not None:
            on_status(status)
        new = [r for r in status.rounds if int(r["round"]) > shown]
        if new and shown == 0:
            out.write("\n" + ROUND_HEADER + "\n")
        for r in new:
            out.write(round_line(r) + "\n")
        if new:
            shown = int(new[-1]["round"])
        if status.state != "running":
            out.write(headline(status) + "\n")
        out.flush()
    return status


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "status", help="show a running or finished job from its run directory",
        description="Show the rounds, clusters and bytes of the job whose results are in "
                    "RUN_DIR (runs/<job-id>/ or the --out of submit). The scheduler updates "
                    "the directory after every round, so this works while the job runs.")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--follow", "-f", action="store_true",
                   help="keep watching: print each new round until the job finishes or fails")
    p.add_argument("--interval", type=float, default=2.0, metavar="SECONDS",
                   help="with --follow: seconds between looks (default 2)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="with --follow: stop following after this long")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="also write the rounds as TensorBoard scalars under DIR/<job id>/ "
                        "(with --follow, as they come; needs the tensorboard extra)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    writer: Any = None

    def to_tensorboard(status: RunStatus) -> None:
        nonlocal writer
        if writer is None:
            from scheduler.rundir.tensorboard import ScalarWriter

            writer = ScalarWriter(args.tensorboard, status.job_id)
        writer.add_rounds(status.rounds)

    hook = to_tensorboard if args.tensorboard else None
    try:
        if args.follow:
            status = follow(args.run_dir, sys.stdout, interval=max(args.interval, 0.05),
                            timeout=args.timeout, on_status=hook)
        else:
            status = read_run(args.run_dir)
            if hook is not None:
                hook(status)
            if args.json:
                json.dump(status.to_dict(), sys.stdout)
                sys.stdout.write("\n")
            else:
                sys.stdout.write(format_status(status))
    finally:
        if writer is not None:
            writer.close()
    if writer is not None:
        print(f"tensorboard: {writer.written} round(s) in {writer.path} "
              f"(tensorboard --logdir {args.tensorboard})", file=sys.stderr)
    return 1 if status.state == "failed" else 0
