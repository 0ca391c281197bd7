"""`status RUN_DIR --tensorboard DIR`: the rounds read back with TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.cli import main
from tests.scheduler.test_status import record, write_running

pytest.importorskip("tensorboard")


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_rounds_become_scalars_and_only_new_rounds_are_appended(tmp_path: Path) -> None:
    run, tb = tmp_path / "run", tmp_path / "tb"
    write_running(run, 2, total=3)
    assert main(["status", str(run), "--tensorboard", str(tb)]) == 0
    got = scalars(tb / "demo")
    assert [step for step, _ in got["round/accuracy"]] == [1, 2]
    assert got["round/accuracy"] == [(1, pytest.approx(0.51)), (2, pytest.approx(0.52))]
    assert got["total/bytes_inter"] == [(1, 2_000_000.0), (2, 4_000_000.0)]
    assert got["cluster/a/bytes_inter"] == [(1, 1_500_000.0), (2, 1_500_000.0)]
    assert got["round/bytes_intra"] == [(1, record(1).bytes_intra), (2, record(2).bytes_intra)]
    # --follow writes the later rounds as they come, to the same run's directory
    write_running(run, 3, total=3, state="finished")
    assert main(["status", str(run), "--follow", "--interval", "0.05", "--tensorboard", str(tb)]) == 0
    got = scalars(tb / "demo")
    assert [step for step, _ in got["round/loss"]] == [1, 2, 3]  # rewritten, not repeated
    assert got["round/loss"][-1] == (3, pytest.approx(1 / 3))
