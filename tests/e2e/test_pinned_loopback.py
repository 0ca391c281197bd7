"""Pinned data in one process (driver, executor services, round engine; fabricd replaced by
the loopback link): each cluster builds its clients from its own file only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpilot.loopback import LoopbackMesh
from proto.job import JobSpec
from scheduler.driver import Driver, JobFailed
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


def test_histograms_choose_neighbours_on_the_same_site(
        sites: dict[str, dict[str, str]]) -> None:
    similar, _ = run(pinned_job(), sites)
    random, _ = run(pinned_job(job={"id": "pinned-rand"},
                               topology={"k_connected_mode": "random"}), sites)
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
