"""A job's client split: drawn once per job, against once per caller (the baseline).

A job asks for the same partition in every cluster's runtime (4 at once on the bench's
4 clusters), in placement and in bench_learning's scoring. Baseline, measured in the same
run: each of those requests draws the split (`fedcore.data.partition._draw`, what every
call did before the cache); now: the same requests through `partition` (its cache, the
runtimes' 4 from threads at once). Prints JSON: per case the seconds of both and their
ratio. Cases: digits with bench_learning's Dirichlet splits (beta 0.1 at 50 and 100
clients, where resampling costs most; beta 1.0 at 50, where it costs least).

    PYTHONPATH=. python bench/bench_partition.py
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import fedcore.data.partition as partition_module
from fedcore.data import load_dataset
from fedcore.data.partition import partition
from proto.job import DataSpec

#: a job's requests: 4 runtimes at once, then placement and the scoring one after another
RUNTIMES, AFTER = 4, 2


def one_job(draw: bool, y: object, clients: int, spec: DataSpec, seed: int) -> float:
    """Seconds for one job's partition requests, each drawn (`draw`) or through the cache."""
    partition_module._cache.clear()

    def ask(_: int) -> object:
        if draw:
            return partition_module._draw(y, clients, spec, spec.data_distribution_kind, seed)  # type: ignore[arg-type]
        return partition(y, clients, spec, seed)  # type: ignore[arg-type]

    started = time.perf_counter()
    with ThreadPoolExecutor(RUNTIMES) as pool:
        list(pool.map(ask, range(RUNTIMES)))
    for i in range(AFTER):
        ask(i)
    return time.perf_counter() - started


def main() -> int:
    y = load_dataset("digits").y_train.astype("int64")
    cases = []
    for clients, beta in ((50, 0.1), (100, 0.1), (50, 1.0)):
        spec = replace(DataSpec(), data_distribution_kind="dirichlet", dirichlet_beta=beta,
                       number_of_clients=clients)
        seed = 0
        base = min(one_job(True, y, clients, spec, seed) for _ in range(2))
        now = min(one_job(False, y, clients, spec, seed) for _ in range(2))
        cases.append({"dataset": "digits", "clients": clients, "beta": beta,
                      "requests": RUNTIMES + AFTER, "baseline_seconds": round(base, 3),
                      "seconds": round(now, 3), "ratio": round(now / base, 3)})
    print(json.dumps({"benchmark": "partition", "cases": cases}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
