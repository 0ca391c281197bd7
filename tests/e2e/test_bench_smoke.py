"""Both end-to-end benchmarks run (--quick, in-process) and print the JSON they promise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(name: str, *args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / name), *args],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"{name} must print exactly one JSON line, got:\n{proc.stdout}"
    report = json.loads(lines[0])
    assert isinstance(report, dict)
    return report


@pytest.mark.slow
def test_bench_e2e_quick_reports_every_configuration_and_the_ratio(tmp_path: Path) -> None:
    out = tmp_path / "e2e"
    report = run_bench("bench_e2e.py", "--quick", "--mesh", "loopback", "--rounds", "1",
                       "--out", str(out))
    assert report["benchmark"] == "e2e"
    results = report["results"]
    assert {"star+random+fedavg", "hybrid+locality+fedavg"} <= set(results)
    for row in results.values():
        for key in ("final_accuracy", "best_accuracy", "personalized_accuracy", "bytes_inter",
                    "bytes_intra", "seconds"):
            assert key in row
        assert 0.0 <= row["final_accuracy"] <= row["best_accuracy"] <= 1.0
        assert 0.0 <= row["personalized_accuracy"] <= 1.0
        assert len(row["accuracy_curve"]) == 1
        # the link carried exactly what the executors accounted
        assert row["bytes_inter"] == row["bytes_inter_daemons"] > 0
        assert sum(c["clients"] for c in row["clusters"]) == 30
    ratio = report["inter_bytes_hybrid_locality_over_star_random"]["fedavg"]
    assert ratio == pytest.approx(results["hybrid+locality+fedavg"]["bytes_inter"]
                                  / results["star+random+fedavg"]["bytes_inter"], abs=1e-4)
    assert 0 < ratio < 1
    # fedavg with every-round group exchange computes the star's model: same accuracy
    assert report["check_hybrid_fedavg_same_accuracy_as_star_fedavg"] is True
    compressed = [label for label, row in results.items() if row["compression"] != "none"]
    assert compressed, "quick mode must exercise one compression codec"
    assert set(report["goals"]) == {"best_global_accuracy", "personalized_accuracy",
                                    "inter_bytes_ratio"}
    for plot in ("accuracy.png", "traffic.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "bench.json").read_text()) == report


@pytest.mark.slow
def test_bench_round_overhead_quick_reports_both_sides_and_the_ratio() -> None:
    report = run_bench("bench_round_overhead.py", "--quick", "--backend", "inprocess",
                       "--clients", "3", "--rounds", "2")
    assert report["benchmark"] == "round_overhead"
    one, three = report["one_cluster"], report["three_clusters"]
    assert one["clusters"] == 1 and three["clusters"] == 3
    assert one["bytes_inter_per_round"] == 0 < three["bytes_inter_per_round"]
    for side in (one, three):
        assert side["seconds_per_round_mean"] > 0
        assert side["cpu_seconds_per_round_mean"] >= 0
        assert set(side["cpu_seconds_per_round_by_role"]) == {"bench_process"}  # loopback
        assert [len(r) for r in side["round_seconds"]] == [2]
    assert report["ratio_seconds_per_round"] == pytest.approx(
        three["seconds_per_round_mean"] / one["seconds_per_round_mean"], rel=1e-3)
    assert "ratio_cpu_seconds_per_round" in report
    assert isinstance(report["goal_met"], bool)
    assert report["notes"]


@pytest.mark.slow
def test_bench_security_quick_reports_the_join_ratio_and_the_revocation_spread() -> None:
    report = run_bench("bench_security.py", "--quick")
    assert report["benchmark"] == "security" and report["quick"] is True
    join = report["join"]
    assert join["strangers"] == 30 and set(join["runs"]) == {"0", "30"}
    assert [r["strangers_connected"] for r in join["runs"]["0"]] == [0]
    stalled = join["runs"]["30"][0]
    assert stalled["strangers_connected"] + stalled["strangers_refused_while_connecting"] == 30
    assert join["ratio"] == pytest.approx(join["median_s"]["30"] / join["median_s"]["0"], abs=1e-3)
    revocation = report["revocation"]
    assert revocation["daemons"] == 5 and set(revocation["per_member_s"]) == {"a", "r1", "r2", "r3"}
    assert revocation["max_s"] == max(revocation["per_member_s"].values())


@pytest.mark.slow
def test_bench_learning_quick_reports_the_baselines_and_every_job(tmp_path: Path) -> None:
    report = run_bench("bench_learning.py", "--quick", "--workers", "1", "--out", str(tmp_path))
    assert report["benchmark"] == "learning"
    digits = report["datasets"]["digits"]
    assert len(digits["centralized"]["curve"]) == len(digits["reference_fedavg"]["curve"]) == 4
    assert set(digits["jobs"]) == {"star+fedavg+none+locality", "hybrid+fedadam+none+locality",
                                   "k_connected+fedavg+none+locality"}
    for row in digits["jobs"].values():
        assert "error" not in row, row
        for key in ("curve", "final", "personalized", "bytes_inter", "bytes_intra",
                    "rounds_to_0.9_centralized", "final_over_centralized", "at_chance"):
            assert key in row
    # the engine's star FedAvg is the reference loop (test_learning checks it per round too)
    assert digits["jobs"]["star+fedavg+none+locality"]["curve"] == \
        pytest.approx(digits["reference_fedavg"]["curve"], abs=0.01)
    # model-aware communities (update cosine) next to the label-histogram ones
    aware = digits["model_aware_communities"]
    assert "error" not in aware, aware
    assert 1 <= aware["communities_by_update"] <= 12 and 1 <= aware["communities_by_label"] <= 12
    assert -1 <= aware["adjusted_rand_index"] <= 1
    assert -1 <= aware["pairwise_cosine_correlation"] <= 1
    assert (tmp_path / "learning.json").exists() and (tmp_path / "learning.png").exists()


def test_bench_training_step_quick_times_three_ways_and_the_masks_agree() -> None:
    report = run_bench("bench_training_step.py", "--quick")
    assert report["benchmark"] == "training_step"
    seconds = report["seconds_per_client_round"]
    assert set(seconds) == {"plain", "dropout", "dropout_all_devices"}
    assert all(value > 0 for value in seconds.values())
    assert report["dropout_over_plain"] == pytest.approx(
        seconds["dropout"] / seconds["plain"], abs=2e-3)
    assert report["all_devices_over_cpu"] == pytest.approx(
        seconds["dropout_all_devices"] / seconds["dropout"], abs=2e-3)
    # seeding only the CPU generator draws the masks torch.manual_seed drew
    assert report["same_masks"] is True
