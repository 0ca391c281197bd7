"""`[training] device` and `num_gpus` on Ray: each client actor's placement bundle reserves
its GPU share and the actor gets it (checked against Ray's *declared* GPUs, so it runs on
machines without one; a CUDA build of torch on a real GPU trains there)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from proto.job import JobSpec, JobSpecError
from worker.context import InProcessContext, PlacementError

HERE = Path(__file__).parent


@pytest.mark.slow
def test_client_actors_get_their_gpu_reservation() -> None:
    # a fresh Ray in a child: the session's test cluster declares no GPU
    proc = subprocess.run([sys.executable, str(HERE / "_gpu_probe.py")], capture_output=True,
                          text=True, timeout=300, cwd=HERE.parent.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    auto = out["auto"]
    # two slots of 0.5 GPU each: the whole declared GPU is held by the job's bundles
    assert auto["gpu_left"] == 0.0
    for info in auto["infos"]:
        assert info["gpu_ids"] == ["0"]               # Ray assigned the declared GPU ...
        assert info["cuda_visible_devices"] == "0"    # ... and torch is told to see it
        import torch

        # auto trains on the GPU when torch can see one, else on the cpu
        assert info["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert auto["trained"] > 0
    import torch

    if not torch.cuda.is_available():  # a declared GPU that is not there: cuda is refused
        assert "training.device = 'cuda'" in out["cuda"]["error"]
        assert "CUDA_VISIBLE_DEVICES='0'" in out["cuda"]["error"]


def test_gpu_keys_are_checked_together() -> None:
    with pytest.raises(JobSpecError, match="training.num_gpus = 0.0.*> 0 with training.device"):
        JobSpec.from_dict({"training": {"device": "cuda"}})
    with pytest.raises(JobSpecError, match="training.device = 'cpu'.*unused"):
        JobSpec.from_dict({"training": {"num_gpus": 0.5}})
    with pytest.raises(JobSpecError, match="training.device = 'gpu'"):
        JobSpec.from_dict({"training": {"device": "gpu"}})
    spec = JobSpec.from_dict({"training": {"device": "auto", "num_gpus": 0.25}})
    assert (spec.training.device, spec.training.num_gpus) == ("auto", 0.25)


def test_a_gpu_bundle_on_a_cluster_without_gpus_is_refused_at_once() -> None:
    with InProcessContext(num_cpus=2) as ctx, pytest.raises(PlacementError, match="GPU"):
        ctx.reserve([{"CPU": 0.25, "GPU": 0.5}], "SPREAD")
