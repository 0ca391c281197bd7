"""What does a decentralized job cost next to a star on the same cell? k_connected's
seconds over star's, with the engine's shared work and one BLAS thread (today's), with
one BLAS thread only, and with neither (the baseline), all measured in the same run.

Each variant runs in its own process, on one cell of bench_learning (real executors and
engine, loopback transport between in-process clusters): star + fedavg, then k_connected
+ fedavg and + fedavgm. The baseline variant undoes the two changes (`unshared` the first):
- `ClusterEngine.share_work = False`: every node computes its own pooled mean and
  evaluates its own model, although on a few clusters k_connected's nodes all average
  the same models (`worker.aggregators.base.SharedMeans`);
- BLAS keeps a thread per core (`worker.executor.runtime.single_threaded_numerics` then
  sets only torch's), so the engine's node threads contend for OpenBLAS's pool.

    python bench/bench_mixing.py                  # table BNMLP, beta 0.1, 50 clients, 5 rounds
    python bench/bench_mixing.py --dataset digits --model usercnn:BNCNN --clients 100

Prints one JSON object: per variant the seconds, final accuracy and inter-cluster bytes
of each job, `k_connected_over_star_<variant>` (seconds), and `speedup` (the baseline's
k_connected seconds over today's, per aggregator) and `speedup_of_sharing` (the unshared
variant's over today's). Accuracies of the two variants agree
to rounding (the shared mean sums in another order).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_learning as bl  # noqa: E402

JOBS = (("star", "fedavg"), ("k_connected", "fedavg"), ("k_connected", "fedavgm"))
#: shared: today's; unshared: one BLAS thread, every node its own work; baseline: neither
VARIANTS = ("shared", "unshared", "baseline")


def run_variant(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    """The jobs of one variant, in this process."""
    from worker.executor import engine, runtime

    if variant in ("unshared", "baseline"):
        engine.ClusterEngine.share_work = False
    if variant == "baseline":
        import torch

        runtime.single_threaded_numerics = lambda: torch.set_num_threads(1)
    ds = replace(bl.DATASETS[args.dataset], model=args.model, beta=args.beta,
                 clients=args.clients, rounds=args.rounds, clusters=args.clusters)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-mixing-") as out:
        dataset = bl.dataset_name(args.dataset, Path(out))
        for topology, aggregation in JOBS:
            job = bl.job_dict(ds, dataset, topology, aggregation, seed=args.seed)
            r = bl.run_engine(job, args.clusters)
            results[f"{topology}+{aggregation}"] = {
                "seconds": r["seconds"], "final": r["final"], "bytes_inter": r["bytes_inter"]}
            print(f"{variant}: {topology}+{aggregation} {r['seconds']} s, final {r['final']}",
                  file=sys.stderr, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="table", choices=sorted(bl.DATASETS))
    parser.add_argument("--model", default="usercnn:BNMLP")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clusters", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args, args.variant)))
        return
    variants = {}
    for variant in VARIANTS:
        # a fresh process each: BLAS's thread pool is sized once per process
        env = {k: v for k, v in os.environ.items()
               if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
        child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", variant],
                               env=env, stdout=subprocess.PIPE, text=True, check=True)
        variants[variant] = json.loads(child.stdout.strip().splitlines()[-1])
    report: dict[str, Any] = {
        "benchmark": "mixing", "cpus": os.cpu_count(),
        "cell": {"dataset": args.dataset, "model": args.model, "beta": args.beta,
                 "clients": args.clients, "rounds": args.rounds, "clusters": args.clusters,
                 "seed": args.seed},
        "variants": variants}
    for variant, jobs in variants.items():
        star = jobs["star+fedavg"]["seconds"]
        report[f"k_connected_over_star_{variant}"] = {
            name: round(j["seconds"] / star, 2) for name, j in jobs.items()
            if name.startswith("k_connected")}
    report["speedup"] = {
        name: round(variants["baseline"][name]["seconds"] / variants["shared"][name]["seconds"], 2)
        for name in variants["shared"] if name.startswith("k_connected")}
    report["speedup_of_sharing"] = {
        name: round(variants["unshared"][name]["seconds"] / variants["shared"][name]["seconds"], 2)
        for name in variants["shared"] if name.startswith("k_connected")}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
