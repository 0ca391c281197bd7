"""What privacy costs: bench_learning's MNIST job on a star with and without secure
aggregation (accuracy, seconds), and central DP's accuracy-epsilon curve.

    python bench/bench_privacy.py secagg                    # 40 clients, 4 clusters
    python bench/bench_privacy.py dp --clients 100 --epsilons 1,4,8,none
    python bench/bench_privacy.py secagg --quick            # digits, 3 rounds

Prints one JSON object per job, then a summary. Same partition and seed in every job;
secure aggregation changes the sum only by its fixed-point rounding, DP by its noise.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_learning as bl  # noqa: E402  (bench/ is not a package)


def job(ds: bl.Dataset, dataset: str, aggregation: str, privacy: dict[str, Any],
        name: str, server_step: str = "") -> dict[str, Any]:
    out = bl.job_dict(ds, dataset, "star", aggregation, label=name)
    out["privacy"] = privacy
    if server_step:
        out["aggregation"]["server_step"] = server_step
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("secagg", "dp"))
    ap.add_argument("--clients", type=int, default=0, help="default: bench_learning's")
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--aggregation", default="fedavgm")
    ap.add_argument("--server-step", default="", help="plain | scaled (default: the job's)")
    ap.add_argument("--epsilons", default="1,4,8,none")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--clip-norm", type=float, default=0.5)
    ap.add_argument("--quick", action="store_true", help="digits, 3 rounds")
    ap.add_argument("--out", default="runs/bench-privacy")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ds = bl.DATASETS["digits" if args.quick else "mnist"]
    ds = replace(ds, clients=args.clients or ds.clients,
                 rounds=3 if args.quick else (args.rounds or ds.rounds))
    dataset = "digits" if args.quick else bl.mnist_npz(out)
    jobs: dict[str, dict[str, Any]] = {}
    if args.what == "secagg":
        jobs = {"plain": {}, "secure_aggregation": {"secure_aggregation": True}}
    else:
        for e in args.epsilons.split(","):
            jobs[f"epsilon={e}"] = ({} if e == "none" else
                                    {"dp": "central", "epsilon": float(e), "delta": args.delta,
                                     "clip_norm": args.clip_norm, "secure_aggregation": True})
    results: dict[str, Any] = {}
    for name, privacy in jobs.items():
        res = bl.run_engine(job(ds, dataset, args.aggregation, privacy, name.replace("=", "-"),
                                 args.server_step),
                            ds.clusters)
        res["seconds_per_round"] = round(res["seconds"] / ds.rounds, 2)
        results[name] = res
        print(json.dumps({name: res}), flush=True)
    summary = {n: {"final": r["final"], "best": max(r["curve"]), "seconds": r["seconds"]}
               for n, r in results.items()}
    print(json.dumps({"dataset": ds.name, "clients": ds.clients, "clusters": ds.clusters,
                      "rounds": ds.rounds, "aggregation": args.aggregation,
                      "server_step": args.server_step or "default",
                      "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
