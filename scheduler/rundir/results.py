"""Write a finished job's results directory: summary, per-round metrics, model, plots.

Everything here is plain files a person or another tool can read: JSON, CSV, safetensors
and PNG. Plots use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from proto.rounds import ACCURACY_THRESHOLDS, RoundRecord
from scheduler.rundir.placement import placement_json

ROUND_FIELDS = ("round", "accuracy", "loss", "personalized_accuracy", "participants",
                "bytes_intra", "bytes_inter", "seconds", "epsilon", "stalls")


#: a job ended "still learning" when its last round scored its best of the last
#: STILL_ROUNDS + 1 and STILL_GAIN or more above the round STILL_ROUNDS before it. On
#: bench_learning's grid (1,400 jobs) that held on 121, every one where more rounds would
#: have helped: a GRU and a small transformer on MNIST (the reference FedAvg loop at 0.52x
#: and 0.83x centralized after 15 rounds, gaining 0.06-0.07 over the last three) and the
#: digits cells whose reference ended at 0.84-0.88 (centralized 0.98-0.997)
STILL_ROUNDS = 3
STILL_GAIN = 0.03


def still_learning(accuracies: Sequence[float]) -> dict[str, Any]:
    """{"gain", "rounds", "from", "to"} when the rounds' accuracies were still rising at
    the end (STILL_ROUNDS, STILL_GAIN), else {}: the hint that more rounds would pay."""
    scores = [a for a in accuracies if math.isfinite(a)]
    if len(scores) <= 2 * STILL_ROUNDS:
        return {}
    tail = scores[-(STILL_ROUNDS + 1):]
    gain = tail[-1] - tail[0]
    if tail[-1] < max(tail) or gain < STILL_GAIN:
        return {}
    return {"gain": round(gain, 4), "rounds": STILL_ROUNDS, "from": round(tail[0], 4),
            "to": round(tail[-1], 4)}


@dataclass
class ClusterRecordSummary:
    cluster_id: str
    clients: int
    actors_materialized: int
    daemon_bytes_sent: int = 0
    daemon_bytes_received: int = 0


@dataclass
class JobSummary:
    """The `summary.json` of a job; field names are a public contract."""

    job_id: str
    backend: str
    placement_strategy: str
    topology: str
    aggregation: str
    compression: str
    communities: int
    clusters: list[ClusterRecordSummary] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)
    final_accuracy: float = 0.0
    best_accuracy: float = 0.0
    personalized_accuracy: float = 0.0
    bytes_inter_total: int = 0
    bytes_intra_total: int = 0
    seconds_total: float = 0.0
    replans: int = 0
    migrations: int = 0
    status: str = "running"
    # which model model.safetensors is, and its accuracy/loss as evaluated
    final_model: dict[str, Any] = field(default_factory=dict)
    # every cluster lost or returned: round, cluster, event, nodes moved, seconds to
    # detect and to recover (scheduler/run/recovery.py)
    faults: list[dict[str, Any]] = field(default_factory=list)
    # [privacy]: the options, the noise multiplier, the epsilon spent, and why the job
    # stopped early if its budget ran out ("stopped"); empty without [privacy]
    privacy: dict[str, Any] = field(default_factory=dict)
    # rounds that closed early ([rounds], aggregation.mode): contributions dropped in all
    contributions_dropped: int = 0
    # seconds of rounds until the job's accuracy first reached each threshold
    time_to_accuracy: dict[str, float] = field(default_factory=dict)
    # the accuracy still rising at the end ({} if not): more rounds would likely pay
    still_learning: dict[str, Any] = field(default_factory=dict)
    # a pinned job whose sites' trials lowered the learning rate ({} if not): the job's,
    # the one every client trained at, and the one each site's trial chose
    learning_rate: dict[str, Any] = field(default_factory=dict)

    def finish(self, status: str = "finished") -> None:
        """Derive the totals from the per-round records."""
        self.status = status
        if self.rounds:
            self.final_accuracy = float(self.final_model.get("accuracy",
                                                             self.rounds[-1].accuracy))
            # the final model counts too: a hybrid or decentralized job's final model is
            # the mean of its groups' models, which can score above each round's mean score
            scores = [r.accuracy for r in self.rounds] + [self.final_accuracy]
            self.best_accuracy = max((a for a in scores if math.isfinite(a)), default=0.0)
            self.personalized_accuracy = self.rounds[-1].personalized_accuracy
        self.bytes_inter_total = sum(r.bytes_inter for r in self.rounds)
        self.bytes_intra_total = sum(r.bytes_intra for r in self.rounds)
        self.seconds_total = sum(r.seconds for r in self.rounds)
        self.contributions_dropped = sum(r.dropped for r in self.rounds)
        self.still_learning = still_learning([r.accuracy for r in self.rounds])
        elapsed, self.time_to_accuracy = 0.0, {}
        for r in self.rounds:
            elapsed += r.seconds
            for t in ACCURACY_THRESHOLDS:
                if r.accuracy >= t:
                    self.time_to_accuracy.setdefault(f"{t:g}", round(elapsed, 3))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def write_results(
    out_dir: str | os.PathLike[str],
    summary: JobSummary,
    *,
    placement: Mapping[str, Any] | None = None,
    model_bytes: bytes | None = None,
) -> Path:
    """Write summary.json, metrics.csv, placement.json, model.safetensors and both plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary.finish()
    # metrics.csv first: a reader that finds the new summary also finds its rounds
    write_metrics_csv(out / "metrics.csv", summary.rounds)
    _atomic_write(out / "summary.json", (json.dumps(summary.to_dict(), indent=2) + "\n").encode())
    if placement is not None:
        _atomic_write(out / "placement.json", placement_json(placement))
    if model_bytes is not None:
        _atomic_write(out / "model.safetensors", model_bytes)
    plot_accuracy(out / "accuracy.png", {summary.job_id: summary.rounds})
    plot_traffic(out / "traffic.png", {summary.job_id: summary.rounds})
    return out


def write_metrics_csv(path: Path, rounds: Sequence[RoundRecord]) -> None:
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=list(ROUND_FIELDS), extrasaction="ignore")
    writer.writeheader()
    for record in rounds:
        writer.writerow(asdict(record))
    _atomic_write(path, buffer.getvalue().encode())


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_plot(plt: Any, fig: Any, ax: Any, path: Path, *, title: str, ylabel: str,
               crowded: bool) -> None:
    """The ending both plots share: rounds on an integer x axis, grid, legend (inside the
    axes for one or two series, beside them when comparing many), written as PNG."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if crowded:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    else:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_accuracy(path: Path, series: Mapping[str, Sequence[RoundRecord]]) -> None:
    """One line per series (a job or a strategy): global and personalized accuracy by round."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5) if len(series) <= 2 else (11, 5))
    for label, rounds in series.items():
        xs = [r.round for r in rounds]
        line, = ax.plot(xs, [r.accuracy for r in rounds], marker="o", ms=3,
                        label=f"{label} (global)")
        ax.plot(xs, [r.personalized_accuracy for r in rounds], ls="--",
                color=line.get_color(), label=f"{label} (personalized)")
    ax.set_ylim(0.0, 1.0)
    _save_plot(plt, fig, ax, path, title="Accuracy by round", ylabel="test accuracy",
               crowded=len(series) > 2)


def plot_traffic(path: Path, series: Mapping[str, Sequence[RoundRecord]]) -> None:
    """Cumulative traffic by round. One job: a line per cluster for the bytes it sent to
    other clusters, plus the job's intra-cluster total; several jobs (a comparison): an
    inter-cluster and an intra-cluster line per job."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5) if len(series) <= 2 else (11, 5))
    single = len(series) == 1
    for label, rounds in series.items():
        xs = [r.round for r in rounds]
        clusters = sorted({c for r in rounds for c in r.by_cluster}) if single else []
        for cluster in clusters:
            ys = _cumulative_mb(r.by_cluster.get(cluster, {}).get("bytes_inter", 0)
                                for r in rounds)
            ax.plot(xs, ys, marker="o", ms=3, label=f"{cluster}: inter-cluster sent")
        if not clusters:
            line, = ax.plot(xs, _cumulative_mb(r.bytes_inter for r in rounds), marker="o",
                            ms=3, label=f"{label} inter-cluster")
            color = line.get_color()
        else:
            color = "gray"
        ax.plot(xs, _cumulative_mb(r.bytes_intra for r in rounds), ls="--", color=color,
                label=f"{label} intra-cluster" + (" (all clusters)" if clusters else ""))
    _save_plot(plt, fig, ax, path, title="Traffic by round", ylabel="cumulative traffic (MB)",
               crowded=len(series) > 2)


def _cumulative_mb(values: Iterable[int]) -> list[float]:
    total, out = 0, []
    for v in values:
        total += int(v)
        out.append(total / 1e6)
    return out
