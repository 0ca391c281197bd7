"""bench_learning's grid verdicts from cells (no training: the cells are written here)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_learning as bench  # noqa: E402


def _cell(seed: int, reference: float, **finals: float) -> dict[str, Any]:
    return {"dataset": "digits", "model": "m", "beta": 0.1, "clients": 20, "seed": seed,
            "centralized_best": 0.98, "reference_fedavg": reference,
            "jobs": {job.replace("_", "+"): {"final": f} for job, f in finals.items()}}


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
