"""Must-show: a pinned-data job over 3 real fabricd daemons, each cluster with its own
`.npz` (a different label skew) declared in its own cluster.toml [datasets]."""

from __future__ import annotations

from pathlib import Path

import pytest

from proto.job import JobSpec
from scheduler.run.mesh import daemon_status
from scheduler.testbed import LocalTestbed
from tests.e2e._faults import drive, kill_and_restart
from tests.e2e._pinned import write_site_npz

pytestmark = pytest.mark.slow

IDS = ["cluster-1", "cluster-2", "cluster-3"]
TRAIN = {"cluster-1": 150, "cluster-2": 120, "cluster-3": 180}  # tells the files apart


def pinned_job(job_id: str, mode: str) -> JobSpec:
    return JobSpec.from_dict({
        "job": {"id": job_id, "seed": 2},
        "data": {"dataset": "site", "placement": "pinned", "number_of_clients": 9,
                 "data_distribution_kind": "iid"},
        "training": {"federated_learning_rounds": 2, "number_of_epochs": 1},
        # traffic_budget = 0: the mode's graph as built (a budget adds to either graph every
        # edge that costs nothing more, so both would cross the same clusters)
        "topology": {"kind": "k_connected", "client_k_neighbors": 2, "k_connected_mode": mode,
                     "traffic_budget": 0},
        "placement": {"max_materialized": 2},
    })


def sent_bytes(testbed: LocalTestbed, job_id: str) -> int:
    return sum(int(daemon_status(testbed.bridge_socket(c)).get("jobs", {}).get(job_id, {})
                   .get("sent_bytes", 0)) for c in IDS)


def test_pinned_clients_train_where_their_data_is(tmp_path: Path) -> None:
    files = {}
    for k, cid in enumerate(IDS):
        # ROOT/<cluster>/data/ is that cluster's data root, and no other's
        files[cid] = tmp_path / cid / "data" / "site.npz"
        write_site_npz(files[cid], k, train=TRAIN[cid])
    declared = {cid: {"site": "npz:data/site.npz"} for cid in IDS}
    with LocalTestbed(3, backend="inprocess", workdir=str(tmp_path), capacity=4,
                      datasets=declared) as testbed:
        clusters = testbed.start(timeout=60)
        similar = drive(testbed, clusters, pinned_job("pinned-similar", "similarity"))
        random = drive(testbed, clusters, pinned_job("pinned-random", "random"))

        blocks = {cid: [f"c{i}" for i in range(3 * k, 3 * k + 3)] for k, cid in enumerate(IDS)}
        for result in (similar, random):
            assert len(result.summary.rounds) == 2
            placement = result.placement
            assert placement["strategy"] == "pinned"
            assert result.summary.placement_strategy == "pinned"
            assert placement["client_cluster"] == {c: cid for cid, cs in blocks.items()
                                                   for c in cs}
            assert {c.cluster_id: c.clients for c in result.summary.clusters} == \
                {cid: 3 for cid in IDS}
        for job_id in ("pinned-similar", "pinned-random"):
            for cid in IDS:
                log = (tmp_path / cid / f"executor-{job_id}.log").read_text()
                # its own file (told apart by its size), for its own clients only ...
                assert (f"dataset=site path=npz:{files[cid]} clients={','.join(blocks[cid])} "
                        f"samples={TRAIN[cid]}") in log
                assert "local_clients=3" in log
                # ... and no other cluster's file was named, let alone opened
                for other in IDS:
                    if other != cid:
                        assert str(files[other]) not in log
        # the histograms still shape who exchanges with whom: neighbours chosen by label
        # similarity stay on their site, random ones cross clusters; the daemons counted
        # every inter-cluster byte of both (rounds + the final model's streams)
        for job_id, result in (("pinned-similar", similar), ("pinned-random", random)):
            summary = result.summary
            assert sent_bytes(testbed, job_id) == (summary.bytes_inter_total
                                                   + summary.final_model["transfer_bytes"])
        assert similar.summary.bytes_inter_total < random.summary.bytes_inter_total


def test_a_lost_sites_clients_sit_out_until_it_is_back(tmp_path: Path) -> None:
    files = {}
    for k, cid in enumerate(IDS):
        files[cid] = tmp_path / cid / "data" / "site.npz"
        write_site_npz(files[cid], k, train=TRAIN[cid])
    victim, rounds = "cluster-2", 8
    job = JobSpec.from_dict({
        "job": {"id": "pinned-faults", "seed": 2},
        "data": {"dataset": "site", "placement": "pinned", "number_of_clients": 9,
                 "data_distribution_kind": "iid"},
        "training": {"federated_learning_rounds": rounds, "number_of_epochs": 1},
        "topology": {"kind": "star"},
        "placement": {"max_materialized": 2},
        "faults": {"lease_seconds": 6, "checkpoint_every": 1, "on_cluster_loss": "continue"}})
    declared = {cid: {"site": "npz:data/site.npz"} for cid in IDS}
    with LocalTestbed(3, backend="inprocess", workdir=str(tmp_path), capacity=4,
                      datasets=declared) as tb:
        clusters = tb.start(timeout=60)
        events: list[str] = []
        chaos = kill_and_restart(tb, victim, job.job_id, events)

        result = drive(tb, clusters, job, chaos, tmp_path / "run")
    summary = result.summary
    assert events == ["killed", "restarted", "started"]
    assert [r.round for r in summary.rounds] == list(range(1, rounds + 1))
    assert [(f["event"], f["cluster"]) for f in summary.faults] == [("lost", victim),
                                                                   ("returned", victim)]
    back = summary.faults[1]["round"]
    away = [r for r in summary.rounds if victim not in r.by_cluster]
    assert away  # rounds ran without the site: its three clients sat out, nobody else's moved
    assert all(r.participants == 6 for r in away)
    after = [r for r in summary.rounds if r.round >= back]
    assert after and all(victim in r.by_cluster and r.participants == 9 for r in after)
    assert "sitting_out" not in result.placement
    assert result.placement["client_cluster"] == {f"c{i}": IDS[i // 3] for i in range(9)}
    # the restarted site built its own clients from its own file again, and only that
    log = (tmp_path / victim / "executor-pinned-faults.log").read_text()
    mine = f"dataset=site path=npz:{files[victim]} clients=c3,c4,c5 samples={TRAIN[victim]}"
    assert log.count(mine) == 2
    assert all(str(files[other]) not in log for other in IDS if other != victim)


def test_the_sites_trials_lower_a_rate_that_kills_the_model_over_real_daemons(
        tmp_path: Path) -> None:
    """A model class of the user's own on pinned data, over 3 fabricd daemons: each site's
    executor tries the job's learning rate on its own samples at job.start, the replies
    cross the mesh, and the plan carries the sites' median to every executor. The
    tutorials' BatchNorm CNN dies at sgd 0.05; at the sites' rate it learns."""
    import sys

    import numpy as np

    from scheduler.testbed import job_allowances

    bench = Path(__file__).resolve().parents[2] / "bench"
    sys.path.insert(0, str(bench))
    import bench_learning as bl

    with np.load(bl.mnist_npz(tmp_path, 100, 30).split(":", 1)[1]) as src:
        for k, cid in enumerate(IDS):
            (tmp_path / cid / "data").mkdir(parents=True)
            np.savez(tmp_path / cid / "data" / "site.npz", num_classes=np.int64(10),
                     **{key: src[key][k::3] for key in ("x_train", "y_train", "x_test",
                                                        "y_test")})
    job = JobSpec.from_dict({
        "job": {"id": "pinned-trial", "seed": 2},
        "data": {"dataset": "site", "placement": "pinned", "number_of_clients": 6,
                 "data_distribution_kind": "iid"},
        "model": {"name": "usercnn:TutorialCNN"},
        "training": {"federated_learning_rounds": 2, "number_of_epochs": 1},
        "topology": {"kind": "star"}, "aggregation": {"name": "fedavg"},
        "placement": {"max_materialized": 2}})
    declared = {cid: {"site": "npz:data/site.npz"} for cid in IDS}
    said: list[str] = []
    with LocalTestbed(3, backend="inprocess", workdir=str(tmp_path), capacity=4,
                      datasets=declared, allow=job_allowances(job)) as tb:
        clusters = tb.start(timeout=60)
        result = drive(tb, clusters, job, stage=said.append)
    lowered = [line for line in said if "did not train model.name 'usercnn:TutorialCNN'" in line]
    assert lowered and "their median" in lowered[0], said
    rates = set()
    for cid in IDS:
        log = (tmp_path / cid / "executor-pinned-trial.log").read_text()
        assert "event=learning_rate_trial" in log and "rate=0.05 " in log
        rates |= {line.split("rate=")[-1].split()[0] for line in log.splitlines()
                  if "event=learning_rate_lowered" in line}
    assert len(rates) == 1 and float(rates.pop()) < 0.05, rates
    assert result.summary.rounds[-1].accuracy > 0.3, [r.accuracy for r in result.summary.rounds]
