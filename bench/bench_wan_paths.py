"""Which path should a large update take between two sites behind NAT? The WAN testbed
(deploy/netns-testbed.sh up --wan: three sites, each behind a NAT router namespace, and a
gateway that relays), three ways, in one run:

  relayed_spliced   hole punching off: the link stays relayed, the body goes over the
                    data plane spliced by the gateway (fabricd/_splice.py) - the baseline
  upgraded_spliced  the default: DCUtR punched the link (fabricd/_holepunch.py), the body
                    is still spliced (the data plane's port is out of reach)
  upgraded_libp2p   punched, and the sites' data plane off (limits.dataplane_min_bytes = 0):
                    the body over the punched libp2p connection itself

Each: the testbed up, every site-to-site link the expected kind, `fabricd probe` from site
c to site a (--probes times, --mb MiB each), the testbed down. Prints one JSON object:
each way's throughputs and median, and their ratios to the baseline. Needs root, network
namespaces and iptables (exits 2 saying why otherwise); about a minute a way.

    sudo .venv/bin/python bench/bench_wan_paths.py --rate 10gbit --rtt-ms 10
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "deploy" / "netns-testbed.sh"
FABRICD = Path(sys.executable).with_name("fabricd")
SITES = ("a", "b", "c")
WAYS = {
    "relayed_spliced": ({"FP_WAN_HOLE_PUNCHING": "0"}, "relayed"),
    "upgraded_spliced": ({}, "upgraded"),
    "upgraded_libp2p": ({"FP_WAN_SITE_LIMITS": "dataplane_min_bytes = 0"}, "upgraded"),
}


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, iptables)"
    for tool in ("ip", "iptables", "tc"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    return None


def status(env: dict[str, str], site: str) -> dict[str, Any]:
    out = subprocess.run(["ip", "netns", "exec", f"{env['FP_NETNS_PREFIX']}-{site}", str(FABRICD),
                          "status", "--config", f"{env['FP_STATE_DIR']}/{site}/cluster.toml"],
                         capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def links_are(env: dict[str, str], kind: str, deadline_s: float) -> dict[str, dict[str, str]]:
    """Wait until every site's link to every other site is ``kind``; the links seen last."""
    deadline = time.monotonic() + deadline_s
    while True:
        links = {s: {c["cluster_id"]: c["link"] for c in status(env, s).get("clusters", [])
                     if c["cluster_id"] in SITES} for s in SITES}
        if all(set(v.values()) == {kind} and len(v) == len(SITES) - 1 for v in links.values()):
            return links
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_wan_paths: links not {kind} within {deadline_s:.0f} s: {links}")
        time.sleep(1.0)


def way(name: str, extra: dict[str, str], kind: str, args: argparse.Namespace) -> dict[str, Any]:
    scratch = tempfile.mkdtemp(prefix="fp-wanpaths-")
    state = f"{scratch}/state"  # netns-testbed.sh makes it (and refuses one it did not make)
    env = {**os.environ, "FP_NETNS_PREFIX": "fpwp", "FP_STATE_DIR": state, "FP_SCHEDULER": "1",
           "FP_WAN_RTT_MS": str(args.rtt_ms), "FP_WAN_LOSS": str(args.loss), "FP_WAN_RATE": args.rate,
           "FABRICD": str(FABRICD), "PYTHON": sys.executable, **extra}
    subprocess.run([str(SCRIPT), "down"], env=env, capture_output=True, timeout=120)
    try:
        up = subprocess.run([str(SCRIPT), "up", "--wan"], env=env, capture_output=True, text=True, timeout=300)
        if up.returncode != 0:
            raise SystemExit(f"bench_wan_paths: {name}: testbed up failed:\n{up.stderr[-3000:]}")
        links_are(env, kind, args.deadline)
        speeds, paths = [], {}
        for _ in range(args.probes):
            probe = subprocess.run(
                ["ip", "netns", "exec", "fpwp-c", str(FABRICD), "probe", "--config", f"{state}/c/cluster.toml",
                 "--cluster", "a", "--bytes", str(args.mb << 20)], capture_output=True, text=True, timeout=600)
            if probe.returncode != 0:
                raise SystemExit(f"bench_wan_paths: {name}: probe failed: {probe.stderr[-2000:]}")
            speeds.append(float(json.loads(probe.stdout)["throughput_mb_s"]))
            print(f"bench_wan_paths: {name}: {speeds[-1]:.1f} MB/s", file=sys.stderr, flush=True)
        paths = status(env, "c").get("transfer", {}).get("bytes_by_path", {})
        return {"throughput_mb_s": speeds, "median_mb_s": round(statistics.median(speeds), 2),
                "bytes_by_path": {k: v for k, v in paths.items() if v}}
    finally:
        subprocess.run([str(SCRIPT), "down"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="10gbit", help="each site uplink's rate, tc units (10gbit)")
    ap.add_argument("--rtt-ms", type=int, default=10, help="round-trip time added per uplink (10)")
    ap.add_argument("--loss", type=float, default=0.0, help="loss in %% each way per uplink (0)")
    ap.add_argument("--mb", type=int, default=64, help="MiB a probe (64)")
    ap.add_argument("--probes", type=int, default=3, help="probes a way (3)")
    ap.add_argument("--deadline", type=float, default=90.0, help="seconds the links get to be as expected")
    ap.add_argument("--ways", default=",".join(WAYS), help="comma-separated, of " + ", ".join(WAYS))
    args = ap.parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"bench_wan_paths: {reason}", file=sys.stderr)
        return 2
    results = {name: way(name, *WAYS[name], args) for name in args.ways.split(",") if name}
    base = results.get("relayed_spliced", {}).get("median_mb_s")
    report: dict[str, Any] = {"benchmark": "wan_paths", "rate": args.rate, "rtt_ms": args.rtt_ms,
                              "loss_pct": args.loss, "mb": args.mb, "ways": results}
    if base:
        report["ratio_to_relayed_spliced"] = {n: round(r["median_mb_s"] / base, 3) for n, r in results.items()}
    if "upgraded_spliced" in results and "upgraded_libp2p" in results:
        report["spliced_over_punched_libp2p"] = round(
            results["upgraded_spliced"]["median_mb_s"] / results["upgraded_libp2p"]["median_mb_s"], 3)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
