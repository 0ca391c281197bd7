"""Scale with participation: a 100,000-client job where each round trains 1% of them.

The job: 3 clusters (real fabricd daemons on 127.0.0.1, `LocalTestbed`), hybrid (or
`--topology star`) + fedavg,
an mlp on digits, `client_fraction = 0.01`, 3 rounds, round-robin placement. Digits has
1,797 samples, so the bench writes a larger digits set first (every sample repeated with
small pixel noise; `--samples-per-client`, default 2) as an npz the executors load.

Reported, per backend (`inprocess`: executors train on threads; `ray`: each cluster's
executor runs an embedded Ray): wall seconds of each round; the baseline = the same
round's sampled clients trained one after another in this process (the training alone,
no engine, no transport, measured in the same run) and the ratio wall / baseline (goal
<= 1.5); seconds to plan and start; peak RSS (VmHWM) of the scheduler (this process), of
every daemon and of every executor process (Ray's own worker processes are listed
separately).

    python bench/bench_scale.py                       # 100,000 clients, both backends
    python bench/bench_scale.py --backend inprocess
    python bench/bench_scale.py --quick               # 3,000 clients, in-process only

Measured on the 2-core box while other agents kept its load average near 20 (so every
figure is noisy; the ratio is taken within one run): 100,000 clients, 1,000 per round,
hybrid, 3 clusters of real daemons.
- inprocess (5 local epochs): rounds 4.0 / 4.2 / 3.0 s against 5.7 / 3.7 / 3.4 s of
  training alone, ratio after round 1 = 1.01 (goal 1.5: met; with 2 epochs it was 1.35);
  peak RSS scheduler 0.70 GB, each executor 0.57 GB, each daemon 0.15 GB; final accuracy
  0.158 after 3 rounds. Before the per-key mailbox and set-based client lookups a round of
  this job took 25-32 s.
- ray (5 local epochs), before batching: rounds 70 (actors start) / 5.3 / 7.6 s against
  7.0 / 1.9 / 2.1 s, ratio after round 1 = 3.2: a client trains for ~2 ms, and each Ray
  actor call, object put and get costs more than that.
- ray, 4 rounds, load average ~12 (other agents' tests): with `clients_per_call = 0`
  (auto: light clients batched per actor call, as many actors as CPUs, started and warmed
  together at job.plan) rounds 2.60 / 2.37 / 2.35 / 2.18 s against 2.77 / 1.70 / 1.64 /
  1.61 s, ratio after round 1 = 1.40 (goal 1.5), round 1 = 1.13 x a later one (goal 2),
  27 s from job start to round 1; the same run with `--clients-per-call 1` (one call per
  client): rounds 52 / 4.8 / 4.4 / 4.0 s, ratio 2.65, round 1 = 11.8 x. Final accuracy
  0.5746 both ways (batching trains the same models). Peak RSS: scheduler 0.77 GB,
  executors 0.75 GB, Ray workers 0.49 GB each (2 per cluster instead of 8).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from proto.job import JobSpec
from scheduler.run.driver import Driver
from scheduler.run.mesh import BridgeChannel
from scheduler.testbed import LocalTestbed, job_allowances

GOAL_RATIO = 1.5
GOAL_FIRST_ROUND = 2.0   # round 1 (actors already started) against a later round
GOAL_SCHEDULER_RSS = 2 * 1024**3


def write_dataset(path: Path, clients: int, per_client: int, seed: int = 0) -> str:
    """Digits, each sample repeated with pixel noise, enough for `per_client` each."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = digits.data.astype(np.float32) / 16.0
    y = digits.target.astype(np.int64)
    need = clients * per_client
    reps = -(-need // len(x)) + 1
    rng = np.random.default_rng(seed)
    big_x = np.concatenate([x + rng.normal(0, 0.05, x.shape).astype(np.float32)
                            for _ in range(reps)])
    big_y = np.tile(y, reps)
    order = rng.permutation(len(big_x))
    big_x, big_y = big_x[order], big_y[order]
    test = len(x) // 4
    np.savez(path, x_train=big_x[test:], y_train=big_y[test:], x_test=x[:test],
             y_test=y[:test])
    return f"npz:{path}"


def job(dataset: str, clients: int, fraction: float, rounds: int, topology: str,
        clients_per_call: int = 0) -> JobSpec:
    return JobSpec.from_dict({
        "job": {"id": f"scale-{clients}", "seed": 0},
        "data": {"dataset": dataset, "number_of_clients": clients,
                 "data_distribution_kind": "iid"},
        "model": {"name": "mlp", "hidden": 32},
        "training": {"federated_learning_rounds": rounds, "number_of_epochs": 5, "learning_rate": 0.1,
                     "client_fraction": fraction, "batch_size": 16},
        "topology": {"kind": topology},
        "placement": {"strategy": "round_robin", "max_materialized": 8,
                      "clients_per_call": clients_per_call},
    })


def baseline_seconds(spec: JobSpec) -> list[float]:
    """Per round, its sampled clients trained one after another in this process (data
    loaded and the model built before the clock starts)."""
    import torch

    from fedcore.data import client_data, load_dataset
    from worker.executor.graph import participants
    from worker.models import build_model
    from worker.nodes.federated import client_seed
    from worker.training import train_local

    torch.set_num_threads(1)
    dataset = load_dataset(spec.data.dataset)
    partition = client_data(dataset, spec.data, spec.seed)
    model = build_model(spec.model, dataset.input_shape, dataset.num_classes, seed=spec.seed)
    out = []
    for r in range(1, spec.training.federated_learning_rounds + 1):
        chosen = participants(spec.data.number_of_clients, spec.training.client_fraction,
                              spec.seed, r)
        started = time.perf_counter()
        for c in chosen:
            idx = partition.train_indices[c]
            train_local(model, dataset.x_train[idx], dataset.y_train[idx], spec.training,
                        seed=client_seed(spec.seed, c, r))
        out.append(time.perf_counter() - started)
    return out


def peak_rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc; no extra dependency)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class RssWatch:
    """Peak RSS per process of the testbed, sampled at every round (processes that exit
    early are read while they live)."""

    def __init__(self, testbed: LocalTestbed) -> None:
        self.testbed = testbed
        self.peaks: dict[str, int] = {}

    def sample(self) -> None:
        for name, proc in self.testbed.procs.items():
            self._keep(f"daemon:{name}", peak_rss(proc.pid))
            for child in descendants(proc.pid):
                cmd = command(child)
                role = ("executor" if "worker.executor" in cmd
                        else "ray-worker" if "default_worker" in cmd or "ray::" in cmd
                        else "ray-system")
                self._keep(f"{role}:{name}:{child}", peak_rss(child))

    def _keep(self, key: str, value: int) -> None:
        self.peaks[key] = max(self.peaks.get(key, 0), value)

    def by_role(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for key, value in self.peaks.items():
            role = key.split(":")[0]
            out[f"{role}_max"] = max(out.get(f"{role}_max", 0), value)
        return out


def run(backend: str, spec: JobSpec, clusters: int) -> dict[str, Any]:
    address = "local" if backend == "ray" else "inprocess"
    started = time.perf_counter()
    capacity = -(-spec.data.number_of_clients // clusters) + 1
    with LocalTestbed(clusters, backend=address, capacity=capacity,
                      allow=job_allowances(spec)) as testbed:
        infos = testbed.start(timeout=120)
        watch = RssWatch(testbed)
        walls: list[float] = []

        first_done: list[float] = []

        def progress(record: Any, total: int) -> None:
            walls.append(record.seconds)
            first_done.append(time.perf_counter())
            watch.sample()

        channel = BridgeChannel(testbed.bridge_socket("scheduler"), job_id=spec.job_id)
        driver = Driver(spec, infos, channel, backend=backend, progress=progress, timeout=1800)
        run_started = time.perf_counter()
        try:
            result = driver.run()
        finally:
            driver.close()
            channel.close()
        watch.sample()
    baselines = baseline_seconds(spec)
    ratios = [w / b for w, b in zip(walls, baselines, strict=True)]
    return {
        "backend": backend,
        "round_seconds": [round(w, 3) for w in walls],
        "sampled_training_seconds": [round(b, 3) for b in baselines],
        "ratio_per_round": [round(r, 3) for r in ratios],
        "ratio_after_round_1": round(sum(ratios[1:]) / max(1, len(ratios) - 1), 3),
        # start-up (placement, job.start, job.plan: actors started together) before round 1
        "seconds_to_round_1": round(first_done[0] - run_started - walls[0], 2),
        "first_round_over_later": round(walls[0] / (sum(walls[1:]) / max(1, len(walls) - 1)),
                                        3),
        "clients_per_call": spec.placement.clients_per_call,
        "participants": [r.participants for r in result.summary.rounds],
        "final_accuracy": round(result.summary.final_accuracy, 4),
        "total_seconds": round(time.perf_counter() - started, 1),
        "peak_rss_bytes": {"scheduler": peak_rss(os.getpid()), **watch.by_role()},
        "peak_rss_by_process": watch.peaks,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=100_000)
    parser.add_argument("--fraction", type=float, default=0.01)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clusters", type=int, default=3)
    parser.add_argument("--topology", choices=("hybrid", "star"), default="hybrid",
                        help="hybrid (default): clients aggregate in their cluster, clusters "
                             "exchange every round; star: every update goes to one server")
    parser.add_argument("--samples-per-client", type=int, default=4)
    parser.add_argument("--backend", choices=("inprocess", "ray", "both"), default="both")
    parser.add_argument("--clients-per-call", type=int, default=0,
                        help="[placement] clients_per_call: 0 = auto batching (default), "
                             "1 = one actor call per client (the unbatched baseline)")
    parser.add_argument("--quick", action="store_true", help="3,000 clients, in-process only")
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.backend, args.fraction = 3000, "inprocess", 0.02
    backends = ("inprocess", "ray") if args.backend == "both" else (args.backend,)
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        dataset = write_dataset(Path(tmp) / "digits-big.npz", args.clients,
                                args.samples_per_client)
        spec = job(dataset, args.clients, args.fraction, args.rounds, args.topology,
                   args.clients_per_call)
        results = [run(b, spec, args.clusters) for b in backends]
    out = {
        "bench": "scale", "clients": args.clients, "client_fraction": args.fraction,
        "rounds": args.rounds, "clusters": args.clusters, "topology": args.topology,
        "goal_ratio": GOAL_RATIO, "goal_first_round_over_later": GOAL_FIRST_ROUND,
        "goal_scheduler_rss_bytes": GOAL_SCHEDULER_RSS, "results": results,
        "meets_goals": all(r["ratio_after_round_1"] <= GOAL_RATIO
                           and r["first_round_over_later"] <= GOAL_FIRST_ROUND
                           and r["peak_rss_bytes"]["scheduler"] <= GOAL_SCHEDULER_RSS
                           for r in results),
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
