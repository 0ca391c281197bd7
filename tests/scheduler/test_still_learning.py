"""A job that ends while its accuracy is still rising says so: summary.json's
`still_learning`, the driver's log line, submit's closing line with the key to raise."""

from __future__ import annotations

import math

from proto.job import JobSpec
from scheduler.rundir.results import STILL_GAIN, JobSummary, RoundRecord, still_learning
from scheduler.submit import still_learning_line


def test_a_curve_still_rising_at_the_end_is_still_learning() -> None:
    # bench_learning's GRU on MNIST (beta 0.3, 20 clients): the reference loop's last rounds
    rising = [0.12, 0.13, 0.16, 0.21, 0.2, 0.18, 0.29, 0.28, 0.25, 0.29, 0.4, 0.44, 0.46,
              0.49, 0.51]
    assert still_learning(rising) == {"gain": 0.07, "rounds": 3, "from": 0.44, "to": 0.51}


def test_a_plateau_a_swing_or_a_short_job_is_not() -> None:
    plateau = [0.5, 0.8, 0.9, 0.93, 0.94, 0.945, 0.95, 0.952, 0.953]
    assert still_learning(plateau) == {}
    # the last round below one before it: a swing, not a trend
    assert still_learning([0.3, 0.5, 0.6, 0.7, 0.8, 0.7, 0.9, 0.85]) == {}
    # too few rounds to tell a trend from the first rounds' climb
    assert still_learning([0.1, 0.3, 0.5, 0.7, 0.9]) == {}
    # rounds that evaluated nothing are left out, not read as a rise
    gain = STILL_GAIN - 0.01
    flat = [0.5, 0.6, 0.7, 0.8, 0.8, 0.8, 0.8, float("nan"), 0.8 + gain]
    assert still_learning(flat) == {}
    assert still_learning([math.nan] * 9) == {}


def test_the_summary_records_it_and_submit_names_the_key() -> None:
    summary = JobSummary("j", "inprocess", "locality", "star", "fedavg", "none", 1,
                         rounds=[RoundRecord(i + 1, accuracy=0.1 * (i + 1), loss=1.0)
                                 for i in range(8)])
    summary.finish()
    assert summary.still_learning["gain"] == 0.3
    assert summary.to_dict()["still_learning"] == summary.still_learning
    spec = JobSpec.from_dict({"training": {"federated_learning_rounds": 8}})
    line = still_learning_line(summary.still_learning, spec)
    assert "0.500 -> 0.800" in line
    assert "training.federated_learning_rounds (now 8)" in line
    flat = JobSummary("j", "inprocess", "locality", "star", "fedavg", "none", 1,
                      rounds=[RoundRecord(i + 1, accuracy=0.9, loss=1.0) for i in range(8)])
    flat.finish()
    assert flat.still_learning == {}


def test_the_progress_line_says_when_the_aggregator_restored_its_model() -> None:
    """A round whose aggregator went back to its best model (aggregation.on_stall) says so
    on submit's progress line, naming the key; other rounds do not."""
    import io

    from scheduler.submit import ProgressBar

    stream = io.StringIO()
    bar = ProgressBar(stream)
    bar(RoundRecord(1, accuracy=0.1, loss=2.3), 3)
    restored = RoundRecord(2, accuracy=0.1, loss=2.3)
    restored.stalls = 1
    bar(restored, 3)
    restored.stalls = 3
    bar(restored, 3)
    first, second, third = stream.getvalue().splitlines()
    assert "restored" not in first
    assert second.endswith("restored (1 stall: aggregation.on_stall)")
    assert third.endswith("restored (3 stalls: aggregation.on_stall)")
