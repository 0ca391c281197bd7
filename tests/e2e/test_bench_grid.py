"""bench_learning's grid verdicts from cells (no training: the cells are written here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_learning as bench  # noqa: E402


def _refused(what: str, call: Any, *args: Any) -> str:
    """The message `call(*args)` exits with; `what` (the input that should have been
    refused) fails the test where it returns instead."""
    try:
        call(*args)
    except SystemExit as exc:
        return str(exc)
    raise AssertionError(what)


def _cell(seed: int, reference: float, **finals: float) -> dict[str, Any]:
    return {"dataset": "digits", "model": "m", "beta": 0.1, "clients": 20, "seed": seed,
            "centralized_best": 0.98, "reference_fedavg": reference,
            "jobs": {job.replace("_", "+"): {"final": f} for job, f in finals.items()}}


def _recorder(seen: list[Any], pick: Any) -> Any:
    """A stand-in for bench._run_tasks: each task's `pick(name, job)` into `seen`, and the
    same passing result for every task."""
    def fake_tasks(tasks: list[tuple[str, str, dict[str, Any]]], clusters: int, workers: int,
                   tag: str) -> dict[str, dict[str, Any]]:
        seen.extend(pick(name, job) for _kind, name, job in tasks)
        return {name: {"final": 0.9, "best": 0.95, "curve": [0.5, 0.9], "test_samples": 100,
                       "personalized": 0.95, "global_on_clients": 0.9, "bytes_inter": 100,
                       "bytes_intra": 0, "seconds": 1.0} for _kind, name, _job in tasks}
    return fake_tasks


def test_seed_means_judge_each_split_over_its_seeds() -> None:
    cells = [_cell(0, 0.54, star_fedavg=0.54, star_fedadagrad=0.89, hybrid_fedadam=0.59),
             _cell(1, 0.84, star_fedavg=0.84, star_fedadagrad=0.63, hybrid_fedadam=0.80),
             _cell(2, 0.85, star_fedavg=0.85, star_fedadagrad=0.95, hybrid_fedadam=0.80)]
    (group,) = bench.seed_means(cells)
    assert group["seeds"] == [0, 1, 2] and abs(group["reference_fedavg"] - 0.7433) < 1e-4
    jobs = group["jobs"]
    # seed 1 alone is 0.21 below the reference; over the seeds 0.8233 against 0.7433
    assert abs(jobs["star+fedadagrad"]["final"] - 0.8233) < 1e-4
    assert jobs["star+fedadagrad"]["meets_reference"] and jobs["star+fedadagrad"]["adaptive_meets_fedavg"]
    # hybrid has no fedavg job of its own: compared with star's (0.7433), 0.73 is below
    assert not jobs["hybrid+fedadam"]["meets_reference"]
    assert not jobs["hybrid+fedadam"]["adaptive_meets_fedavg"]
    assert "adaptive_meets_fedavg" not in jobs["star+fedavg"]


def test_a_grid_slice_takes_any_split_the_user_names() -> None:
    """--clients 40 ran nothing before (it only filtered the slice's 20 / 50 / 100)."""
    cells = bench.grid_cells("full", ["table"], ["mlp"], betas=[0.5], clients=[40], seeds=[3],
                             rounds=6)
    assert cells == [("table", "mlp", 0.5, 40, 3, 6)]
    slice_ = bench.grid_cells("medium", ["table"], None)
    assert {c[3] for c in slice_} == {20, 50} and {c[2] for c in slice_} == {0.1, 0.3, 1.0}
    assert {c[1] for c in slice_} == set(bench.GRID_MODELS["table"]) and {c[5] for c in slice_} == {15}


def test_shards_split_the_grid_and_together_are_it() -> None:
    cells = bench.grid_cells("full", None, None)
    shards = [bench.shard(cells, f"{k}/5") for k in range(1, 6)]
    assert sorted(c for s in shards for c in s) == sorted(cells)
    assert all(len(s) in (len(cells) // 5, len(cells) // 5 + 1) for s in shards)
    assert {c[0] for c in shards[0]} == {"mnist", "digits", "table", "wine"}   # a mix, not a block
    for bad in ("0/5", "6/5", "2", "a/b"):
        said = _refused(f"--shard {bad} accepted", bench.shard, cells, bad)
        assert bad in said


def _measured(seed: int, reference: float, **finals: float) -> dict[str, Any]:
    """A cell as bench_cell writes it (rows with the grid table's fields)."""
    cell = _cell(seed, reference, **finals)
    every = {job: row["final"] for job, row in cell["jobs"].items()}
    for job, row in cell["jobs"].items():
        row.update(minus_reference=round(row["final"] - reference, 4),
                   over_centralized=round(row["final"] / 0.98, 4), bytes_over_star=1.0,
                   at_chance_after_round_3=False, **bench.judge(job, row["final"], reference,
                                                                0.98, every))
    return cell


def _written(path: Path, *cells: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "learning_grid.json").write_text(json.dumps({"cells": list(cells)}))
    return path


def test_merge_joins_runs_into_one_table_without_training(tmp_path: Path, capsys: Any) -> None:
    a = _written(tmp_path / "a", _measured(0, 0.54, star_fedavg=0.54, star_fedadam=0.60))
    b = _written(tmp_path / "b", _measured(1, 0.84, star_fedavg=0.84, star_fedadam=0.70),
                 _measured(0, 0.10, star_fedavg=0.10))            # seed 0 again: first copy kept
    assert bench.main(["--merge", str(a), str(b / "learning_grid.json"),
                       "--out", str(tmp_path / "m")]) == 0
    report = json.loads((tmp_path / "m" / "learning_grid.json").read_text())
    assert [c["seed"] for c in report["cells"]] == [0, 1]
    assert report["cells"][0]["reference_fedavg"] == 0.54
    (group,) = report["seed_means"]
    assert group["seeds"] == [0, 1] and abs(group["jobs"]["star+fedadam"]["final"] - 0.65) < 1e-9
    assert "again, the first copy kept" in capsys.readouterr().err
    said = _refused("a missing run merged", bench.main,
                    ["--merge", str(tmp_path / "nothing"), "--out", str(tmp_path / "m")])
    assert "nothing" in said and "not a learning_grid.json" in said


def test_the_table_gives_each_job_its_mean_gap_over_the_cells() -> None:
    """One cell's last round swings (an adaptive job 0.06 below FedAvg in one, 0.10 above
    in the other); the table's means say what the aggregator does over the cells."""
    cells = [_measured(0, 0.80, star_fedavg=0.80, star_fedadam=0.74, hybrid_fedavg=0.82,
                       hybrid_fedadam=0.85, hierarchical_fedyogi=0.78),
             _measured(1, 0.60, star_fedavg=0.60, star_fedadam=0.70, hybrid_fedavg=0.58,
                       hybrid_fedadam=0.57, hierarchical_fedyogi=0.64)]
    table = bench.grid_table(cells)
    star = table["star+fedadam"]
    assert len(star["adaptive_below_fedavg"]) == 1            # the one cell's verdict stays
    assert star["mean_minus_fedavg"] == 0.02 and star["mean_minus_reference"] == 0.02
    # against FedAvg on its own topology (hybrid: +0.03, -0.01), not star's or the loop's
    assert table["hybrid+fedadam"]["mean_minus_fedavg"] == 0.01
    assert table["hybrid+fedadam"]["mean_minus_reference"] == 0.01
    # a topology without a FedAvg job of its own: star's
    assert table["hierarchical+fedyogi"]["mean_minus_fedavg"] == 0.01
    assert table["hybrid+fedavg"]["mean_minus_reference"] == 0.0
    assert "mean_minus_fedavg" not in table["star+fedavg"]


def test_the_table_says_which_misses_hold_over_the_last_rounds() -> None:
    """A last round that swings below the reference loop is a miss the issue counts; the
    table also lists the misses that hold on the mean of the last 3 rounds (slack and
    0.95 x centralized as for the last round; an adaptive job against FedAvg's curve)."""
    cell = _measured(0, 0.80, star_fedavg=0.78, star_fedadam=0.70, hybrid_fedavg=0.76,
                     hybrid_fedadam=0.72)
    cell["reference_curve"] = [0.5, 0.80, 0.78, 0.80]
    curves = {"star+fedavg": [0.5, 0.80, 0.79, 0.78],      # swung: last 3 0.79 vs 0.7933
              "star+fedadam": [0.5, 0.72, 0.71, 0.70],     # holds: 0.71
              "hybrid+fedavg": [0.5, 0.74, 0.75, 0.76],    # holds: 0.75
              "hybrid+fedadam": [0.5, 0.75, 0.76, 0.72]}   # vs hybrid fedavg: 0.7433 ~ 0.75
    for job, curve in curves.items():
        cell["jobs"][job]["curve"] = curve
    table = bench.grid_table([cell])
    assert len(table["star+fedavg"]["cells_below_reference"]) == 1
    assert table["star+fedavg"]["cells_below_reference_last3"] == []
    assert table["star+fedadam"]["cells_below_reference_last3"] == [
        "digits/m/b0.1/n20/s0 (-0.0833)"]
    assert table["star+fedadam"]["adaptive_below_fedavg_last3"] == [
        "digits/m/b0.1/n20/s0 (-0.0800)"]
    assert len(table["hybrid+fedavg"]["cells_below_reference_last3"]) == 1
    assert len(table["hybrid+fedadam"]["adaptive_below_fedavg"]) == 1      # 0.72 < 0.76 - 0.01
    assert table["hybrid+fedadam"]["adaptive_below_fedavg_last3"] == []    # -0.0067
    near = {**cell, "centralized_best": 0.76}  # >= 0.95 x centralized: no miss
    assert bench.last3_verdicts(near, "hybrid+fedavg")[0] is None
    assert bench.last3_verdicts({**cell, "reference_curve": []}, "star+fedadam") == (None, None)


def test_resume_runs_only_the_cells_not_yet_measured(tmp_path: Path, monkeypatch: Any) -> None:
    cells = bench.grid_cells("medium", ["table"], ["mlp"], betas=[0.3], clients=[20],
                             seeds=[0, 1])
    ran: list[tuple[Any, ...]] = []

    def fake_cell(cell: tuple[Any, ...], jobs: Any, out: Path, workers: int,
                  folds: int = 1, training: Any = None) -> dict[str, Any]:
        ran.append(cell)
        assert folds == bench.FOLDS["table"]   # a small table is cross-validated
        done = _measured(cell[4], 0.9, star_fedavg=0.9)
        return {**done, "dataset": cell[0], "model": cell[1], "beta": cell[2],
                "clients": cell[3], "rounds": cell[5], "folds": folds}

    monkeypatch.setattr(bench, "bench_cell", fake_cell)
    args = ["--grid", "medium", "--dataset", "table", "--models", "mlp", "--betas", "0.3",
            "--clients", "20", "--seeds", "0,1", "--jobs", "star:fedavg",
            "--out", str(tmp_path)]
    assert bench.main(args) == 0 and ran == cells
    # a run stopped after its first cell: the second run measures only the other
    report = json.loads((tmp_path / "learning_grid.json").read_text())
    # each cell says which code measured it
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True, cwd=Path(bench.__file__).parent).stdout.strip()
    assert all(c["commit"].split("+")[0] == (head or "unknown") and c["measured"]
               for c in report["cells"])
    report["cells"] = report["cells"][:1]
    (tmp_path / "learning_grid.json").write_text(json.dumps(report))
    ran.clear()
    assert bench.main([*args, "--resume"]) == 0 and ran == cells[1:]
    assert [c["seed"] for c in json.loads((tmp_path / "learning_grid.json").read_text())
            ["cells"]] == [0, 1]
    # a cell measured without a job now asked for is measured again
    ran.clear()
    assert bench.main([*args[:-3], "star:fedavg,star:fedadam", "--out", str(tmp_path),
                       "--resume"]) == 0 and ran == cells
    # a cell measured on one test split, not the folds a table is judged over, again
    report = json.loads((tmp_path / "learning_grid.json").read_text())
    report["cells"][0]["folds"] = 1
    (tmp_path / "learning_grid.json").write_text(json.dumps(report))
    ran.clear()
    assert bench.main([*args, "--resume"]) == 0 and ran == cells[:1]


def test_folds_test_every_row_once_and_pool_by_rows(tmp_path: Path) -> None:
    import numpy as np

    x, y = bench.table_arrays("wine")
    tested = []
    for k in range(5):
        dataset, rows = bench.fold_dataset("wine", tmp_path, k, 5)
        with np.load(dataset.removeprefix("npz:")) as npz:
            assert len(npz["y_test"]) == rows and len(npz["y_train"]) == len(y) - rows
            tested += [tuple(r) for r in npz["x_test"].round(3)]
    assert sorted(tested) == sorted(tuple(r) for r in x.astype(np.float32).round(3))
    # wine as it ships: proline's scale kept (the job standardizes)
    assert x.max() > 1000
    results = {"star+fedavg@1": {"final": 1.0, "curve": [0.5, 1.0], "bytes_inter": 10,
                                 "personalized": 0.9, "global_on_clients": 0.8, "seconds": 2.0,
                                 "loss": [2.0, 0.4]},
               "star+fedavg@2": {"final": 0.5, "curve": [0.5, 0.5], "bytes_inter": 20,
                                 "personalized": 0.7, "global_on_clients": 0.6, "seconds": 3.0,
                                 "loss": [None, 0.8]},
               "centralized@1": {"final": 1.0, "best": 1.0, "curve": [1.0, 1.0]},
               "centralized@2": {"final": 0.0, "best": 1.0, "curve": [1.0, 0.0]},
               "star+fedadam@1": {"final": 1.0, "curve": [1.0]},
               "star+fedadam@2": {"error": "RuntimeError: boom"}}
    pooled = bench.pool_folds(results, [30, 10])
    # 30 rows right of 40, not the mean of 1.0 and 0.5
    assert pooled["star+fedavg"]["final"] == 0.875
    assert pooled["star+fedavg"]["curve"] == [0.5, 0.875]
    # the mean loss over all 40 rows; a round with a fold's loss not finite has none
    assert pooled["star+fedavg"]["loss"] == [None, 0.5]
    assert pooled["star+fedavg"]["fold_losses"] == [[2.0, 0.4], [None, 0.8]]
    assert pooled["star+fedavg"]["fold_curves"] == [[0.5, 1.0], [0.5, 0.5]]
    assert pooled["star+fedavg"]["bytes_inter"] == 15 and pooled["star+fedavg"]["seconds"] == 5.0
    assert pooled["star+fedavg"]["personalized"] == 0.8
    assert pooled["star+fedavg"]["fold_finals"] == [1.0, 0.5]
    # the best pooled round, not the best of each fold's
    assert pooled["centralized"]["best"] == 1.0 and pooled["centralized"]["final"] == 0.75
    assert pooled["star+fedadam"] == {"error": "fold 2 of 2: RuntimeError: boom"}


def test_a_cross_validated_cell_runs_every_task_per_fold_and_pools_them(
        tmp_path: Path, monkeypatch: Any) -> None:
    """bench_cell with folds: one task per job and fold, named name@fold, each on its own
    fold's data set; the row pooled by the folds' test rows, with each fold's final."""
    seen: list[tuple[str, str]] = []

    def fake_tasks(tasks: list[tuple[str, str, dict[str, Any]]], clusters: int, workers: int,
                   tag: str) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for _kind, name, job in tasks:
            seen.append((name, job["data"]["dataset"]))
            fold = int(name.rsplit("@", 1)[1])
            final = 1.0 if fold == 1 else 0.5
            out[name] = {"final": final, "curve": [0.5, final], "best": final,
                         "loss": [2.0, 1.0 / final], "test_samples": 0, "personalized": 0.9,
                         "global_on_clients": 0.8,
                         "bytes_inter": 100 * fold, "bytes_intra": 0, "seconds": 1.0}
        return out

    monkeypatch.setattr(bench, "_run_tasks", fake_tasks)
    cell = bench.bench_cell(("wine", "mlp", 0.3, 20, 0, 2), [("star", "fedavg")], tmp_path,
                            1, folds=2)
    assert sorted(n for n, _ in seen) == sorted(
        f"{n}@{k}" for n in ("centralized", "reference_fedavg", "star+fedavg") for k in (1, 2))
    assert {d for n, d in seen if n.endswith("@1")} != {d for n, d in seen if n.endswith("@2")}
    rows = [bench.fold_dataset("wine", tmp_path, k, 2)[1] for k in range(2)]
    pooled = round((1.0 * rows[0] + 0.5 * rows[1]) / sum(rows), 4)
    assert cell["folds"] == 2 and cell["reference_fedavg"] == pooled
    assert cell["reference_fold_finals"] == [1.0, 0.5]
    row = cell["jobs"]["star+fedavg"]
    assert row["final"] == pooled and row["fold_finals"] == [1.0, 0.5]
    assert row["bytes_inter"] == 150 and row["minus_reference"] == 0.0
    # each round's loss kept beside its accuracy (what on_stall judges), pooled the same way
    assert row["loss"] == [2.0, round((1.0 * rows[0] + 2.0 * rows[1]) / sum(rows), 4)]
    assert row["fold_losses"] == [[2.0, 1.0], [2.0, 2.0]]
    assert row["fold_curves"] == [[0.5, 1.0], [0.5, 0.5]]


def test_a_negative_fold_count_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    out = tmp_path / "grid"
    said = _refused("--folds -2 accepted", bench.main,
                    ["--grid", "medium", "--dataset", "wine", "--folds", "-2", "--out", str(out)])
    assert "--folds -2" in said and "K >= 1" in said
    assert not out.exists()


def test_redo_runs_one_aggregator_again_and_keeps_the_rest_of_each_cell(
        tmp_path: Path, monkeypatch: Any) -> None:
    """--redo fedprox: only the fedprox jobs run, against the cell's own reference; the
    other rows, the baselines and the cells of other models stay; a second run at the same
    code has nothing to do (a stopped redo goes on where it was)."""
    ran: list[str] = []

    def fake_tasks(tasks: list[tuple[str, str, dict[str, Any]]], clusters: int, workers: int,
                   tag: str) -> dict[str, dict[str, Any]]:
        ran.extend(name for _kind, name, _job in tasks)
        assert all(job["training"].get("fedprox_mu") is None for _k, _n, job in tasks)
        return {name: {"final": 0.9, "curve": [0.5, 0.9], "personalized": 0.95,
                       "global_on_clients": 0.9, "bytes_inter": 200, "seconds": 1.0}
                for _kind, name, _job in tasks}

    def row(final: float) -> dict[str, Any]:
        return {"final": final, "curve": [0.5, final], "personalized": 0.95,
                "global_on_clients": 0.9, "bytes_inter": 100}
    cells = [{"dataset": "digits", "model": model, "beta": 0.3, "clients": 20, "seed": 0,
              "rounds": 2, "centralized_best": 0.95, "reference_fedavg": 0.92,
              "jobs": bench.job_rows({"star+fedavg": row(0.92), "star+fedprox": row(0.80)},
                                     0.92, 0.95, 0.1),
              "refused": {}} for model in ("mlp", "cnn")]
    out = tmp_path / "grid"
    out.mkdir()
    (out / "learning_grid.json").write_text(json.dumps({"cells": cells}))
    monkeypatch.setattr(bench, "_run_tasks", fake_tasks)
    monkeypatch.setattr(bench, "code_version", lambda: "abc")
    assert bench.main(["--grid", "full", "--redo", "fedprox", "--models", "mlp",
                       "--out", str(out)]) == 0
    # every grid topology's fedprox the cell has: only star's here
    assert ran == ["star+fedprox"]
    after = {c["model"]: c for c in json.loads((out / "learning_grid.json").read_text())["cells"]}
    redone = after["mlp"]["jobs"]["star+fedprox"]
    assert redone["final"] == 0.9 and redone["redone"] == "abc"
    assert redone["minus_reference"] == -0.02 and redone["bytes_over_star"] == 2.0
    assert after["mlp"]["jobs"]["star+fedavg"]["final"] == 0.92
    assert after["mlp"]["reference_fedavg"] == 0.92
    assert after["cnn"]["jobs"]["star+fedprox"]["final"] == 0.80  # not in --models
    assert bench.main(["--grid", "full", "--redo", "fedprox", "--models", "mlp",
                       "--out", str(out)]) == 0
    assert ran == ["star+fedprox"]
    before = (out / "learning_grid.json").read_bytes()
    empty = tmp_path / "nothing-measured"
    said = _refused("--redo without measured cells", bench.main,
                    ["--grid", "full", "--redo", "fedprox", "--out", str(empty)])
    assert "learning_grid.json does not exist" in said and "--out" in said
    assert not (empty / "learning_grid.json").exists()
    said = _refused("--redo of a job the grid has not accepted", bench.main,
                    ["--grid", "full", "--redo", "fedsgd", "--out", str(out)])
    assert "--redo 'fedsgd'" in said and "star:fedavg" in said
    assert (out / "learning_grid.json").read_bytes() == before


def test_training_settings_run_every_task_of_a_cell_and_make_it_a_cell_of_its_own(
        tmp_path: Path, monkeypatch: Any) -> None:
    """--training lr_schedule=constant: centralized, the reference loop and every job run
    at it; the cell keeps it, and is not the cell at the bench's own settings (--resume
    measures that one again, --merge keeps both); --redo runs a cell at its own."""
    seen: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(bench, "_run_tasks",
                        _recorder(seen, lambda name, job: (name, job["training"])))
    out = tmp_path / "grid"
    args = ["--grid", "medium", "--dataset", "digits", "--models", "mlp", "--betas", "0.3",
            "--clients", "20", "--seeds", "0", "--jobs", "star:fedavg,star:fedadam",
            "--rounds", "2", "--out", str(out), "--resume"]
    assert bench.main([*args, "--training", "lr_schedule=constant",
                       "--training", "number_of_epochs=1"]) == 0
    assert sorted(name for name, _ in seen) == ["centralized", "reference_fedavg",
                                                "star+fedadam", "star+fedavg"]
    assert all(t["lr_schedule"] == "constant" and t["number_of_epochs"] == 1 for _, t in seen)
    (cell,) = json.loads((out / "learning_grid.json").read_text())["cells"]
    assert cell["training"] == {"lr_schedule": "constant", "number_of_epochs": 1}
    # the same split at the bench's own settings is another cell; both are kept
    seen.clear()
    assert bench.main(args) == 0 and len(seen) == 4
    assert all("lr_schedule" not in t for _, t in seen)
    report = json.loads((out / "learning_grid.json").read_text())
    assert [c.get("training") for c in report["cells"]] == [cell["training"], None]
    assert len(report["seed_means"]) == 2
    seen.clear()
    assert bench.main([*args, "--training", "number_of_epochs=1",
                       "--training", "lr_schedule=constant"]) == 0 and seen == []   # resumed
    # --redo runs each cell at its own settings
    monkeypatch.setattr(bench, "code_version", lambda: "abc")
    assert bench.main(["--grid", "full", "--redo", "star:fedadam", "--out", str(out)]) == 0
    assert sorted((name, t.get("lr_schedule", "")) for name, t in seen) == [
        ("star+fedadam", ""), ("star+fedadam", "constant")]
    merged = tmp_path / "merged"
    assert bench.main(["--merge", str(out), "--out", str(merged)]) == 0
    assert len(json.loads((merged / "learning_grid.json").read_text())["cells"]) == 2


def test_bad_training_settings_and_splits_are_refused_before_anything_runs(
        tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(bench, "_run_tasks", lambda *a: (_ for _ in ()).throw(
        AssertionError("a task ran")))
    out = tmp_path / "grid"
    for option, bad, says in (
            ("--training", "bogus=1", "unknown key training.bogus"),
            ("--training", "learning_rate=-1", "training.learning_rate = -1"),
            ("--training", "lr_schedule", "expected KEY=VALUE"),
            ("--training", "federated_learning_rounds=3", "set it with --rounds"),
            ("--training", "data.dataset=npz:/etc/passwd", "not a [training] key"),
            ("--split", "labels", "give labels:VALUE"), ("--split", "iid:3", "iid takes no value"),
            ("--split", "pathological:2", "expected dirichlet, iid"),
            ("--split", "shards:two", "'two' is not a number"),
            ("--split", "labels:0", "labels_per_client"),
            ("--split", "labels:11", "digits has 10 labels")):
        said = _refused(f"{option} {bad} accepted", bench.main,
                        ["--grid", "medium", "--dataset", "digits", option, bad, "--out",
                         str(out)])
        assert says in said, (bad, said)
    assert not (out / "learning_grid.json").exists()
    said = _refused("--split labels:3 on the breast-cancer table accepted", bench.main,
                    ["--dataset", "table", "--split", "labels:3", "--out", str(out)])
    assert "table has 2 labels" in said
    (out / "learning_grid.json").write_text(json.dumps({"cells": []}))
    before = (out / "learning_grid.json").read_bytes()
    said = _refused("--redo with --training accepted", bench.main,
                    ["--grid", "full", "--redo", "fedadam", "--training", "lr_schedule=constant",
                     "--out", str(out)])
    assert "leave --training and --split out" in said
    assert (out / "learning_grid.json").read_bytes() == before


def test_a_split_reaches_every_task_of_a_cell_and_makes_it_a_cell_of_its_own(
        tmp_path: Path, monkeypatch: Any) -> None:
    """--split labels:2: centralized, the reference loop and every job partition the
    clients' data that way ([data], not [training]); the cell keeps it and is not the
    Dirichlet cell of the same beta."""
    seen: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    monkeypatch.setattr(bench, "_run_tasks", _recorder(
        seen, lambda name, job: (name, job["data"], job["training"])))
    out = tmp_path / "grid"
    args = ["--grid", "medium", "--dataset", "digits", "--models", "mlp", "--betas", "0.3",
            "--clients", "20", "--seeds", "0", "--jobs", "star:fedavg,hybrid:fedadam",
            "--rounds", "2", "--out", str(out), "--resume"]
    assert bench.main([*args, "--split", "labels:2"]) == 0
    assert sorted(name for name, _, _ in seen) == ["centralized", "hybrid+fedadam",
                                                   "reference_fedavg", "star+fedavg"]
    for _name, data, training in seen:
        assert data["data_distribution_kind"] == "labels" and data["labels_per_client"] == 2
        assert not any(k.startswith("data") for k in training)
    (cell,) = json.loads((out / "learning_grid.json").read_text())["cells"]
    assert cell["training"] == {"data.data_distribution_kind": "labels",
                                "data.labels_per_client": 2}
    seen.clear()
    assert bench.main(args) == 0 and len(seen) == 4   # the Dirichlet cell is another
    assert all("data_distribution_kind" not in data for _, data, _ in seen)
    seen.clear()
    assert bench.main([*args, "--split", "labels:2"]) == 0 and seen == []   # resumed
    # each kind's key, and a real partition of digits by it (no engine)
    from fedcore.data import client_data, load_dataset, prepare
    from proto.job import JobSpec
    for split, key, value in (("shards:3", "shards_per_client", 3),
                              ("quantity:0.2", "quantity_beta", 0.2), ("iid", None, None)):
        settings = bench.split_settings(split)
        ds = bench.replace(bench.DATASETS["digits"], clients=12, training=settings)
        spec = JobSpec.from_dict(bench.job_dict(ds, "digits", "star", "fedavg"))
        assert spec.data.data_distribution_kind == split.split(":")[0]
        if key:
            assert getattr(spec.data, key) == value
        parts = client_data(prepare(load_dataset("digits"), spec.data), spec.data, 0)
        assert len(parts.train_indices) == 12


def test_training_settings_reach_every_task_outside_the_grid_too(
        tmp_path: Path, monkeypatch: Any) -> None:
    """bench_learning --dataset digits --training ...: not silently dropped outside --grid."""
    seen: list[tuple[str, dict[str, Any]]] = []

    def fake_tasks(tasks: list[tuple[str, str, dict[str, Any]]], clusters: int, workers: int,
                   tag: str) -> dict[str, dict[str, Any]]:
        seen.extend((name, job["training"]) for _kind, name, job in tasks)
        return {name: {"final": 0.9, "best": 0.95, "curve": [0.5, 0.9]}
                for _kind, name, _job in tasks}

    monkeypatch.setattr(bench, "_run_tasks", fake_tasks)
    monkeypatch.setattr(bench, "plot", lambda report, path: None)
    assert bench.main(["--dataset", "digits", "--jobs", "star:fedavg,star:fedadam:none:locality:2",
                       "--rounds", "2", "--training", "optimizer=adam", "--out",
                       str(tmp_path)]) == 0
    assert {name for name, _ in seen} >= {"centralized", "reference_fedavg"}
    assert len(seen) >= 4 and all(t["optimizer"] == "adam" for _, t in seen)
    assert [t.get("personal_epochs") for name, t in seen if name.startswith("star")] == [None, 2]
    assert json.loads((tmp_path / "learning.json").read_text())["training"] == {"optimizer": "adam"}


def test_the_reference_loop_trains_the_engines_participants_only(monkeypatch: Any) -> None:
    """With client_fraction < 1 the reference loop trained every client every round, so a
    cell at 0.3 compared the engine's jobs with a loop that had three times their clients
    (digits SmallCNN beta 0.3: reference 0.864, star fedavg 0.674). It now trains the
    engine's draw (graph.participants), round by round."""
    import types
    from dataclasses import replace

    import worker.nodes.federated as federated
    import worker.training as training
    from worker.executor.graph import participants

    trained: dict[int, set[int]] = {}
    seed_of = federated.client_seed

    def recording_seed(seed: int, client: int, r: int) -> int:
        trained.setdefault(r, set()).add(client)
        return seed_of(seed, client, r)

    monkeypatch.setattr(federated, "client_seed", recording_seed)
    monkeypatch.setattr(training, "train_local",
                        lambda net, x, y, cfg, seed, global_weights=None:
                        types.SimpleNamespace(num_samples=len(y)))
    ds = replace(bench.DATASETS["digits"], clients=10, rounds=3,
                 training={"client_fraction": 0.3})
    job = bench.job_dict(ds, "digits", "star", "fedavg", seed=4)
    assert len(bench.run_reference_fedavg(job)["curve"]) == 3
    assert trained == {r: set(participants(10, 0.3, 4, r)) for r in (1, 2, 3)}
    assert all(len(c) == 3 for c in trained.values()) and trained[1] != trained[2]


def test_global_on_clients_scores_the_clients_personalized_accuracy_is_scored_on(
        tmp_path: Path, monkeypatch: Any) -> None:
    """With client_fraction < 1 the job's personalized accuracy is scored on the last
    round's draw only, so the final model is scored on those clients' splits too (on all
    clients' it set 0.86 against the draw's 0.84 on the stop-60 cell: not like for like).
    Each client's split is scored with its own training samples as context, as
    personalized accuracy is: the same as one pooled evaluation for a model with running
    statistics; a BatchNorm without them (batch statistics in eval mode) was scored on
    batches that held every client's labels."""
    from dataclasses import replace

    import numpy as np
    from safetensors.numpy import save as st_save

    import worker.training
    from worker.executor.graph import participants
    from worker.serialization import model_weights

    (tmp_path / "batchstats.py").write_text(
        "from torch import nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self, input_shape, num_classes):\n"
        "        super().__init__()\n"
        "        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32),\n"
        "                                 nn.BatchNorm1d(32, track_running_stats=False),\n"
        "                                 nn.ReLU(), nn.Linear(32, num_classes))\n"
        "    def forward(self, x):\n"
        "        return self.net(x)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls: list[tuple[int, int]] = []
    scores = worker.training.sample_scores
    monkeypatch.setattr(worker.training, "sample_scores", lambda net, x, y, offsets=None,
                        context=None: calls.append((len(y), -1 if context is None else len(context))) or scores(
                            net, x, y, offsets, context))
    try:
        for model, fraction in (("mlp", 0.3), ("mlp", 1.0), ("batchstats:Net", 1.0)):
            ds = replace(bench.DATASETS["digits"], model=model, clients=10, rounds=3)
            job = bench.job_dict(ds, bench.dataset_name("digits", tmp_path), "star", "fedavg",
                                 training={"client_fraction": fraction})
            _spec, data, parts, net = bench._setup(job)
            score = bench.global_on_clients(job, st_save(model_weights(net)))
            assert score is not None and 0.0 <= score <= 1.0
            drawn = sorted(participants(10, fraction, 0, 3))
            assert len(drawn) == (3 if fraction < 1 else 10)
            assert calls == [(len(parts.test_indices[c]), len(parts.train_indices[c]))
                             for c in drawn]
            calls.clear()
            pooled = np.concatenate([parts.test_indices[c] for c in drawn])
            alone = worker.training.evaluate(net, data.x_train[pooled], data.y_train[pooled])
            calls.clear()
            if model == "mlp":
                assert score == round(alone.accuracy, 4)
            else:   # per client, with its own batch statistics: not the pooled batches'
                assert score != round(alone.accuracy, 4)
    finally:
        sys.modules.pop("batchstats", None)


def test_status_reads_the_must_shows_as_written_and_names_the_missing_cells(
        tmp_path: Path, capsys: Any) -> None:
    def cell(dataset: str, model: str, beta: float, **rows: dict[str, Any]) -> dict[str, Any]:
        passing = {"final": 0.92, "personalized": 0.96, "global_on_clients": 0.90,
                   "bytes_over_star": 1.0, "at_chance_after_round_3": False}
        jobs = {"+".join(job.rsplit("_", 1)): {**passing, **row} for job, row in rows.items()}
        return {"dataset": dataset, "model": model, "beta": beta, "clients": 20, "seed": 0,
                "rounds": 15, "centralized": 0.95, "centralized_best": 0.99,
                "reference_fedavg": 0.91,
                "jobs": jobs, "commit": "abc"}
    cells = [
        # 0.895: 0.015 below the loop fails star (slack 0.01), not k_connected (0.02)
        cell("digits", "usercnn:SmallCNN", 0.1, star_fedavg={"final": 0.895},
             k_connected_fedavg={"final": 0.895, "bytes_over_star": 3.5},
             hybrid_fedadam={"final": 0.905}, hybrid_fedavg={},
             hierarchical_fedavg={"at_chance_after_round_3": True},
             star_fedyogi={"personalized": 0.89}),
        cell("mnist", "usercnn:BNCNN", 0.3, star_fedavg={"personalized": 0.94}),
        # outside the grid: another model, and the grid's cell at other [training] settings
        cell("digits", "mlp", 0.1, star_fedavg={"final": 0.1}),
        {**cell("digits", "usercnn:BNCNN", 0.1, star_fedavg={"final": 0.1}),
         "training": {"optimizer": "adam"}},
    ]
    status = bench.grid_status(cells)
    assert status["cells"] == 270 and status["measured"] == 2
    assert status["by_dataset"]["mnist"] == {"measured": 1, "cells": 81}
    assert len(status["missing"]) == 268 and "digits/usercnn:BNCNN/0.1/20/0" in status["missing"]
    fails = status["fails"]
    assert [f.split()[1] for f in fails["below_reference"]] == ["star+fedavg"]
    # the loop reaches 0.95 x centralized's last round (0.958 x; of its best, 0.919 x): a
    # job below it fails too
    assert {f.split()[1] for f in fails["below_centralized"]} == {
        "star+fedavg", "k_connected+fedavg"}
    assert [f.split()[1] for f in fails["adaptive_below_fedavg"]] == ["hybrid+fedadam"]
    assert fails["at_chance_after_round_3"] == [
        "digits/usercnn:SmallCNN/b0.1/n20/s0 hierarchical+fedavg"]
    cells[0]["reference_at_chance_after_round_3"] = True
    assert bench.grid_status(cells)["fails"]["at_chance_after_round_3"] == [
        "digits/usercnn:SmallCNN/b0.1/n20/s0 hierarchical+fedavg (the reference loop too)"]
    assert [f.split()[1] for f in fails["k_connected_bytes_over_3x_star"]] == ["k_connected+fedavg"]
    assert [f.split()[1] for f in fails["personalized_below_global"]] == ["star+fedyogi"]
    assert fails["personalized_below_0.95_mnist_beta_0.3"] == [
        "mnist/usercnn:BNCNN/b0.3/n20/s0 star+fedavg (0.94)"]
    assert status["measured_at"] == {"abc": 2}
    assert bench.main(["--status", str(_written(tmp_path / "r", *cells))]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["failing"]["below_reference"] == 1
    assert "2 of the full grid's 270 cells measured" in out.err


def _own_data(monkeypatch: Any, tmp_path: Path) -> tuple[Path, Path]:
    """An image npz (sklearn's digits, 1x8x8, shuffled) and a csv table (iris, 150 rows, a
    `label` column) of a user's; the bench's registries as they were after the test."""
    import numpy as np
    from sklearn.datasets import load_digits, load_iris

    for name in ("DATASETS", "CLASSES", "USER_DATA"):
        monkeypatch.setattr(bench, name, dict(getattr(bench, name)))
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = (x[order] / 16.0).astype(np.float32).reshape(-1, 1, 8, 8), y[order]
    npz = tmp_path / "mine.npz"
    np.savez(npz, x_train=x[:1400], y_train=y[:1400], x_test=x[1400:], y_test=y[1400:])
    x, y = load_iris(return_X_y=True)
    csv = tmp_path / "iris.csv"
    np.savetxt(csv, np.column_stack([x, y]), delimiter=",", header="a,b,c,d,label",
               comments="", fmt=["%.2f"] * 4 + ["%d"])
    return npz, csv


def test_a_users_own_data_set_runs_as_the_benchs_own(tmp_path: Path, monkeypatch: Any) -> None:
    """--data NAME=KIND:PATH: centralized, the reference loop and every job of a grid cell
    train on the user's file (by its absolute path: a worker's cwd may differ), the cell
    names it and its chance is one over its own classes; --folds cross-validates it over
    all of its samples; a real run outside the grid learns on it."""
    import numpy as np

    npz, csv = _own_data(monkeypatch, tmp_path)
    seen: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(bench, "_run_tasks", _recorder(seen, lambda name, job: (name, job)))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "grid"
    assert bench.main(["--grid", "medium", "--data", "mine=npz:mine.npz", "--models", "mlp",
                       "--betas", "0.3", "--clients", "20", "--seeds", "0", "--jobs",
                       "star:fedavg,hybrid:fedadam", "--rounds", "2", "--out", str(out)]) == 0
    assert sorted(name for name, _ in seen) == ["centralized", "hybrid+fedadam",
                                                "reference_fedavg", "star+fedavg"]
    assert {job["data"]["dataset"] for _, job in seen} == {f"npz:{npz}"}
    (cell,) = json.loads((out / "learning_grid.json").read_text())["cells"]
    assert (cell["dataset"], cell["data"], cell["model"]) == ("mine", f"npz:{npz}", "mlp")
    assert bench.CLASSES["mine"] == 10
    # a table of 3 classes over 3 folds: every row tested once, its chance 1/3
    seen.clear()
    assert bench.main(["--grid", "medium", "--data", f"iris=csv:{csv}", "--folds", "3",
                       "--betas", "1.0", "--clients", "6", "--seeds", "0", "--jobs",
                       "star:fedavg", "--rounds", "2", "--out", str(out), "--resume"]) == 0
    assert sorted(name for name, _ in seen) == sorted(
        f"{n}@{k}" for n in ("centralized", "reference_fedavg", "star+fedavg") for k in (1, 2, 3))
    files = sorted({job["data"]["dataset"] for _, job in seen})
    assert files == [f"npz:{out}/iris-fold{k}of3.npz" for k in (1, 2, 3)]
    tested = np.concatenate([np.load(f.removeprefix("npz:"))["x_test"] for f in files])
    table = np.loadtxt(csv, delimiter=",", skiprows=1)
    assert sorted(map(tuple, tested.round(2))) == sorted(
        map(tuple, table[:, :4].astype(np.float32).round(2)))
    assert bench.CLASSES["iris"] == 3
    cells = json.loads((out / "learning_grid.json").read_text())["cells"]
    assert [(c["dataset"], c["folds"]) for c in cells] == [("mine", 1), ("iris", 3)]
    # --status on the user's slice (its data is not read: the file may be gone)
    status = bench.grid_status(cells, "medium", ["iris"], None, [1.0], [6, 7], [0], 2)
    assert (status["cells"], status["measured"], status["missing"]) == (2, 1, ["iris/mlp/1.0/7/0"])
    assert bench.main(["--status", str(out), "--grid", "medium", "--data", "iris=csv:gone.csv",
                       "--betas", "1.0", "--clients", "6,7", "--seeds", "0", "--rounds",
                       "2"]) == 0
    # --redo of a cell of the user's data without it: refused, naming the data set
    before = (out / "learning_grid.json").read_bytes()
    monkeypatch.setattr(bench, "USER_DATA", {})
    monkeypatch.setattr(bench, "DATASETS", {k: v for k, v in bench.DATASETS.items()
                                            if k in bench.BUILT_IN})
    said = _refused("--redo of a cell of data not given", bench.main,
                    ["--grid", "full", "--redo", "fedavg", "--out", str(out)])
    assert "(iris, mine)" in said and "--data NAME=KIND:PATH" in said
    assert (out / "learning_grid.json").read_bytes() == before
    # a real run outside the grid, on the iris table: every figure well above chance
    monkeypatch.undo()
    _own_data(monkeypatch, tmp_path)
    assert bench.main(["--data", f"iris=csv:{csv}", "--jobs", "star:fedavg", "--rounds", "3",
                       "--workers", "1", "--out", str(tmp_path / "real")]) == 0
    report = json.loads((tmp_path / "real" / "learning.json").read_text())
    (res,) = report["datasets"].values()
    assert res["dataset"] == f"csv:{csv}"
    finals = [res["centralized"]["final"], res["reference_fedavg"]["final"],
              *(job["final"] for job in res["jobs"].values())]
    assert len(finals) == 3 and min(finals) > 0.6, finals


def test_a_users_data_set_that_is_not_there_or_not_one_is_refused_naming_it(
        tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(bench, "_run_tasks", lambda *a: (_ for _ in ()).throw(
        AssertionError("a task ran")))
    npz, csv = _own_data(monkeypatch, tmp_path)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    out = tmp_path / "grid"
    for args, says in (
            (["--data", f"mine=npz:{tmp_path}/gone.npz"], "gone.npz"),
            (["--data", f"mine=npz:{tmp_path}/bad.npz"], "bad.npz"),
            (["--data", f"digits=npz:{npz}"], "'digits' is a data set of the bench's own"),
            (["--data", f"npz:{npz}"], "expected NAME=KIND:PATH"),
            (["--data", f"my data=npz:{npz}"], "name 'my data'"),
            (["--data", f"mine=npz:{npz}", "--dataset", "other"], "--dataset 'other'"),
            (["--dataset", "mine"], "given with --data"),
            (["--data", f"iris=csv:{csv}", "--models", "mlp,usercnn:BNMLP"],
             "one model outside --grid")):
        said = _refused(f"{args} accepted", bench.main, [*args, "--out", str(out)])
        assert says in said, (args, said)
    assert not out.exists()
    said = _refused("a model that cannot be imported accepted", bench.main,
                    ["--grid", "quick", "--data", f"iris=csv:{csv}", "--models",
                     "no_such_module_here:Net", "--out", str(out)])
    assert "cannot import module 'no_such_module_here'" in said and "Traceback" not in said


def test_every_probe_model_builds_and_gives_one_logit_per_class_on_images_and_rows() -> None:
    """bench/probe_models.py reproduces stops 75-77's probes: each class builds through
    the engine's build_model (seeded, lazy layers shaped) for an 8x8 image and a 28x28
    one, the flat ones for a table's rows too, and returns (batch, classes)."""
    import inspect

    import probe_models
    import torch

    from proto.job import ModelSpec
    from worker.models import build_model

    classes = [name for name, cls in inspect.getmembers(probe_models, inspect.isclass)
               if issubclass(cls, torch.nn.Module) and cls.__module__ == "probe_models"]
    assert len(classes) == 19, classes
    flat = {"ZeroHead", "NoTrackBN", "LazyMLP", "ParamListNet", "LayerNormDropMLP",
            "WeightNormMLP", "LogSoftmaxBNHead", "SoftmaxOut", "SpectralNormMLP",
            "MaskedCounterMLP", "DoubleMLP", "SiLUBNPostAct"}
    for name in classes:
        for shape in [(1, 8, 8), (1, 28, 28), *([(13,)] if name in flat else [])]:
            model = build_model(ModelSpec(name=f"probe_models:{name}"), shape, 3, seed=0)
            with torch.no_grad():
                out = model.eval()(torch.zeros(4, *shape))
            assert tuple(out.shape) == (4, 3), (name, shape, tuple(out.shape))
