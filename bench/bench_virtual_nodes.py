"""Create 1,000,000 VirtualNodes; print RSS and seconds, next to a plain tuple-list baseline.

Each variant runs in a fresh child process so its RSS is not polluted by the other:
`virtual_nodes` builds `list(map(VirtualNode, range(n), repeat(config)))` sharing one NodeConfig;
`tuple_baseline` builds `list(zip(range(n), repeat(config)))`, the smallest Python record with
the same two fields; `node_manager` builds a NodeManager over n clients (its VirtualNodes
plus bookkeeping, no actor), the path a real job takes. Goal: <= 300 MB and <= 3 s for the VirtualNodes.

    python bench/bench_virtual_nodes.py [--quick] [--nodes N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from itertools import repeat

VARIANTS = ("tuple_baseline", "virtual_nodes", "node_manager")


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(variant: str, n: int) -> dict[str, float]:
    from proto.job import JobSpec
    from worker.nodes import NodeConfig, VirtualNode

    spec = JobSpec()
    config = NodeConfig(spec.job_id, spec.seed, spec.model, spec.training, spec.aggregation,
                        (64,), 10)
    before = rss_mb()
    start = time.perf_counter()
    if variant == "virtual_nodes":
        nodes: object = list(map(VirtualNode, range(n), repeat(config)))
    elif variant == "node_manager":
        from worker.context import InProcessContext
        from worker.nodes import NodeManager

        nodes = NodeManager(InProcessContext(2), config, None, None,  # type: ignore[arg-type]
                            range(n), max_materialized=8).virtual_nodes
    else:
        nodes = list(zip(range(n), repeat(config)))
    seconds = time.perf_counter() - start
    after = rss_mb()
    assert len(nodes) == n  # type: ignore[arg-type]
    return {"seconds": round(seconds, 3), "rss_mb": round(after, 1),
            "rss_delta_mb": round(after - before, 1),
            "bytes_per_node": round((after - before) * 1024 * 1024 / n, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100,000 nodes instead of 1e6")
    parser.add_argument("--nodes", type=int, default=None)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    n = args.nodes or (100_000 if args.quick else 1_000_000)
    if args.child:
        print(json.dumps(child(args.child, n)))
        return
    results = {}
    for variant in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--child", variant, "--nodes", str(n)],
                             check=True, capture_output=True, text=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    vn, base = results["virtual_nodes"], results["tuple_baseline"]
    print(json.dumps({
        "bench": "virtual_nodes",
        "nodes": n,
        "virtual_nodes": vn,
        "baseline_tuple_list": base,
        "node_manager": results["node_manager"],
        "ratio_rss_delta": round(vn["rss_delta_mb"] / max(base["rss_delta_mb"], 1e-9), 2),
        "ratio_seconds": round(vn["seconds"] / max(base["seconds"], 1e-9), 2),
        "goal": {"rss_mb_max": 300, "seconds_max": 3.0},
        "meets_goal": vn["rss_mb"] <= 300 and vn["seconds"] <= 3.0,
    }))


if __name__ == "__main__":
    main()
