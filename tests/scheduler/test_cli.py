"""`fedpilot-scheduler plan` as a user runs it: real subprocesses for isolation checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from proto.routing import RoutingMatrix
from scheduler.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "deploy" / "examples" / "digits.toml"
MLP_BYTES = 4 * (64 * 64 + 64 + 64 * 10 + 10)


def test_plan_does_not_import_torch_ray_or_libp2p(tmp_path: Path) -> None:
    code = (
        "import sys, json\n"
        "from scheduler.cli import main\n"
        f"rc = main(['plan', {str(DEMO)!r}, '--clusters', 'a:10,b:10,c:10', '--json',"
        f" '--out', {str(tmp_path)!r}])\n"
        "heavy = sorted(m for m in ('torch', 'ray', 'libp2p') if m in sys.modules)\n"
        "print(json.dumps({'rc': rc, 'heavy': heavy}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=120, check=True)
    lines = out.stdout.strip().splitlines()
    summary, result = json.loads(lines[0]), json.loads(lines[-1])
    assert result == {"rc": 0, "heavy": []}
    assert summary["clients"] == 30 and summary["communities"] >= 1
    assert set(summary["compare"]["inter_edges"]) >= {"random", "round_robin"}


def test_plan_json_digits_k_connected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "job.toml"
    job.write_text("[data]\nnumber_of_clients = 300\ndirichlet_beta = 0.1\n"
                   "[topology]\nkind = 'k_connected'\nclient_k_neighbors = 3\n"
                   "k_connected_mode = 'similarity'\n")
    assert main(["plan", str(job), "--clusters", "a:100,b:100,c:100", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    inter = summary["compare"]["inter_edges"]
    assert summary["edges"]["inter"] == inter["locality"]
    assert inter["locality"] * 3 <= inter["random"]
    assert set(summary["stage_seconds"]) == {"histograms", "communities", "topology",
                                             "placement", "routing"}


def test_plan_out_writes_placement_and_routing(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan"
    assert main(["plan", str(DEMO), "--clusters", "a:12,b:12,c:12", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "communities:" in text and "edges: intra=" in text
    # the expected traffic between clusters: transfers x the model's bytes (the demo's mlp:
    # 64 x 64 + 64 + 64 x 10 + 10 float32), and star's on the same placement
    line = next(x for x in text.splitlines() if x.startswith("between clusters per round:"))
    plan = json.loads((out / "plan.json").read_text())
    ours, star = (plan["inter_cluster_transfers_per_round"],
                  plan["star_inter_cluster_transfers_per_round"])
    assert 0 < ours < star
    assert f"{ours} model transfers (star: {star})" in line
    assert f"{ours * MLP_BYTES / 1e6:.2f} MB (star: {star * MLP_BYTES / 1e6:.2f} MB)" in line
    placement = json.loads((out / "placement.json").read_text())
    assert len(placement["client_cluster"]) == 30 and len(placement["client_community"]) == 30
    routing = RoutingMatrix.from_bytes((out / "routing.msgpack").read_bytes())
    assert routing.num_clients == 30
    readable = json.loads((out / "routing.json").read_text())
    assert readable["edges"]["intra"] + readable["edges"]["inter"] == sum(routing.edge_counts())
    for client, cluster in placement["client_cluster"].items():
        assert routing.cluster_of(client) == cluster


@pytest.mark.parametrize(("args", "needle"), [
    (["--clusters", "a:5,b:5"], "total cluster capacity 10 is less than"),
    (["--clusters", "a=5"], "'a=5' is not ID:CAPACITY"),
    (["--clusters", "a:20,a:20"], "repeated: a"),
    (["--strategy", "precomputed"], "needs placement.precomputed_file"),
])
def test_plan_errors_are_one_line(args: list[str], needle: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(DEMO), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and err.startswith("fedpilot-scheduler: error:")


def test_bad_job_file_via_console_script(tmp_path: Path) -> None:
    job = tmp_path / "bad.toml"
    job.write_text("[training]\nnumber_of_epochs = -2\n")
    exe = Path(sys.executable).with_name("fedpilot-scheduler")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "scheduler.cli"]
    out = subprocess.run([*cmd, "plan", str(job)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0
    assert f"{job}: training.number_of_epochs = -2 is invalid" in out.stderr


def test_help_documents_every_flag() -> None:
    parser = build_parser()
    top = parser.format_help()
    assert "plan" in top and "submit" in top and "--log-level" in top
    subparsers = next(a for a in parser._actions if a.dest == "command")
    plan = subparsers.choices["plan"]  # type: ignore[attr-defined]
    for action in plan._actions:
        assert action.help, f"plan flag {action.option_strings or action.dest} has no help"


def test_plan_shows_the_dp_noise_before_the_job_runs(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The noise multiplier the budget allows, and its norm on a round's mean update in
    clip norms: z sqrt(parameters) / clients a round (central), z sqrt(parameters / m) (local)."""
    from fedcore import dp

    job = tmp_path / "job.toml"
    base = ("[data]\nnumber_of_clients = 100\n[training]\nfederated_learning_rounds = 12\n"
            "client_fraction = 0.5\n")
    job.write_text(base + "[privacy]\ndp = 'central'\nepsilon = 8.0\ndelta = 1e-5\n")
    assert main(["plan", str(job), "--clusters", "a:50,b:50", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["privacy"]
    z = dp.noise_for(8.0, 1e-5, 0.5, 12)
    assert 0.5 < z < 5 and p["noise_multiplier"] == round(z, 4)
    assert p["parameters"] == MLP_BYTES // 4 and p["clients_per_round"] == 50
    assert p["noise_over_clip_norm"] == round(z * (MLP_BYTES // 4) ** 0.5 / 50, 3)
    # local DP: each client's own noise, so the mean's falls only with sqrt(m); no budget
    job.write_text(base + "[privacy]\ndp = 'local'\nnoise_multiplier = 1.5\n")
    assert main(["plan", str(job), "--clusters", "a:50,b:50"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("privacy:"))
    assert "local DP, noise multiplier 1.5 (delta" in line
    assert f"norm {1.5 * (MLP_BYTES // 4 / 50) ** 0.5:.2f} x clip_norm" in line
    job.write_text(base)
    assert main(["plan", str(job), "--clusters", "a:50,b:50", "--json"]) == 0
    assert "privacy" not in json.loads(capsys.readouterr().out)


def test_plan_says_when_the_data_is_standardized(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A table off a unit scale: `plan` says the job standardizes it (data.standardize,
    fedcore.data.scaling), in text and --json; digits ([0, 1]) and "none": no line."""
    rng = np.random.default_rng(0)
    x = rng.normal(500.0, 40.0, (60, 3))
    table = tmp_path / "t.csv"
    table.write_text("a,b,c,label\n" + "\n".join(f"{r[0]:.3f},{r[1]:.3f},{r[2]:.3f},{i % 2}"
                                                 for i, r in enumerate(x)) + "\n")
    job = tmp_path / "job.toml"
    body = f"[data]\ndataset = 'csv:{table}'\nnumber_of_clients = 6\n"
    job.write_text(body)
    assert main(["plan", str(job), "--clusters", "a:3,b:3", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["data_scaling"]
    assert found["applied"] and found["groups"] == 3 and found["largest"] > 400
    assert main(["plan", str(job), "--clusters", "a:3,b:3"]) == 0
    assert "data: standardized over 3 feature(s)" in capsys.readouterr().out
    job.write_text(body + "standardize = 'none'\n")
    assert main(["plan", str(job), "--clusters", "a:3,b:3"]) == 0
    assert "data: standardized" not in capsys.readouterr().out
    assert main(["plan", str(DEMO), "--clusters", "a:10,b:10,c:10", "--json"]) == 0
    assert not json.loads(capsys.readouterr().out)["data_scaling"]["applied"]


def test_plan_warns_a_ring_job_that_trains_a_fraction_of_its_clients(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A ring at client_fraction 0.3 learned far slower than star (bench_learning: digits
    SmallCNN beta 0.3, 20 clients: 0.32 against 0.67): plan says so, naming both keys;
    star and k_connected at the same fraction (k_connected 0.70 there since a round mixes
    its participants' neighbours too), and a ring with every client, say nothing."""
    job = tmp_path / "job.toml"
    base = "[data]\nnumber_of_clients = 30\n[training]\nclient_fraction = {f}\n[topology]\nkind = '{k}'\n"
    job.write_text(base.format(f=0.3, k="ring"))
    assert main(["plan", str(job), "--clusters", "a:15,b:15", "--json"]) == 0
    (warning,) = json.loads(capsys.readouterr().out)["warnings"]
    assert "topology.kind = 'ring'" in warning and "client_fraction = 0.3" in warning
    assert "use k_connected, star or hybrid" in warning
    assert main(["plan", str(job), "--clusters", "a:15,b:15"]) == 0
    assert any(x.startswith("warning: topology.kind = 'ring'")
               for x in capsys.readouterr().out.splitlines())
    for f, k in ((0.3, "star"), (0.3, "k_connected"), (1.0, "ring")):
        job.write_text(base.format(f=f, k=k))
        assert main(["plan", str(job), "--clusters", "a:15,b:15", "--json"]) == 0
        assert "warnings" not in json.loads(capsys.readouterr().out)
    # a robust aggregator in a decentralized job at a fraction < 1 votes over few models
    # (synthetic histograms: the warnings do not depend on the data)
    robust = base + "[aggregation]\nname = '{a}'\n"
    job.write_text(robust.format(f=0.3, k="k_connected", a="median"))
    assert main(["plan", str(job), "--clusters", "a:15,b:15", "--json",
                 "--synthetic-histograms"]) == 0
    (warning,) = json.loads(capsys.readouterr().out)["warnings"]
    # 30 clients: k = ceil(log2 30) + 1 = 6 neighbours, 1 + 6 x 0.3 = 2.8 models
    assert "aggregation.name = 'median' on k_connected" in warning
    assert "about 2.8 models a round (with every client 7)" in warning and "from 3" in warning
    job.write_text(robust.format(f=0.3, k="ring", a="trimmed_mean"))
    assert main(["plan", str(job), "--clusters", "a:15,b:15", "--json",
                 "--synthetic-histograms"]) == 0
    ring, trimmed = json.loads(capsys.readouterr().out)["warnings"]
    assert "topology.kind = 'ring'" in ring and "about 1.6 models" in trimmed
    assert "from 10" in trimmed  # trim_ratio 0.1 trims one of 10
    # ... and trimmed_mean at its default 0.1 trims none of a k_connected node's 7
    job.write_text(robust.format(f=1.0, k="k_connected", a="trimmed_mean"))
    assert main(["plan", str(job), "--clusters", "a:15,b:15", "--json",
                 "--synthetic-histograms"]) == 0
    (warning,) = json.loads(capsys.readouterr().out)["warnings"]
    assert "(7 models)" in warning and "trims none" in warning and "1 / 7" in warning
    for f, k, a in ((1.0, "k_connected", "median"), (0.3, "star", "median"),
                    (0.3, "k_connected", "fedavg"), (1.0, "ring", "median"),
                    (1.0, "star", "trimmed_mean")):
        job.write_text(robust.format(f=f, k=k, a=a))
        assert main(["plan", str(job), "--clusters", "a:15,b:15", "--json",
                     "--synthetic-histograms"]) == 0
        assert "warnings" not in json.loads(capsys.readouterr().out)
