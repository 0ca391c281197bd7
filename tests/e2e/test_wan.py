"""The WAN testbed (deploy/netns-testbed.sh up --wan): three sites, each behind a NAT
router namespace of its own, and a gateway on the "internet" bridge that relays for them.

- No site can dial another (neither its LAN address nor its router's public one), while
  each reaches the gateway: the NAT is real, not a configuration of fabricd.
- The mesh still forms - every site sees the other two over relayed links, which DCUtR
  hole punching upgrades to direct ones behind cone NATs (fabricd/_holepunch.py) and
  cannot behind symmetric ones - a probe between two sites goes through the gateway (its
  body over the data plane, spliced there: fabricd/_splice.py), and a job submitted from
  the gateway's namespace finishes, with relayed bytes counted on the sites and the
  gateway.

The uplinks carry 80 ms RTT and 1 % loss each way (the issue's hard case): tc netem where
the kernel has sch_netem, else deploy/wanlink.py. Needs root, network namespaces and
iptables; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_netns import (
    CLUSTERS,
    PORT,
    PROBE_BYTES,
    TINY_JOB,
    NetnsTestbed,
    _netns_unavailable,
    brought_up,
    wait_for_full_mesh,
)

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.timeout(600)]

WAN_SUBNET = "198.18.0"
MESH_DEADLINE_S = 120.0
RTT_MS, LOSS_PCT = 80, 1


class Wan(NetnsTestbed):
    nat = "cone"

    def ip(self, cid: str) -> str:
        return f"{WAN_SUBNET}.200" if cid == "scheduler" else f"10.77.{CLUSTERS.index(cid) + 1}.2"


@pytest.fixture(scope="module", params=["cone", "symmetric"])
def wan(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wan]:
    """The testbed behind cone NATs (a connection keeps its source port: DCUtR punches
    through) or symmetric ones (a new port per connection: punching fails, links stay
    relayed)."""
    reason = _netns_unavailable()
    if reason is None and shutil.which("iptables") is None:
        reason = "the WAN testbed's NAT routers need iptables (apt-get install iptables)"
    if reason is not None:
        pytest.skip(reason)
    bed = Wan.fresh(tmp_path_factory, "fpw" if request.param == "cone" else "fps",
                    FP_WAN_RTT_MS=str(RTT_MS), FP_WAN_LOSS=str(LOSS_PCT), FP_WAN_NAT=request.param)
    bed.nat = request.param
    with brought_up(bed, "--wan"):
        yield bed


def wait_for_links(wan: Wan, kind: str, deadline_s: float = 90.0) -> dict[str, Any]:
    """Every site's link to every other site ``kind`` (upgraded: DCUtR punched it), its
    link to the gateway direct; the last statuses."""
    deadline = time.monotonic() + deadline_s
    while True:
        statuses = {cid: wan.status(cid) for cid in CLUSTERS}
        links = {cid: {c["cluster_id"]: c["link"] for c in s["clusters"]} for cid, s in statuses.items()}
        want = {cid: {**{o: kind for o in CLUSTERS if o != cid}, "scheduler": "direct"} for cid in CLUSTERS}
        if links == want:
            return statuses
        if time.monotonic() > deadline:
            pytest.fail(f"links not {kind} within {deadline_s:.0f} s: {links}\n{wan.logs()}")
        time.sleep(1.0)


DIAL = """
import socket, sys, time
try:
    start = time.monotonic()
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
    print(f"connected {(time.monotonic() - start) * 1000:.1f}")
except OSError as exc:
    print(f"failed: {exc}")
"""


def test_no_site_can_dial_another_but_each_reaches_the_gateway(wan: Wan) -> None:
    for src in CLUSTERS:
        for dst in CLUSTERS:
            if src == dst:
                continue
            router = f"{WAN_SUBNET}.{CLUSTERS.index(dst) + 1}"
            for ip in (wan.ip(dst), router):
                out = wan.run_in(src, sys.executable, "-c", DIAL, ip, str(PORT)).stdout
                assert out.startswith("failed"), (src, dst, ip, out)
        out = wan.run_in(src, sys.executable, "-c", DIAL, wan.ip("scheduler"), str(PORT)).stdout
        assert out.startswith("connected"), (src, out)
        assert float(out.split()[1]) >= RTT_MS, (src, out)  # the handshake crossed the uplink twice


def test_sites_mesh_through_the_gateway_and_a_job_runs(wan: Wan, tmp_path: Path) -> None:
    """Behind cone NATs every link between two sites is upgraded by hole punching (a TCP
    connection from one site's listen port to the other's router); behind symmetric ones
    every punch fails and the links stay relayed. Either way a large body is spliced at the
    gateway (the data plane's port is still out of reach) and a job runs."""
    mesh = wait_for_full_mesh(wan, MESH_DEADLINE_S)
    statuses = wait_for_links(wan, "upgraded" if wan.nat == "cone" else "relayed")
    for cid in CLUSTERS:
        assert all("/p2p-circuit/" in a for a in statuses[cid]["listen_addrs"]), statuses[cid]["listen_addrs"]
        punch = statuses[cid]["relay"]["holepunch"]
        if wan.nat == "cone":
            assert punch["holepunch_upgraded"] >= 1, (cid, punch)
            # the connection itself: from this site's port to another site's router
            sockets = wan.run_in(cid, "ss", "-tnH", "state", "established").stdout
            routers = {f"{WAN_SUBNET}.{CLUSTERS.index(o) + 1}:{PORT}" for o in CLUSTERS if o != cid}
            assert routers <= {line.split()[-1] for line in sockets.splitlines()}, (cid, sockets)
    if wan.nat == "symmetric":  # every punch fails (each of its rounds waits 5 s), none upgrades
        deadline = time.monotonic() + 90
        while not all(wan.status(cid)["relay"]["holepunch"]["holepunch_failed"] for cid in CLUSTERS):
            assert time.monotonic() < deadline, {cid: wan.status(cid)["relay"] for cid in CLUSTERS}
            time.sleep(1.0)
        for cid in CLUSTERS:
            punch = wan.status(cid)["relay"]["holepunch"]
            assert punch["holepunch_upgraded"] == 0, (cid, punch)
            links = {c["cluster_id"]: c["link"] for c in wan.status(cid)["clusters"]}
            assert set(links.values()) == {"relayed", "direct"}, (cid, links)
    assert mesh["scheduler"]["relay"]["service"]["reservations"] == len(CLUSTERS)

    spliced0 = wan.status("scheduler")["relay"]["service"]["bytes_spliced"]
    proc = wan.run_in("c", wan.env["FABRICD"], "probe", "--config", wan.config("c"), "--cluster", "a",
                      "--bytes", str(PROBE_BYTES), timeout=300)
    assert proc.returncode == 0, f"{proc.stderr}\n{wan.logs()}"
    # a large body goes over the data plane, spliced by the gateway (fabricd/_splice.py)
    assert wan.status("c")["transfer"]["bytes_by_path"]["dataplane_relayed"] >= PROBE_BYTES
    assert wan.status("c")["transfer"]["bytes_relayed_total"] >= PROBE_BYTES
    assert wan.status("scheduler")["relay"]["service"]["bytes_spliced"] - spliced0 >= PROBE_BYTES

    if wan.nat == "symmetric":
        return  # the job's path is the cone case's but slower to set up: run once
    job, out = tmp_path / "tiny.toml", tmp_path / "out"
    job.write_text(TINY_JOB.replace("netns-tiny", "wan-tiny"))
    scheduler = str(Path(sys.executable).with_name("fedpilot-scheduler"))
    proc = wan.run_in("scheduler", scheduler, "submit", str(job), "--mesh", wan.config("scheduler"),
                      "--clusters", ",".join(CLUSTERS), "--out", str(out), "--quiet",
                      "--wait", "60", "--round-timeout", "120", timeout=400)
    assert proc.returncode == 0, f"submit failed:\n{proc.stderr[-4000:]}\n{wan.logs()}"
    summary = json.loads((out / "summary.json").read_text())
    assert [r["round"] for r in summary["rounds"]] == [1, 2]
    assert all(c["clients"] > 0 for c in summary["clusters"])
