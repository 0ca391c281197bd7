"""The live page of `submit --metrics HOST:PORT`: `/` and `/api/state` over 127.0.0.1 during
a real 3-cluster job (--local 3, in-process executors, real daemons); the rounds the page
reports are summary.json's. Where Debian's chromium is installed (`make test` installs it best
effort) a headless browser renders the page mid-job; its DOM and screenshot are checked."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from scheduler.cli import main as cli_main
from scheduler.testbed import free_port

JOB = """
[job]
id = "live-page"
seed = 3
[data]
number_of_clients = 9
data_distribution_kind = "dirichlet"
dirichlet_beta = 0.3
[training]
federated_learning_rounds = {rounds}
number_of_epochs = 1
[topology]
kind = "hybrid"
[placement]
strategy = "locality"
max_materialized = 3
"""

ROUNDS = 8  # the browser test's job
HELD_ROUND = 4  # ... waits for chromium before this round
STATE_ROUNDS = 10  # the state test's job
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"]


def get(url: str) -> tuple[str, bytes]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.headers.get("Content-Type", ""), resp.read()


@dataclass
class Job:
    run_dir: Path
    address: str
    page: bytes = b""
    states: list[dict[str, Any]] = field(default_factory=list)  # /api/state while it ran
    browser: list[tuple[str, Path]] = field(default_factory=list)  # (DOM, screenshot) mid-job
    result: int | None = None
    error: BaseException | None = None


def run_job(root: Path, rounds: int, while_running: Any = None) -> Job:
    """Submit the job with --metrics in a thread; poll the page until it ends."""
    job_file = root / "job.toml"
    job_file.write_text(JOB.format(rounds=rounds))
    job = Job(root / "run", f"127.0.0.1:{free_port()}")

    def submit() -> None:
        try:
            job.result = cli_main(["submit", str(job_file), "--local", "3", "--backend", "inprocess",
                                   "--out", str(job.run_dir), "--workdir", str(root / "tb"),
                                   "--metrics", job.address, "--quiet", "--wait", "120"])
        except BaseException as exc:  # reported by the test
            job.error = exc

    thread = threading.Thread(target=submit)
    thread.start()
    try:
        while thread.is_alive():
            try:
                if not job.page:
                    _, job.page = get(f"http://{job.address}/")
                content_type, body = get(f"http://{job.address}/api/state")
            except OSError:  # not serving yet, or already closed
                time.sleep(0.2)
                continue
            assert content_type == "application/json"
            state = json.loads(body)
            job.states.append(state)
            if while_running is not None and state["state"] == "running" and 1 <= state["round"] < rounds:
                while_running(job)
                while_running = None
            time.sleep(0.05)  # rounds of this small job can take under 0.2 s each
    finally:
        thread.join()
    return job


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    # enough rounds that the page is seen between two of them however fast they run
    yield run_job(tmp_path_factory.mktemp("live"), rounds=STATE_ROUNDS)


@pytest.mark.slow  # the job fixture: a real 3-cluster job
def test_page_is_served_from_the_package(job: Job) -> None:
    assert job.error is None, job.error
    assert job.result == 0
    assert b"<title>fedpilot job</title>" in job.page
    assert b"api/state" in job.page
    assert b"http://" not in job.page and b"https://" not in job.page  # nothing from the internet


@pytest.mark.slow
def test_state_follows_the_job_and_matches_summary(job: Job) -> None:
    assert job.error is None, job.error
    summary = json.loads((job.run_dir / "summary.json").read_text())
    final = {r["round"]: r for r in summary["rounds"]}
    running = [s for s in job.states if s["state"] == "running" and s["rounds"]]
    assert running, f"the page never showed a running job with rounds: {job.states[-1:]}"
    seen_rounds = {s["round"] for s in running}
    assert len(seen_rounds) >= 2, seen_rounds  # it refreshed while the job ran
    for s in running:
        assert s["job_id"] == "live-page" and s["rounds_total"] == STATE_ROUNDS
        assert s["round"] == s["rounds"][-1]["round"]
        for r in s["rounds"]:  # every round shown is summary.json's round, as it ended
            want = final[r["round"]]
            for key in ("accuracy", "loss", "bytes_inter", "bytes_intra"):
                assert r[key] == want[key], (r["round"], key)
        # what the driver did last before or after the rounds (submit prints it too)
        assert s["stage"].startswith(("placed: ", "rounds done")), s["stage"]
        # the mesh and the placement the driver holds
        assert [c["cluster"] for c in s["mesh"]] == ["cluster-1", "cluster-2", "cluster-3"]
        assert all(c["state"] == "connected" for c in s["mesh"])
        placement = s["placement"]
        assert sum(placement["clients_per_cluster"].values()) == 9
        assert placement["communities"] == summary["communities"]
        for cluster, n in placement["clients_per_cluster"].items():
            assert sum(placement["communities_per_cluster"][cluster].values()) == n


def test_unknown_path_names_the_pages(tmp_path: Path) -> None:
    from fedcore.metrics import RunMetrics
    from scheduler.rundir.live import LiveState

    with RunMetrics("scheduler") as metrics:
        address = metrics.serve("127.0.0.1:0", routes=LiveState(tmp_path / "none").routes())
        with pytest.raises(urllib.error.HTTPError) as err:
            get(f"http://{address}/nope")
        assert err.value.code == 404 and b"/api/state" in err.value.read()
        state = json.loads(get(f"http://{address}/api/state")[1])  # no run directory yet
        assert state["state"] == "starting" and "no such directory" in state["notes"][0]
        assert b"fedpilot_scheduler_info" in get(f"http://{address}/metrics")[1]


def test_state_shows_each_aggregations_contributions_and_the_time_to_accuracy(
        tmp_path: Path) -> None:
    """A buffered job's rounds as the page gets them mid-job: which clusters each
    aggregation applied and how stale, what it dropped, the seconds to each accuracy."""
    from proto.rounds import RoundRecord
    from scheduler.rundir.live import LiveState
    from scheduler.rundir.results import JobSummary
    from scheduler.rundir.status import RunRecorder

    recorder = RunRecorder(tmp_path, JobSummary("buf", "inprocess", "round_robin", "star",
                                                "fedavg", "none", 1))
    fresh = {"round": 1, "staleness": 0, "updates": 2}
    recorder(RoundRecord(1, accuracy=0.55, seconds=2.0, dropped=1,
                         contributions={"a": fresh, "b": fresh}), 4)
    recorder(RoundRecord(2, accuracy=0.81, seconds=1.5, contributions={
        "a": {"round": 2, "staleness": 0, "updates": 2},
        "c": {"round": 1, "staleness": 1, "updates": 2}}), 4)
    state = LiveState(tmp_path, "buf").state()
    assert state["state"] == "running"
    assert [(r["round"], sorted(r["contributions"]), r["dropped"]) for r in state["rounds"]] == [
        (1, ["a", "b"], 1), (2, ["a", "c"], 0)]
    assert state["rounds"][1]["contributions"]["c"]["staleness"] == 1
    assert state["details"]["contributions_dropped"] == 1
    assert state["details"]["time_to_accuracy"] == {"0.5": 2.0, "0.6": 3.5, "0.7": 3.5,
                                                    "0.8": 3.5}
    page = LiveState(tmp_path).routes()["/"]()[0]
    assert b"time_to_accuracy" in page and b"r.contributions" in page


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.skipif(chromium() is None, reason="Debian's chromium is not installed "
                    "(apt-get install chromium; make test installs it best effort)")
def test_headless_browser_renders_the_rounds_mid_job(tmp_path: Path, monkeypatch: Any) -> None:
    from scheduler.run.driver import Driver

    exe = chromium()
    assert exe is not None
    shots = tmp_path / "shots"
    shots.mkdir()
    # the job waits before its HELD_ROUND-th round until chromium has looked: a race
    # between the rounds and chromium's start (as 40 quick rounds were) fails on a machine
    # where the rounds run faster than chromium starts
    looked = threading.Event()
    run_round = Driver._round

    def held(self: Driver, r: int) -> Any:
        if r == HELD_ROUND:
            looked.wait(timeout=300)
        return run_round(self, r)
    monkeypatch.setattr(Driver, "_round", held)

    def render(job: Job) -> None:
        url = f"http://{job.address}/"
        base = [exe, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                "--virtual-time-budget=3000", "--window-size=1100,1000"]
        shot = shots / f"live-{len(job.browser)}.png"
        try:
            subprocess.run([*base, f"--screenshot={shot}", url], capture_output=True,
                           timeout=120, check=True)
            dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True,
                                 timeout=120, check=True).stdout
            job.browser.append((dom, shot))
        finally:
            looked.set()

    job = run_job(tmp_path, rounds=ROUNDS, while_running=render)
    assert job.error is None, job.error
    assert job.browser, "the job ended before the browser could look at it"
    dom, shot = job.browser[0]
    assert shot.stat().st_size > 10_000  # a rendered page, not a blank one
    import re

    shown = re.search(r'data-round="(\d+)" data-state="(\w+)"', dom)
    assert shown, dom[:2000]
    shown_round = int(shown.group(1))
    assert shown.group(2) == "running" and 1 <= shown_round < ROUNDS
    summary = json.loads((job.run_dir / "summary.json").read_text())
    rows = re.findall(r'<tr class="round-row" data-round="(\d+)"><td>\d+</td><td>([0-9.]+)</td>', dom)
    assert [int(r) for r, _ in rows] == list(range(shown_round, max(0, shown_round - 12), -1))
    final = {r["round"]: r for r in summary["rounds"]}
    for r, accuracy in rows:  # the accuracy the page printed is summary.json's
        assert accuracy == f"{final[int(r)]['accuracy']:.4f}"
    assert 'class="state connected"' in dom and "clients" in dom
    assert f"of <span id=\"total\">{ROUNDS}</span>" in dom
    keep = Path(__file__).resolve().parents[2] / "runs" / "live-page.png"
    keep.parent.mkdir(exist_ok=True)
    shutil.copy(shot, keep)  # to be looked at (runs/ is not committed)
