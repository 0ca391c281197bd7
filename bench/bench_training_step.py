"""What a model's Dropout layers cost a client's training, against the same model without.

A model with Dropout trains its forward passes one thread at a time, torch's global
generator seeded per mini-batch (`worker.training._masks_seeded`), so that its masks do not
depend on the thread schedule. This bench times `train_local` on clients of sklearn's
digits (96 small clients, as a grid's 100-client cell: a few steps of a few samples each,
several clients' threads at once, as the engine runs them), three ways, alternating in the
same run:

- `plain`: an MLP without Dropout (no seeding, no lock: the baseline);
- `dropout`: the same MLP with Dropout, as the engine trains it today;
- `dropout_all_devices`: the same, with the mask seed set by `torch.manual_seed` (every
  accelerator backend it can import, as before stop 64) in place of the CPU generator's.

Both Dropout ways must draw the same masks (the same trained weights, checked here). Prints
one JSON object: seconds per client round of each way, `dropout_over_plain` (goal <= 1.5)
and `all_devices_over_cpu` (the step this bench was made for).

    python bench/bench_training_step.py            # 96 clients x 4 threads, 3 repeats
    python bench/bench_training_step.py --quick    # a smoke run

Measured on a 2-core box shared with a grid run (stop 64), seconds per client round
plain / dropout / dropout_all_devices: 96 clients 0.0256 / 0.0280 / 0.0460 (dropout over
plain 1.09, all devices over cpu 1.65); 24 clients of 75 samples 0.0312 / 0.0366 / 0.0382
(1.17, 1.04: the seeding matters on small clients, where a step is a few samples).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Any
from unittest import mock

import numpy as np
import torch
from torch import nn

from proto.job import TrainingSpec
from worker import training as training_module
from worker.models.registry import GLOBAL_RNG
from worker.serialization import load_weights, model_weights
from worker.training import train_local


def mlp(features: int, classes: int, dropout: bool) -> nn.Module:
    """64 -> 128 -> 64 -> classes, ReLU, Dropout(0.3) after each hidden layer or not."""
    drop = (lambda: nn.Dropout(0.3)) if dropout else nn.Identity
    return nn.Sequential(nn.Linear(features, 128), nn.ReLU(), drop(), nn.Linear(128, 64),
                         nn.ReLU(), drop(), nn.Linear(64, classes))


@contextmanager
def all_devices_seeded(seed: int, step: int, _device: torch.device) -> Iterator[None]:
    """`_masks_seeded` as it was: `torch.manual_seed` seeds every backend it can import."""
    with GLOBAL_RNG, torch.random.fork_rng(devices=[]):
        torch.manual_seed((int(seed) * 1_000_003 + step) % 2**63)
        yield


def clients(n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(y))
    return [(x[part], y[part].astype(np.int64)) for part in np.array_split(order, n)]


def one_way(dropout: bool, patched: bool, data: list[tuple[np.ndarray, np.ndarray]],
            spec: TrainingSpec, threads: int) -> tuple[float, list[dict[str, np.ndarray]]]:
    """Seconds per client round, and every client's trained weights."""
    torch.manual_seed(0)
    start = model_weights(mlp(64, 10, dropout))
    models = [mlp(64, 10, dropout) for _ in data]

    def run(i: int) -> dict[str, np.ndarray]:
        load_weights(models[i], start)
        x, y = data[i]
        train_local(models[i], x, y, spec, seed=1000 + i)
        return model_weights(models[i])

    patch = (mock.patch.object(training_module, "_masks_seeded", all_devices_seeded)
             if patched else nullcontext())
    with patch, ThreadPoolExecutor(threads) as pool:
        begin = time.perf_counter()
        trained = list(pool.map(run, range(len(data))))
        seconds = time.perf_counter() - begin
    return seconds / len(data), trained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=96)
    parser.add_argument("--threads", type=int, default=4, help="clients trained at once")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="6 clients, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.clients, args.repeats = 6, 1
    torch.set_num_threads(1)
    spec = TrainingSpec(number_of_epochs=args.epochs, batch_size=16, learning_rate=0.05)
    data = clients(args.clients, seed=0)
    ways = {"plain": (False, False), "dropout": (True, False),
            "dropout_all_devices": (True, True)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    weights: dict[str, list[dict[str, np.ndarray]]] = {}
    for repeat in range(args.repeats):
        order = list(ways) if repeat % 2 == 0 else list(reversed(ways))
        for name in order:
            seconds, trained = one_way(*ways[name], data, spec, args.threads)
            times[name].append(seconds)
            weights.setdefault(name, trained)
    same = all(np.array_equal(a[k], b[k]) for a, b in zip(weights["dropout"],
                                                           weights["dropout_all_devices"],
                                                           strict=True) for k in a)
    median = {name: statistics.median(values) for name, values in times.items()}
    result: dict[str, Any] = {
        "benchmark": "training_step",
        "clients": args.clients, "threads": args.threads, "epochs": args.epochs,
        "repeats": args.repeats,
        "seconds_per_client_round": {k: round(v, 5) for k, v in median.items()},
        "dropout_over_plain": round(median["dropout"] / median["plain"], 3),
        "all_devices_over_cpu": round(median["dropout_all_devices"] / median["dropout"], 3),
        "goal_dropout_over_plain": 1.5,
        "same_masks": same,
    }
    print(json.dumps(result))
    if not same:
        raise SystemExit("bench_training_step: the two Dropout ways trained different weights")


if __name__ == "__main__":
    main()
