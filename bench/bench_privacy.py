"""What privacy costs: bench_learning's MNIST job on a star with and without secure
aggregation (accuracy, seconds), and central DP's accuracy-epsilon curve.

    python bench/bench_privacy.py secagg                    # 40 clients, 4 clusters
    python bench/bench_privacy.py dp --clients 100 --epsilons 1,4,8,none
    python bench/bench_privacy.py dp --clients 100 --model mlp   # a second model
    python bench/bench_privacy.py dp --clients 100 --clip-quantiles none,0.5 --no-secagg
                                                            # fixed against adaptive clip
    python bench/bench_privacy.py dp --clients 100 --epochs 5  # more local work a round
    python bench/bench_privacy.py secagg --quick            # digits, 3 rounds
    python bench/bench_privacy.py why --clients 100         # DP's signal against its noise

`why`: plain FedAvg without the engine (bench_learning's reference loop); each round, the
clients' update norms (quantiles), the norm of the mean of the updates clipped to
--clip-norm (DP's signal) and the norm of the noise central DP adds to it at each epsilon
(z * clip_norm * sqrt(parameters) / clients, z from the accountant for the job's rounds).

Prints one JSON object per job, then a summary. Same partition and seed in every job;
secure aggregation changes the sum only by its fixed-point rounding, DP by its noise.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
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


def why(job: dict[str, Any], clip_norm: float, epsilons: list[float], delta: float
        ) -> dict[str, Any]:
    """DP-FedAvg's signal and noise along the plain FedAvg trajectory of `job`."""
    import numpy as np

    from worker.nodes.federated import client_seed
    from worker.privacy import dp, flatten, unflatten
    from worker.serialization import load_weights, model_weights
    from worker.training import evaluate, round_training, train_local

    spec, data, parts, net = bl._setup(job)
    like = model_weights(net)
    rounds, m = spec.training.federated_learning_rounds, len(parts.train_indices)
    z = {e: dp.noise_for(e, delta, spec.training.client_fraction, rounds) for e in epsilons}
    current = flatten(like)
    rows = []
    for r in range(1, rounds + 1):
        deltas = []
        for client, idx in enumerate(parts.train_indices):
            load_weights(net, unflatten(current, like))
            train_local(net, data.x_train[idx], data.y_train[idx],
                        round_training(spec.training, r), seed=client_seed(spec.seed, client, r))
            deltas.append(flatten(model_weights(net)) - current)
        norms = np.linalg.norm(deltas, axis=1)
        sizes = np.array([len(i) for i in parts.train_indices], dtype=np.float64)
        clipped = np.mean([dp.clip(d, clip_norm)[0] for d in deltas], axis=0)
        current = current + sizes @ np.array(deltas) / sizes.sum()
        load_weights(net, unflatten(current, like))
        rows.append({"round": r, "accuracy": round(evaluate(net, data.x_test, data.y_test).accuracy, 4),
                     "update_norm_p10_p50_p90": [round(float(q), 3)
                                                 for q in np.percentile(norms, [10, 50, 90])],
                     "clipped_mean_norm": round(float(np.linalg.norm(clipped)), 4),
                     "noise_norm": {str(e): round(z[e] * clip_norm * math.sqrt(current.size) / m, 3)
                                    for e in epsilons}})
        print(json.dumps(rows[-1]), flush=True)
    return {"parameters": int(current.size), "clients": m, "clip_norm": clip_norm,
            "noise_multiplier": {str(e): round(v, 3) for e, v in z.items()}, "rounds": rows}


def cpu_seconds() -> float:
    """CPU time of this process (in-process clusters) and its children: on a shared
    machine the wall time of a job measures its neighbours' load as much as its own."""
    own, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                      resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("secagg", "dp", "why"))
    ap.add_argument("--clients", type=int, default=0, help="default: bench_learning's")
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=0, help="local epochs (default: its)")
    ap.add_argument("--aggregation", default="fedavgm")
    ap.add_argument("--server-step", default="", help="plain | scaled (default: the job's)")
    ap.add_argument("--epsilons", default="1,4,8,none")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--clip-norm", type=float, default=0.5, help="fixed, or the first")
    ap.add_argument("--clip-quantiles", default="none",
                    help="none (fixed clip_norm) and/or privacy.clip_quantile values")
    ap.add_argument("--no-secagg", action="store_true",
                    help="DP without secure aggregation (clip_quantile needs it off)")
    ap.add_argument("--dataset", choices=("mnist", "digits"), default="mnist")
    ap.add_argument("--model", default="", help="default: bench_learning's for the dataset")
    ap.add_argument("--beta", type=float, default=0.0, help="Dirichlet beta (default: its)")
    ap.add_argument("--quick", action="store_true", help="digits, 3 rounds")
    ap.add_argument("--out", default="runs/bench-privacy")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "digits" if args.quick else args.dataset
    ds = bl.DATASETS[name]
    ds = replace(ds, clients=args.clients or ds.clients, model=args.model or ds.model,
                 beta=args.beta or ds.beta, rounds=3 if args.quick else (args.rounds or ds.rounds),
                 epochs=args.epochs or ds.epochs)
    dataset = bl.mnist_npz(out) if name == "mnist" else name
    if args.what == "why":
        eps = [float(e) for e in args.epsilons.split(",") if e != "none"]
        print(json.dumps(why(job(ds, dataset, "fedavg", {}, "why"), args.clip_norm, eps,
                             args.delta), indent=1))
        return 0
    jobs: dict[str, dict[str, Any]] = {}
    if args.what == "secagg":
        jobs = {"plain": {}, "secure_aggregation": {"secure_aggregation": True}}
    else:
        for e in args.epsilons.split(","):
            for c in (["none"] if e == "none" else args.clip_quantiles.split(",")):
                adaptive = {} if c == "none" else {"clip_quantile": float(c)}
                jobs[f"epsilon={e}" + (f",quantile={c}" if adaptive else "")] = (
                    {} if e == "none" else
                    {"dp": "central", "epsilon": float(e), "delta": args.delta,
                     "clip_norm": args.clip_norm, **adaptive,
                     "secure_aggregation": not (adaptive or args.no_secagg)})
    results: dict[str, Any] = {}
    for name, privacy in jobs.items():
        used = cpu_seconds()
        res = bl.run_engine(job(ds, dataset, args.aggregation, privacy, name.replace("=", "-").replace(",", "-"),
                                 args.server_step),
                            ds.clusters)
        res["cpu_seconds"] = round(cpu_seconds() - used, 1)
        res["seconds_per_round"] = round(res["seconds"] / ds.rounds, 2)
        results[name] = res
        print(json.dumps({name: res}), flush=True)
    summary = {n: {"final": r["final"], "best": max(r["curve"]), "seconds": r["seconds"],
                   "cpu_seconds": r["cpu_seconds"]} for n, r in results.items()}
    print(json.dumps({"dataset": ds.name, "model": ds.model, "beta": ds.beta,
                      "clients": ds.clients, "clusters": ds.clusters,
                      "rounds": ds.rounds, "epochs": ds.epochs, "aggregation": args.aggregation,
                      "server_step": args.server_step or "default",
                      "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
