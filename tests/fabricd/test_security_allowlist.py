"""The cluster operator's allow-lists (worker/executor/allowlist.py): a job naming a module or data path outside them is
refused before anything is imported or opened, naming the cluster.toml key to change."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from fabricd.config import load_config
from fabricd.executors import ENV_ALLOWED_MODULES, ENV_DATA_ROOTS, ExecutorLauncher
from proto.job import JobSpec
from tests.fabricd._harness import cli_inprocess
from worker.executor.allowlist import ENV_DATA_ROOTS as W_ROOTS
from worker.executor.allowlist import ENV_MODULES as W_MODULES
from worker.executor.allowlist import JobNotAllowed, check_job, check_job_from_environment


def spec(**sections: object) -> JobSpec:
    return JobSpec.from_dict({"job": {"id": "j"}, **sections}, source="test")


def test_a_module_outside_the_list_is_refused_before_import(tmp_path: Path) -> None:
    name = "evil_lab_models_never_imported"
    job = spec(model={"name": f"{name}.nets:Net"})
    with pytest.raises(JobNotAllowed, match=r"\[allow\] models in cluster.toml") as err:
        check_job(job, ["mylab.models"], [tmp_path], cluster_id="lab-a")
    assert "model.name" in str(err.value) and "lab-a" in str(err.value)
    assert name not in sys.modules
    check_job(job, [name], [tmp_path])  # allowed once the operator lists it (and submodules)
    check_job(spec(model={"name": "cnn"}), [], [])  # built-in models need no entry
    with pytest.raises(JobNotAllowed, match="aggregation.name"):
        check_job(spec(aggregation={"name": "x.y:Agg"}), [], [])


def test_a_data_path_outside_the_roots_is_refused_before_it_is_opened(tmp_path: Path) -> None:
    roots = tmp_path / "data"
    roots.mkdir()
    outside = tmp_path / "secret.npz"
    outside.write_bytes(b"not even an npz")  # never opened: the check is on the path alone
    with pytest.raises(JobNotAllowed, match=r"\[allow\] data_roots in cluster.toml"):
        check_job(spec(data={"dataset": f"npz:{outside}"}), [], [roots])
    # A symlink inside a root that points out of it is refused too.
    (roots / "link.npz").symlink_to(outside)
    with pytest.raises(JobNotAllowed, match="outside the data roots"):
        check_job(spec(data={"dataset": f"npz:{roots / 'link.npz'}"}), [], [roots])
    with pytest.raises(JobNotAllowed, match="outside the data roots"):
        check_job(spec(data={"dataset": f"npz:{roots}/../secret.npz"}), [], [roots])
    check_job(spec(data={"dataset": f"npz:{roots / 'ok.npz'}"}), [], [roots])
    check_job(spec(data={"dataset": f"csv:{roots / 'd.csv'}#label=y"}), [], [roots])
    check_job(spec(), [], [])  # the built-in dataset needs no root


def test_fabricd_hands_its_cluster_toml_lists_to_the_executor(tmp_path: Path) -> None:
    assert (ENV_ALLOWED_MODULES, ENV_DATA_ROOTS) == (W_MODULES, W_ROOTS)
    ca = tmp_path / "ca"
    cli_inprocess("certs", "init-ca", "--out", str(ca))
    cli_inprocess("init", "--cluster-id", "a", "--listen", "/ip4/127.0.0.1/tcp/1", "--ca", str(ca),
                  "--out", str(tmp_path / "a"))
    cfg_path = tmp_path / "a" / "cluster.toml"
    config = load_config(cfg_path)
    assert config.allow_models == () and config.data_roots == (tmp_path / "a" / "data",)
    cfg_path.write_text(cfg_path.read_text() + '\n[allow]\nmodels = ["mylab"]\ndata_roots = ["/srv/fl"]\n')
    config = load_config(cfg_path)
    launcher = ExecutorLauncher(cluster_id="a", bridge_socket=config.bridge_socket, ray_address="inprocess",
                                log_dir=tmp_path, allow_models=config.allow_models,
                                data_roots=config.data_roots)
    env = launcher.env
    assert json.loads(env[ENV_ALLOWED_MODULES]) == ["mylab"]
    assert json.loads(env[ENV_DATA_ROOTS]) == ["/srv/fl"]
    with pytest.raises(JobNotAllowed, match="data_roots"):
        check_job_from_environment(spec(data={"dataset": f"npz:{tmp_path}/x.npz"}), env=env)
    check_job_from_environment(spec(model={"name": "mylab.m:Net"}), env=env)
    # No lists in the environment (not launched by fabricd): no policy to apply.
    check_job_from_environment(spec(data={"dataset": f"npz:{tmp_path}/x.npz"}), env=dict(os.environ))
