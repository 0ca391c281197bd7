"""Fault-handling pieces without processes: the `[faults]` table, lease bookkeeping."""

from __future__ import annotations

from typing import Any

import pytest

from proto.errors import ControlMessageError
from proto.job import JobSpec, JobSpecError
from worker.executor.service import ExecutorService


def test_faults_table_is_validated_and_round_trips() -> None:
    spec = JobSpec.from_dict({"faults": {"lease_seconds": 5, "checkpoint_every": 2,
                                         "on_cluster_loss": "continue", "min_clusters": 2}})
    assert spec.faults.checkpoint_every == 2 and spec.faults.on_cluster_loss == "continue"
    assert JobSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(JobSpecError, match="faults.on_cluster_loss"):
        JobSpec.from_dict({"faults": {"on_cluster_loss": "ignore"}})
    with pytest.raises(JobSpecError, match="faults.lease_seconds"):
        JobSpec.from_dict({"faults": {"lease_seconds": 0.5}})


def test_a_lease_is_renewed_by_the_scheduler_and_bad_ones_refused() -> None:
    service = ExecutorService(cluster_id="x", make_runtime=lambda spec: None)  # type: ignore[arg-type,return-value]
    reply = service.handle({"kind": "job.lease", "job_id": "j", "lease": 7})
    assert reply == {"round": 0, "started": False}
    assert service.lease_seconds == 7 and 6 < service.lease_left() <= 7
    with pytest.raises(ControlMessageError, match="job.lease: field 'lease'"):
        service.handle({"kind": "job.lease", "job_id": "j", "lease": "forever"})
    service.abort("test")
    assert service.stopped.is_set()


def test_cluster_toml_ray_bounds_reach_the_executor_command(tmp_path: Any) -> None:
    from fabricd.executors import ExecutorLauncher

    launcher = ExecutorLauncher(cluster_id="a", bridge_socket=tmp_path / "s", ray_address="local",
                                log_dir=tmp_path, num_cpus=2, object_store_memory=200 << 20)
    command = launcher.command_for("j")
    assert command[-4:] == ["--num-cpus", "2", "--object-store-memory", str(200 << 20)]
    unbounded = ExecutorLauncher(cluster_id="a", bridge_socket=tmp_path / "s",
                                 ray_address="local", log_dir=tmp_path).command_for("j")
    assert "--num-cpus" not in unbounded and "--object-store-memory" not in unbounded
