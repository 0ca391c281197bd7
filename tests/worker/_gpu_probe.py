"""Child of test_gpu_ray.py: a Ray cluster that *declares* one GPU (none need exist), a
NodeManager whose client actors reserve `training.num_gpus` each, and what the actors got.
Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from fedcore.data import client_data, load_dataset
    from proto.job import JobSpec
    from worker.context import RayContext
    from worker.nodes import NodeConfig, NodeManager

    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=2, num_gpus=1,
             log_to_driver=False, namespace="fedpilot-gpu-test")
    out: dict[str, object] = {}
    try:
        ctx = RayContext()
        ds = load_dataset("digits")
        for device in ("auto", "cuda"):
            spec = JobSpec.from_dict({"job": {"id": f"gpu-{device}"}, "data": {"number_of_clients": 4},
                                      "training": {"device": device, "num_gpus": 0.5}})
            cfg = NodeConfig(spec.job_id, spec.seed, spec.model, spec.training, spec.aggregation,
                             ds.input_shape, ds.num_classes)
            manager = NodeManager(ctx, cfg, ds, client_data(ds, spec.data, spec.seed), [0, 1],
                                  max_materialized=2, cpus_per_node=0.25,
                                  name_prefix=f"gpu-{device}")
            with manager:
                manager.start()
                reserved = ray.available_resources().get("GPU", 0.0)
                try:
                    infos = [ctx.get(manager.call(c, "device_info"), timeout=120) for c in (0, 1)]
                    trained = ctx.get(manager.call(0, "train", 1), timeout=120).num_samples
                    out[device] = {"infos": infos, "trained": trained, "gpu_left": reserved}
                except Exception as exc:  # noqa: BLE001 - the child reports what the actor said
                    out[device] = {"error": str(exc)[-2000:], "gpu_left": reserved}
    finally:
        ray.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
