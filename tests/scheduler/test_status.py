"""`fedpilot-scheduler status`: a finished run written by scheduler.rundir.results, a run in
progress (status field, half-written files), --follow until the job finishes, bad dirs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from scheduler.cli import main
from scheduler.rundir.results import (
    ClusterRecordSummary,
    JobSummary,
    RoundRecord,
    write_metrics_csv,
    write_results,
)
from scheduler.rundir.status import read_run

REPO = Path(__file__).resolve().parents[2]


def record(n: int) -> RoundRecord:
    return RoundRecord(round=n, accuracy=0.5 + n / 100, loss=1.0 / n, personalized_accuracy=0.6,
                       bytes_intra=1000 * n, bytes_inter=2_000_000,
                       seconds=1.5, by_cluster={"a": {"bytes_inter": 1_500_000, "bytes_intra": 600 * n},
                                                "b": {"bytes_inter": 500_000, "bytes_intra": 400 * n}})


def summary(rounds: int) -> JobSummary:
    return JobSummary(job_id="demo", backend="ray", placement_strategy="locality", topology="star",
                      aggregation="fedavg", compression="none", communities=2,
                      clusters=[ClusterRecordSummary("a", 6, 3, 7_000_000, 1_000),
                                ClusterRecordSummary("b", 4, 2, 2_000, 3_000)],
                      rounds=[record(i) for i in range(1, rounds + 1)])


def write_running(run: Path, rounds: int, *, total: int = 5, state: str = "running",
                  half_line: bool = False) -> None:
    """What the driver writes after each round: summary.json with a status, metrics.csv."""
    run.mkdir(exist_ok=True)
    s = summary(rounds)
    s.finish()
    data = {**s.to_dict(), "status": state, "rounds_total": total}
    if state == "failed":
        data["error"] = "cluster c lost and no survivor can hold its clients"
    (run / "summary.json").write_text(json.dumps(data))
    write_metrics_csv(run / "metrics.csv", s.rounds)
    if half_line:
        with (run / "metrics.csv").open("a") as fh:
            fh.write(f"{rounds + 1},0.7")  # the writer is mid-line


def test_finished_run_written_by_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_results(tmp_path / "run", summary(3))
    assert main(["status", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("job demo: finished, round 3, accuracy 0.5300")
    assert "    3    0.5300    0.3333       2.000       0.003      1.50" in out
    assert "a: clients=6 actors=3 inter sent 4.500 MB, intra 0.004 MB daemon sent 7.000 MB" in out
    assert "total: inter 6.000 MB, intra 0.006 MB, 4.5 s" in out
    assert main(["status", str(tmp_path / "run"), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["state"] == "finished" and d["round"] == 3
    assert d["bytes_by_cluster"]["b"] == {"bytes_inter": 1_500_000, "bytes_intra": 2400}


def test_running_run_with_half_written_files(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_running(run, 2, half_line=True)
    s = read_run(run)
    assert (s.state, s.current_round, s.rounds_total) == ("running", 2, 5)
    # metrics.csv ahead of summary.json (written first): the newer rounds win
    write_metrics_csv(run / "metrics.csv", [record(i) for i in range(1, 4)])
    assert read_run(run).current_round == 3
    # summary.json caught mid-write: shown from metrics.csv with a note, not an error
    (run / "summary.json").write_text('{"job_id": "demo", "rounds": [{"rou')
    s = read_run(run)
    assert s.current_round == 3 and s.state == "running"
    assert s.notes == ["summary.json is being written; shown from metrics.csv"]
    # only a header so far: round 0, running
    (run / "summary.json").unlink()
    write_metrics_csv(run / "metrics.csv", [])
    assert (read_run(run).state, read_run(run).current_round) == ("running", 0)


def test_failed_run_exits_1_and_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_running(tmp_path / "run", 2, state="failed")
    assert main(["status", str(tmp_path / "run")]) == 1
    assert "job demo: failed, round 2 of 5, accuracy 0.5200 - cluster c lost" in capsys.readouterr().out


def test_not_a_run_dir_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", str(tmp_path / "nope")]) == 2
    assert "nope: no such directory" in capsys.readouterr().err
    assert main(["status", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no summary.json or metrics.csv; not a run directory" in err and "\n" not in err


def test_follow_prints_each_round_once_until_finished(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_running(run, 1, total=4)
    proc = subprocess.Popen([sys.executable, "-m", "scheduler.cli", "status", str(run), "--follow",
                             "--interval", "0.05", "--timeout", "300"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # it has read the run once: now the job moves on
        for n in (2, 3):
            write_running(run, n, total=4, half_line=(n == 2))
            time.sleep(0.3)
        write_running(run, 4, total=4, state="finished")
        rest = proc.stdout.read()  # (not communicate(): it would skip readline's buffer)
        proc.wait(120)
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
    out = first + rest
    assert proc.returncode == 0, err
    assert out.startswith("job demo: running, round 1 of 4")
    for n in (1, 2, 3, 4):
        assert sum(line.startswith(f"{n:>5}  ") for line in out.splitlines()) == 1, out
    assert out.rstrip().endswith("job demo: finished, round 4 of 4, accuracy 0.5400")
    assert asdict(record(1))["round"] == 1


def test_run_recorder_keeps_the_run_dir_current(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from proto.job import JobSpec
    from scheduler.rundir.status import RunRecorder

    spec = JobSpec.from_dict({"job": {"id": "rec"}, "training": {"federated_learning_rounds": 3}})
    run = tmp_path / "runs" / "rec"
    recorder = RunRecorder.for_job(run, spec, backend="inprocess")
    s = read_run(run)
    assert (s.state, s.current_round, s.rounds_total, s.job_id) == ("running", 0, 3, "rec")
    recorder(record(1), 3)
    recorder(record(2), 3)
    assert main(["status", str(run)]) == 0
    assert capsys.readouterr().out.startswith("job rec: running, round 2 of 3, accuracy 0.5200")
    recorder.failed("cluster b lost", lost=["b"])
    assert main(["status", str(run)]) == 1
    assert "job rec: failed, round 2 of 3, accuracy 0.5200 - cluster b lost" in capsys.readouterr().out
    assert sorted(p.name for p in run.iterdir()) == ["metrics.csv", "summary.json"]  # no temp files left


def test_run_recorder_feeds_job_metrics_and_counts_lost_clusters(tmp_path: Path) -> None:
    from fedcore.metrics import RunMetrics
    from proto.job import JobSpec
    from scheduler.rundir.status import RunRecorder

    spec = JobSpec.from_dict({"job": {"id": "lossy"}, "training": {"federated_learning_rounds": 4}})
    metrics = RunMetrics("scheduler")
    recorder = RunRecorder.for_job(tmp_path / "run", spec, backend="ray", metrics=metrics)
    recorder(record(1), 4)
    recorder.failed("lost during round 2: cluster c: disconnected", lost=["c"])
    value = metrics.registry.get_sample_value
    assert value("fedpilot_scheduler_round", {"job": "lossy"}) == 1
    assert value("fedpilot_scheduler_bytes_total", {"job": "lossy", "scope": "inter"}) == 2_000_000
    assert value("fedpilot_scheduler_cluster_losses_total", {"job": "lossy", "cluster": "c"}) == 1
    assert read_run(tmp_path / "run").error.startswith("lost during round 2")


def test_a_running_summary_has_the_faults_so_far_each_loss_counted_once(tmp_path: Path) -> None:
    from fedcore.metrics import RunMetrics
    from proto.job import JobSpec
    from scheduler.rundir.status import RunRecorder

    spec = JobSpec.from_dict({"job": {"id": "bumpy"}, "training": {"federated_learning_rounds": 5}})
    metrics = RunMetrics("scheduler")
    recorder = RunRecorder.for_job(tmp_path / "run", spec, backend="ray", metrics=metrics)
    lost = {"round": 2, "cluster": "b", "event": "lost", "nodes_moved": 3}
    back = {"round": 3, "cluster": "b", "event": "returned", "nodes_moved": 2}
    recorder.follow_faults([lost])
    recorder(record(2), 5)
    recorder.follow_faults([lost, back])
    recorder(record(3), 5)
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["status"] == "running"
    assert [(f["round"], f["event"]) for f in on_disk["faults"]] == [(2, "lost"), (3, "returned")]
    value = metrics.registry.get_sample_value
    assert value("fedpilot_scheduler_cluster_losses_total", {"job": "bumpy", "cluster": "b"}) == 1
