"""Faults: how fast a lost cluster is noticed and the job recovers, and what it costs.

Each case runs one job on a fresh `LocalTestbed` (3 real fabricd daemons + the scheduler's
on 127.0.0.1; executors in-process threads, or an embedded Ray each with
`--backend local`): star + fedadam, 6 clients, `[faults] on_cluster_loss = "continue"`,
`checkpoint_every = 1`, `lease_seconds = 6`.

- `undisturbed`: the baseline, measured in the same run;
- `kill_daemon`: `kill -9` of one cluster's fabricd (and its executor) after round
  `--kill-at`; the job must finish every round on the two survivors;
- `kill_executor`: `kill -9` of that cluster's executor only (its daemon stays: the
  cluster is re-admitted at the next round boundary with a fresh executor);
- `restart_daemon`: `kill -9` of that cluster's fabricd, restarted with the same config
  2 s later: re-admitted once back in the mesh (return_seconds: restart to re-admission);
- `kill_scheduler`: `kill -9` of `fedpilot-scheduler submit` (a subprocess) after round
  `--kill-at`; reported: seconds until every executor of the job has exited (lease
  `lease_seconds`), then `submit --resume` of the run directory to the end.

Reported per case: detect_seconds (from the lost cluster's last lease answer to the
verdict, from summary.faults), recover_seconds (verdict to the round running again),
rounds completed, final accuracy and its difference from the undisturbed run, wall
seconds and their ratio to the undisturbed run's.

    python bench/bench_faults.py                 # in-process executors, 20 rounds
    python bench/bench_faults.py --backend local # embedded Ray per cluster
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proto.job import JobSpec  # noqa: E402
from proto.rounds import RoundRecord  # noqa: E402
from scheduler.testbed import LocalTestbed  # noqa: E402
from tests.e2e._faults import executors, job_driver  # noqa: E402

LEASE = 6


def job_table(job_id: str, rounds: int) -> dict[str, Any]:
    return {
        "job": {"id": job_id, "seed": 7},
        "data": {"number_of_clients": 6},
        "training": {"federated_learning_rounds": rounds, "number_of_epochs": 1},
        "topology": {"kind": "star"},
        "aggregation": {"name": "fedadam"},
        "placement": {"strategy": "round_robin", "max_materialized": 2},
        "faults": {"lease_seconds": LEASE, "checkpoint_every": 1,
                   "on_cluster_loss": "continue"}}


def driver_case(args: argparse.Namespace, case: str, workdir: Path) -> dict[str, Any]:
    spec = JobSpec.from_dict(job_table(f"bench-{case}", args.rounds))
    with LocalTestbed(3, backend=args.backend, workdir=str(workdir / case), capacity=3) as tb:
        clusters = tb.start(timeout=120)
        victim = tb.cluster_ids[0]
        restarted: list[float] = []
        readmitted: list[float] = []

        def progress(record: RoundRecord, total: int) -> None:
            if restarted and not readmitted and victim in record.by_cluster:
                readmitted.append(time.perf_counter() - record.seconds)
            if record.round != args.kill_at:
                return
            if case in ("kill_daemon", "restart_daemon"):
                tb.kill(victim)
            if case == "restart_daemon":
                def restart() -> None:
                    time.sleep(2)
                    restarted.append(time.perf_counter())
                    tb.restart(victim)
                threading.Thread(target=restart, daemon=True).start()
            elif case == "kill_executor":
                for pid, name in executors(tb, spec.job_id).items():
                    if name == victim:
                        os.kill(pid, signal.SIGKILL)

        with job_driver(tb, clusters, spec, backend=args.backend, timeout=600, progress=progress,
                        run_dir=workdir / case / "run") as driver:
            started = time.perf_counter()
            result = driver.run()
        seconds = time.perf_counter() - started
    s = result.summary
    row: dict[str, Any] = {"rounds": len(s.rounds), "final_accuracy": round(s.final_accuracy, 4),
                           "seconds": round(seconds, 2), "faults": s.faults}
    if s.faults:
        row["detect_seconds"] = s.faults[0]["detect_seconds"]
        row["recover_seconds"] = s.faults[0]["recover_seconds"]
    back = [f for f in s.faults if f["event"] == "returned"]
    if back:
        row["returned_in_round"] = back[0]["round"]
        row["readmit_seconds"] = back[0]["recover_seconds"]
    if restarted and readmitted:  # restart -> the first round it trained in again began
        row["return_seconds"] = round(readmitted[0] - restarted[0], 2)
    return row


def scheduler_case(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    job_id = "bench-kill-scheduler"
    table = job_table(job_id, args.rounds)
    lines = []
    for section, values in table.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    job = workdir / "scheduler-job.toml"
    job.write_text("\n".join(lines) + "\n")
    out = workdir / "scheduler-run"
    scheduler = str(Path(sys.executable).with_name("fedpilot-scheduler"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with LocalTestbed(3, backend=args.backend, workdir=str(workdir / "kill_scheduler"),
                      capacity=3) as tb:
        tb.start(timeout=120)
        base = [scheduler, "submit", str(job), "--mesh", str(tb.configs["scheduler"]),
                "--out", str(out), "--quiet"]
        proc = subprocess.Popen(base, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        while _rounds(out) < args.kill_at and proc.poll() is None:
            time.sleep(0.1)
        proc.kill()
        proc.wait()
        killed = time.perf_counter()
        while executors(tb, job_id) and time.perf_counter() - killed < 120:
            time.sleep(0.1)
        released = time.perf_counter() - killed
        left = len(executors(tb, job_id))
        started = time.perf_counter()
        again = subprocess.run([*base, "--resume", str(out)], env=env, capture_output=True,
                               text=True)
        resumed = time.perf_counter() - started
    summary = json.loads((out / "summary.json").read_text())
    return {"executors_exit_seconds": round(released, 2), "executors_left": left,
            "lease_seconds": LEASE, "resume_exit_code": again.returncode,
            "resume_seconds": round(resumed, 2), "rounds": len(summary["rounds"]),
            "final_accuracy": round(float(summary["final_accuracy"]), 4)}


def _rounds(out: Path) -> int:
    try:
        return len(json.loads((out / "summary.json").read_text()).get("rounds", []))
    except (OSError, ValueError):
        return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", choices=("inprocess", "local"), default="inprocess")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--kill-at", type=int, default=3)
    p.add_argument("--cases", default="kill_daemon,kill_executor,restart_daemon,kill_scheduler")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        workdir = Path(tmp)
        base = driver_case(args, "undisturbed", workdir)
        cases: dict[str, Any] = {}
        for case in args.cases.split(","):
            row = (scheduler_case(args, workdir) if case == "kill_scheduler"
                   else driver_case(args, case, workdir))
            row["accuracy_delta"] = round(row["final_accuracy"] - base["final_accuracy"], 4)
            if "seconds" in row:
                row["ratio_seconds"] = round(row["seconds"] / base["seconds"], 2)
            cases[case] = row
    print(json.dumps({"benchmark": "faults", "backend": args.backend, "rounds": args.rounds,
                      "kill_at": args.kill_at, "undisturbed": base, "cases": cases}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
