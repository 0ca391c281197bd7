"""What the security limits cost a federation, on real fabricd daemons on 127.0.0.1.

Prints one JSON object:
- ``join``: seconds from a new member's daemon being ready until the daemon it
  bootstrapped from sees it connected and a 64 KiB probe to it succeeded, with 0 and with
  ``--strangers`` (default 300, the issue's figure) stalled strangers connected to that
  daemon (fresh keys, no certificate, member/update/control streams held open without a
  byte); ``ratio`` is the stalled case over the 0-stranger baseline measured in the same
  run. Each case uses a fresh target daemon; ``--repeats`` runs each case that often and
  reports every run and the median.
- ``revocation``: in a 5-daemon mesh, seconds from a CA-signed revocation list being
  dropped at one member until each of the other members (and that one) applied it and
  dropped the revoked cluster; ``max_s`` is when it took effect everywhere.
``--quick`` uses 30 strangers (a smoke run, not a measurement).

Measured 2026-11-23, 2 cores shared with other agents (loadavg 5-6), ``--repeats 3``:
join 0.38/0.78/1.21 s with no strangers, 1.52/1.00/1.64 s with 300 stalled strangers
(all 300 connected): median 0.78 vs 1.52 s, ratio 1.96; revocation dropped at r1 took
effect on a, r1, r2, r3 after 0.69, 1.47, 1.15, 0.82 s (everywhere after 1.47 s).
Single runs are noisy (a 30-stranger quick run joined faster than its baseline).

The daemons, strangers and helpers are the security tests' own
(tests/fabricd/_harness.py, tests/fabricd/_hostile.py, the Mesh of
tests/fabricd/conftest.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proto.certs import parse_certificate  # noqa: E402
from proto.ids import PROTOCOL_CONTROL, PROTOCOL_MEMBER, PROTOCOL_UPDATE  # noqa: E402
from tests.fabricd._harness import (  # noqa: E402
    Node,
    cli_json,
    connected_fast,
    join_and_probe,
    revocation_seconds,
    wait_until,
)
from tests.fabricd._hostile import peer_info, stalled_strangers  # noqa: E402
from tests.fabricd.conftest import Mesh  # noqa: E402

STALL_PROTOCOLS = [PROTOCOL_MEMBER, PROTOCOL_UPDATE, PROTOCOL_CONTROL]


def log(msg: str) -> None:
    print(f"bench_security: {msg}", file=sys.stderr, flush=True)


async def join_case(mesh: Mesh, bootstrap: Node, strangers: int, label: str) -> dict[str, Any]:
    """One new member joins a fresh daemon while ``strangers`` stall it."""
    target = await trio.to_thread.run_sync(lambda: mesh.add(f"t-{label}", [bootstrap.addr()]))
    await trio.to_thread.run_sync(lambda: wait_until(
        lambda: bootstrap.name in connected_fast(target), timeout=120))
    try:
        async with stalled_strangers(peer_info(target.addr()), strangers, STALL_PROTOCOLS) \
                as (hosts, refused):
            new = await trio.to_thread.run_sync(lambda: mesh.add(f"n-{label}", [target.addr()]))
            try:
                seconds, probe = await trio.to_thread.run_sync(lambda: join_and_probe(target, new))
            finally:
                await trio.to_thread.run_sync(new.stop)
        if probe.returncode != 0:
            raise SystemExit(f"bench_security: the probe to the new member failed with {strangers} "
                             f"strangers: {probe.stderr.strip()}")
    finally:
        await trio.to_thread.run_sync(target.stop)
    log(f"join with {strangers} strangers ({len(hosts)} connected): {seconds:.2f} s")
    return {"seconds": round(seconds, 3), "strangers_connected": len(hosts),
            "strangers_refused_while_connecting": len(refused)}


async def join(mesh: Mesh, bootstrap: Node, strangers: int, repeats: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"0": [], str(strangers): []}
    for i in range(repeats):  # interleaved, so load drifts hit both cases alike
        for n in (0, strangers):
            runs[str(n)].append(await join_case(mesh, bootstrap, n, f"{n}-{i}"))
    median = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
    return {"strangers": strangers, "runs": runs,
            "median_s": {k: round(v, 3) for k, v in median.items()},
            "ratio": round(median[str(strangers)] / median["0"], 3)}


def revocation(mesh: Mesh, bootstrap: Node) -> dict[str, Any]:
    """A CA-signed revocation of one of 5 daemons, dropped at one member."""
    r1, r2, r3, victim = (mesh.add(name, [bootstrap.addr()]) for name in ("r1", "r2", "r3", "victim"))
    members = [bootstrap, r1, r2, r3]
    names = {n.name for n in [*members, victim]}
    for node in [*members, victim]:
        wait_until(lambda node=node: names - {node.name} <= connected_fast(node), timeout=180)
    signed = mesh.root / "revocations.signed"
    cert = victim.dir / "membership.cert"
    cli_json("certs", "revoke", "--ca", str(mesh.ca), "--cert", str(cert), "--out", str(signed))
    started = time.monotonic()
    shutil.copyfile(signed, r1.dir / "revocations.signed")
    took = revocation_seconds(members, victim.name, started)
    log(f"revocation everywhere after {max(took.values()):.2f} s")
    return {"daemons": len(names), "published_at": r1.name,
            "revoked_serial": parse_certificate(cert.read_bytes()).serial,
            "per_member_s": {k: round(v, 3) for k, v in sorted(took.items())},
            "max_s": round(max(took.values()), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strangers", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="30 strangers: a smoke run")
    args = parser.parse_args(argv)
    strangers = 30 if args.quick else args.strangers
    # the strangers' own libp2p logs every stream the daemon refuses them: expected here
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-security-") as tmp:
        mesh = Mesh(Path(tmp))
        try:
            a = mesh.add("a")
            report: dict[str, Any] = {"benchmark": "security", "quick": args.quick}
            report["join"] = trio.run(join, mesh, a, strangers, max(1, args.repeats))
            report["revocation"] = revocation(mesh, a)
        finally:
            mesh.stop_all()
    report["loadavg_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    report["cpus"] = os.cpu_count()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
