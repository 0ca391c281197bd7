"""Pinned data in one process (driver, executor services, round engine; fabricd replaced by
the loopback link): each cluster builds its clients from its own file only."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpilot.loopback import LoopbackMesh
from proto.job import JobSpec
from scheduler.run.driver import Driver, JobFailed
from tests.e2e._pinned import site_classes, write_site_npz
from worker.context import InProcessContext
from worker.executor.runtime import runtime_factory

CLUSTERS = ("a", "b", "c")


def pinned_job(**sections: Any) -> JobSpec:
    base: dict[str, Any] = {
        "job": {"id": "pinned", "seed": 2},
        "data": {"dataset": "site", "placement": "pinned", "number_of_clients": 9,
                 "data_distribution_kind": "iid"},
        "training": {"federated_learning_rounds": 2, "number_of_epochs": 1},
        "topology": {"kind": "k_connected", "client_k_neighbors": 2},
        "placement": {"max_materialized": 2},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return JobSpec.from_dict(base)


def run(spec: JobSpec, declared: dict[str, dict[str, str]]) -> tuple[Any, LoopbackMesh]:
    mesh = LoopbackMesh(list(declared), lambda cid: runtime_factory(
        InProcessContext(), cid, datasets=declared[cid]), capacity=4)
    driver = Driver(spec, mesh.clusters(), mesh, backend="inprocess", timeout=120)
    try:
        return driver.run(), mesh
    finally:
        driver.close()


@pytest.fixture
def sites(tmp_path: Path) -> dict[str, dict[str, str]]:
    for k, cid in enumerate(CLUSTERS):
        write_site_npz(tmp_path / cid / "site.npz", k)
    return {cid: {"site": f"npz:{tmp_path / cid / 'site.npz'}"} for cid in CLUSTERS}


def test_every_client_trains_on_the_cluster_that_holds_its_data(
        sites: dict[str, dict[str, str]]) -> None:
    result, mesh = run(pinned_job(), sites)
    assert [r.round for r in result.summary.rounds] == [1, 2]
    placement = result.placement
    assert placement["strategy"] == "pinned"
    # clients numbered globally in contiguous blocks, each kept on its data's cluster
    expected = {f"c{i}": CLUSTERS[i // 3] for i in range(9)}
    assert placement["client_cluster"] == expected
    for k, cid in enumerate(CLUSTERS):
        runtime: Any = mesh.services[cid].runtime
        assert runtime.dataset_path == sites[cid]["site"]  # its own file, nobody else's
        own = [i for i in range(9) if expected[f"c{i}"] == cid]
        assert runtime._own == own
        hist = runtime.partition.histograms
        # its clients' samples are its file's (the site's skew), the others' are not here
        assert hist[own].sum(axis=0)[site_classes(k)].sum() > 0.7 * hist[own].sum()
        assert hist[[i for i in range(9) if i not in own]].sum() == 0
    # every cluster corrects personalized accuracy against the label mix of all sites
    # (the scheduler's column sums; no cluster sees the others' clients)
    pooled = sum(mesh.services[cid].runtime.partition.histograms.sum(axis=0) for cid in CLUSTERS)
    for cid in CLUSTERS:
        assert mesh.services[cid].runtime._config.pooled_labels == tuple(int(k) for k in pooled)


def test_histograms_choose_neighbours_on_the_same_site(
        sites: dict[str, dict[str, str]]) -> None:
    # traffic_budget = 0: the modes' graphs as built (a budget adds to either graph every
    # edge that costs nothing more, so both would cross the same clusters)
    similar, _ = run(pinned_job(topology={"k_connected_mode": "similarity", "traffic_budget": 0}),
                     sites)
    random, _ = run(pinned_job(job={"id": "pinned-rand"},
                               topology={"k_connected_mode": "random", "traffic_budget": 0}), sites)
    assert similar.placement["client_cluster"] == random.placement["client_cluster"]
    assert 0 <= similar.summary.bytes_inter_total < random.summary.bytes_inter_total


def test_a_cluster_without_the_dataset_is_named(sites: dict[str, dict[str, str]]) -> None:
    declared = {**sites, "c": {"other": sites["c"]["site"]}}
    with pytest.raises(JobFailed, match=r"cluster c refused job.start.*'site'.*declares: other"):
        run(pinned_job(), declared)


def test_clusters_whose_files_disagree_on_classes_are_refused(
        sites: dict[str, dict[str, str]], tmp_path: Path) -> None:
    odd = tmp_path / "odd.npz"
    rng = np.random.default_rng(0)
    np.savez(odd, x_train=rng.random((60, 1, 8, 8)), y_train=np.arange(60) % 5,
             x_test=rng.random((10, 1, 8, 8)), y_test=np.arange(10) % 5)
    declared = {**sites, "b": {"site": f"npz:{odd}"}}
    with pytest.raises(JobFailed, match=r"disagree \(a, c: 10 classes.*; b: 5 classes"):
        run(pinned_job(), declared)


class Losing(LoopbackMesh):
    """The loopback mesh with a cluster that can die: its executor aborts and every
    request or update to it fails from then on, as across a dead daemon; `revive` brings
    the cluster back with a fresh executor service, as a restarted daemon would."""

    dead: set[str]

    def __init__(self, cluster_ids: list[str], make_runtime: Any, capacity: int = 0) -> None:
        super().__init__(cluster_ids, make_runtime, capacity=capacity)
        self.make_runtime = make_runtime

    def kill(self, cid: str) -> None:
        self.dead = {*getattr(self, "dead", set()), cid}
        self.services[cid].abort("killed by the test")

    def revive(self, cid: str) -> None:
        from fedpilot.loopback import _Link
        from worker.executor.service import ExecutorService

        self.services[cid] = ExecutorService(cluster_id=cid, make_runtime=self.make_runtime(cid),
                                             link=_Link(self, cid), round_timeout=120)
        self.dead = self.dead - {cid}

    def connected(self) -> dict[str, bool]:
        """What the scheduler's daemon would say of the mesh (the lease keeper asks)."""
        return {cid: cid not in getattr(self, "dead", set()) for cid in self.services}

    def request(self, cluster_id: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        if cluster_id in getattr(self, "dead", set()):
            raise JobFailed(f"cluster {cluster_id} is unreachable")
        return super().request(cluster_id, body, timeout)


def test_a_lost_clusters_pinned_clients_sit_out_until_it_returns(
        sites: dict[str, dict[str, str]], tmp_path: Path) -> None:
    spec = pinned_job(topology={"kind": "star"}, training={"federated_learning_rounds": 8},
                      faults={"on_cluster_loss": "continue", "lease_seconds": 6,
                              "checkpoint_every": 1})
    mesh = Losing(list(sites), lambda cid: runtime_factory(
        InProcessContext(), cid, datasets=sites[cid]), capacity=4)
    original = mesh.services["b"].deliver

    def deliver(**kwargs: Any) -> bool:  # a dead cluster's daemon takes no update either
        if "b" in getattr(mesh, "dead", set()):
            raise JobFailed("cluster b is unreachable")
        return original(**kwargs)

    mesh.services["b"].deliver = deliver  # type: ignore[method-assign]

    def kill_after_round_2(record: Any, total: int) -> None:
        if record.round == 2:
            # the lease keeper judges only a cluster that answered it once: let b answer
            asked = time.monotonic()
            leases = driver.leases
            assert leases is not None
            leases.renew_now()
            while leases.answered_at("b") <= asked and time.monotonic() < asked + 60:
                time.sleep(0.05)
            mesh.kill("b")
        if record.round == 4:
            mesh.revive("b")  # back in the mesh: its executor starts in the background
        if record.round == 5:  # ... and the cluster joins once it answered job.start
            started = time.monotonic()
            while (mesh.services["b"].spec is None
                   and time.monotonic() < started + 60):
                time.sleep(0.05)

    driver = Driver(spec, mesh.clusters(), mesh, backend="inprocess", timeout=120,
                    progress=kill_after_round_2, run_dir=tmp_path / "run")
    try:
        result = driver.run()
    finally:
        driver.close()
    summary = result.summary
    assert [r.round for r in summary.rounds] == list(range(1, 9))
    assert [(f["cluster"], f["event"]) for f in summary.faults] == [("b", "lost"),
                                                                    ("b", "returned")]
    returned = summary.faults[1]["round"]
    # while b was gone its clients (c3..c5) sat out instead of moving to another cluster's
    # data: the rounds trained the six others, on their own clusters
    lost_rounds = [rec for rec in summary.rounds if 2 < rec.round < returned]
    assert lost_rounds
    for rec in lost_rounds:
        assert set(rec.by_cluster) == {"a", "c"} and rec.participants == 6
    # back, b built its own three clients from its own file again, and they train there
    for rec in summary.rounds:
        if rec.round >= returned:
            assert set(rec.by_cluster) == {"a", "b", "c"} and rec.participants == 9
    assert "sitting_out" not in result.placement
    assert result.placement["client_cluster"] == {f"c{i}": CLUSTERS[i // 3] for i in range(9)}
    for cid in CLUSTERS:
        runtime: Any = mesh.services[cid].runtime
        assert runtime.dataset_path == sites[cid]["site"]
        assert runtime._own == [i for i in range(9) if i // 3 == CLUSTERS.index(cid)]
        assert set(runtime._local) <= set(runtime._own)  # only its own clients trained here


def test_sites_standardize_by_statistics_they_share(tmp_path: Path) -> None:
    """Pinned sites whose pixels lie off a unit scale (0-1,000): under data.standardize
    "auto" every site standardizes by the same mean and sd, made by the scheduler from
    each site's moments (their median: no site's own), and the job learns; under "none"
    they train on the raw pixels."""
    from fedcore.data import load_dataset, moments

    declared = {}
    for k, cid in enumerate(CLUSTERS):
        write_site_npz(tmp_path / cid / "site.npz", k, scale=1000 / 16)
        declared[cid] = {"site": f"npz:{tmp_path / cid / 'site.npz'}"}
    spec = pinned_job(topology={"kind": "star"}, training={"federated_learning_rounds": 3,
                                                           "number_of_epochs": 2})
    result, mesh = run(spec, declared)
    shared = {cid: mesh.services[cid].runtime._shared_scaling for cid in CLUSTERS}
    assert len(set(shared.values())) == 1 and shared["a"] is not None
    (mean,), (sd,) = shared["a"]
    own = [moments(load_dataset(declared[cid]["site"])) for cid in CLUSTERS]
    site_means = sorted(m["mean"][0] for m in own)
    assert mean == pytest.approx(site_means[1]) and 100 < sd < 1000
    for cid in CLUSTERS:
        x = mesh.services[cid].runtime.dataset.x_train
        raw = load_dataset(declared[cid]["site"]).x_train
        np.testing.assert_allclose(x, (raw - mean) / sd, rtol=1e-4, atol=1e-4)
    # a later plan with other statistics (a replayed or forged one) changes nothing
    runtime: Any = mesh.services["a"].runtime
    before = runtime.dataset
    with pytest.raises(ValueError, match="differs"):
        runtime.standardize([mean + 1.0], [sd])
    assert runtime.dataset is before and runtime._shared_scaling == shared["a"]
    runtime.standardize([mean], [sd])  # the same again: nothing to do
    assert runtime.dataset is before
    learned = result.summary.rounds[-1].accuracy
    raw_job, _ = run(pinned_job(data={"standardize": "none"}, topology={"kind": "star"},
                                training={"federated_learning_rounds": 3,
                                          "number_of_epochs": 2}), declared)
    assert learned > 0.5 and learned > raw_job.summary.rounds[-1].accuracy + 0.2, (
        learned, raw_job.summary.rounds[-1].accuracy)


def test_a_site_with_malformed_moments_fails_the_job_named(
        sites: dict[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A site whose job.start moments are not finite numbers: the job fails naming it,
    before any plan."""
    from worker.executor.runtime import NodeRuntime

    real = NodeRuntime.data_moments

    def lying(self: NodeRuntime) -> Any:
        found = real(self)
        return {**found, "var": [-1.0] * len(found["var"])} if self.cluster_id == "b" else found

    monkeypatch.setattr(NodeRuntime, "data_moments", lying)
    with pytest.raises(JobFailed, match="site b: data moments"):
        run(pinned_job(data={"standardize": "features"}), sites)


BENCH = Path(__file__).resolve().parents[2] / "bench"


def user_model_job(model: str = "usercnn:SmallCNN", **training: Any) -> JobSpec:
    """A star FedAvg job with a model class of the user's own (bench/usercnn.py)."""
    return pinned_job(model={"name": model}, topology={"kind": "star"},
                      aggregation={"name": "fedavg"}, data={"number_of_clients": 6},
                      training={"federated_learning_rounds": 2, "number_of_epochs": 1,
                                **training})


@pytest.fixture
def usercnn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))


@pytest.fixture(scope="module")
def mnist_sites(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """bench_learning's MNIST subset (1,000 training images) split among the 3 sites."""
    import sys

    sys.path.insert(0, str(BENCH))
    import bench_learning as bl

    out = tmp_path_factory.mktemp("mnist-sites")
    with np.load(bl.mnist_npz(out, 100, 30).split(":", 1)[1]) as src:
        for k, cid in enumerate(CLUSTERS):
            np.savez(out / f"{cid}.npz", num_classes=np.int64(10),
                     **{key: src[key][k::3] for key in ("x_train", "y_train", "x_test", "y_test")})
    return {cid: {"site": f"npz:{out / cid}.npz"} for cid in CLUSTERS}


def test_sites_trials_choose_the_learning_rate_their_clients_train_at(
        mnist_sites: dict[str, dict[str, str]], usercnn: None) -> None:
    """A pinned job's data is on its sites, so `submit` cannot try the job's rate on it:
    each site tries it on its own samples at job.start and every client trains at the
    median of the rates they chose. The tutorials' BatchNorm CNN dies at sgd 0.05
    (momentum 0.9): as given it stays near a uniform guess; at the sites' rate it learns."""
    result, mesh = run(user_model_job("usercnn:TutorialCNN"), mnist_sites)
    rates = {mesh.services[cid].runtime._config.training.learning_rate for cid in CLUSTERS}
    assert len(rates) == 1 and rates.pop() < 0.05
    record = result.summary.learning_rate   # summary.json says so
    assert record["job"] == 0.05 and set(record["sites"]) == set(CLUSTERS)
    assert record["trained_at"] == sorted(record["sites"].values())[1] < 0.05, record
    learned = [r.accuracy for r in result.summary.rounds]
    off, mesh = run(user_model_job("usercnn:TutorialCNN", learning_rate_check="off"),
                    mnist_sites)
    assert {mesh.services[cid].runtime._config.training.learning_rate
            for cid in CLUSTERS} == {0.05}
    as_given = [r.accuracy for r in off.summary.rounds]
    assert off.summary.learning_rate == {}
    assert max(as_given) < 0.1 + 0.15 and learned[-1] > as_given[-1] + 0.2, (learned, as_given)


def test_a_site_that_lies_about_its_trial_moves_the_rate_no_further_than_honest_ones(
        sites: dict[str, dict[str, str]], usercnn: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One site of three reports the smallest rate a trial can choose (or the largest):
    the median stays within the honest sites' own rates (1 and 2). A rate no trial can
    have chosen fails the job before any plan, naming the site and the field."""
    from worker.executor.runtime import NodeRuntime

    real = NodeRuntime.learning_rate_trial
    told: dict[str, Any] = {}

    def lying(self: NodeRuntime) -> Any:
        found = real(self)
        return {**found, **told} if self.cluster_id == "b" and found else found

    monkeypatch.setattr(NodeRuntime, "learning_rate_trial", lying)
    for rate, expected in ((8.0 / 256, 1.0), (8.0, 2.0)):
        told.update(learning_rate=rate)
        _, mesh = run(user_model_job(learning_rate=8.0, federated_learning_rounds=1), sites)
        rates = {mesh.services[cid].runtime._config.training.learning_rate for cid in CLUSTERS}
        assert rates == {expected}, (rate, rates)
    # a later plan (replayed or forged) cannot change the rate the clients train at
    runtime: Any = mesh.services["a"].runtime
    for other, needle in ((16.0, "may only lower it"), (0.5, "a job keeps its first")):
        with pytest.raises(ValueError, match=needle):
            runtime.set_learning_rate(other)
    runtime.set_learning_rate(2.0)   # the same again: nothing to do
    assert runtime._config.training.learning_rate == runtime.spec.training.learning_rate == 2.0
    told.update(learning_rate=0.0123)
    with pytest.raises(JobFailed, match=r"cluster b: field 'learning_rate_trial\.learning_rate'"):
        run(user_model_job(learning_rate=8.0, federated_learning_rounds=1), sites)
