"""Three fabricd clusters and a scheduler, each in its own Linux network namespace
(deploy/netns-testbed.sh with FP_SCHEDULER=1).

Each daemon has its own IP on a bridge that lives in another namespace, so the mesh
forms, the probe travels and a job runs over real veth links, not loopback. Needs root
and the right to create namespaces; skipped with the reason otherwise. Teardown always
runs `netns-testbed.sh down` and checks nothing is left behind. The two tests share one
testbed (bringing it up is the expensive part).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "netns-testbed.sh"
CLUSTERS = ("a", "b", "c")
DAEMONS = (*CLUSTERS, "scheduler")
SUBNET = "10.77.0"
PORT = 4001
PROBE_BYTES = 4 * 1024 * 1024
# Generous: the mesh normally forms in a few seconds; this only bounds a hung run.
MESH_DEADLINE_S = 90.0
SLOW = 1.5  # FP_SLOW's factor for site c


def _netns_unavailable() -> str | None:
    """Why this machine cannot run the testbed, or None if it can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces exist only on Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "iproute2's 'ip' command is not installed"
    probe = f"fpprobe{os.getpid()}"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"'ip netns add' is not permitted here: {proc.stderr.strip()}"
    try:
        # The testbed also needs the kernel's bridge and veth link types.
        for kind, args in (("bridge", ["br0", "type", "bridge"]),
                           ("veth", ["v0", "type", "veth", "peer", "name", "v1"])):
            proc = subprocess.run(["ip", "-n", probe, "link", "add", *args],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                return f"this kernel cannot create {kind} links: {proc.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@dataclass
class NetnsTestbed:
    prefix: str
    state: Path
    env: dict[str, str]
    up_log: str = ""

    @classmethod
    def fresh(cls, tmp_path_factory: pytest.TempPathFactory, prefix: str, **env: str) -> Self:
        """A testbed not up yet: namespaces ``prefix``<pid>-*, its state in a fresh temp dir,
        netns-testbed.sh's settings plus ``env``."""
        prefix = f"{prefix}{os.getpid() % 100000}"
        state = tmp_path_factory.mktemp(prefix) / "state"
        return cls(prefix, state, {
            **os.environ, "FP_NETNS_PREFIX": prefix, "FP_STATE_DIR": str(state),
            "FP_CLUSTERS": " ".join(CLUSTERS), "FP_PORT": str(PORT), "FP_KEEP_ON_FAIL": "1",
            "FABRICD": str(Path(sys.executable).with_name("fabricd")), "PYTHON": sys.executable, **env,
        })

    def ns(self, cid: str) -> str:
        return f"{self.prefix}-{cid}"

    def ip(self, cid: str) -> str:
        return f"{SUBNET}.200" if cid == "scheduler" else f"{SUBNET}.{CLUSTERS.index(cid) + 1}"

    def config(self, cid: str) -> str:
        return str(self.state / cid / "cluster.toml")

    def pid(self, cid: str) -> int:
        return int((self.state / cid / "fabricd.pid").read_text())

    def run_in(self, cid: str, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.ns(cid), *cmd], capture_output=True, text=True,
            timeout=timeout, env=self.env,
        )

    def fabricd(self, cid: str, *args: str) -> Any:
        proc = self.run_in(cid, self.env["FABRICD"], *args)
        assert proc.returncode == 0, f"fabricd {' '.join(args)} in {self.ns(cid)} failed:\n{proc.stderr}"
        return json.loads(proc.stdout)

    def status(self, cid: str) -> Any:
        return self.fabricd(cid, "status", "--config", self.config(cid))

    def logs(self) -> str:
        parts = []
        for cid in DAEMONS:
            log = self.state / cid / "fabricd.log"
            text = log.read_text()[-4000:] if log.exists() else "(no log)"
            parts.append(f"--- {cid} fabricd.log (tail)\n{text}")
        return "\n".join(parts)

    def link_bytes(self, ns: str, dev: str) -> tuple[int, int]:
        """(rx_bytes, tx_bytes) of interface ``dev`` in namespace ``ns``."""
        out = subprocess.run(
            ["ip", "-j", "-s", "-n", ns, "link", "show", "dev", dev],
            capture_output=True, text=True, check=True,
        ).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])


def _script(bed_env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *args], env=bed_env, capture_output=True, text=True, timeout=300,
    )


@contextlib.contextmanager
def brought_up(bed: NetnsTestbed, *args: str) -> Iterator[None]:
    """`netns-testbed.sh up` (with ``args``) for ``bed``, then `down`, checking that no
    namespace or state is left behind."""
    cgroups: list[Path] = []  # slow sites' (FP_SLOW), each gone after down
    try:
        up = _script(bed.env, "up", *args)
        if up.returncode != 0:
            pytest.fail(f"netns-testbed.sh up {' '.join(args)} failed:\n{up.stderr}\n{bed.logs()}")
        bed.up_log = up.stderr
        cgroups = [Path(p.read_text().strip()) for p in bed.state.glob("*/cpuquota")]
        yield
    finally:
        down = _script(bed.env, "down")
        left = {ns for ns in _namespaces() if ns.startswith(bed.prefix + "-")}
        assert down.returncode == 0, f"netns-testbed.sh down failed:\n{down.stderr}"
        assert not left, f"namespaces left behind after down: {sorted(left)}"
        assert not bed.state.exists(), f"{bed.state} left behind after down"
        assert not [g for g in cgroups if g.exists()], f"cgroups left behind: {cgroups}"


@pytest.fixture(scope="module")
def testbed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsTestbed]:
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    # c slowed a little (1/1.5 of a fair CPU share: about what 4 daemons on 2 cores get
    # anyway), so the job below runs at the pace it would
    bed = NetnsTestbed.fresh(tmp_path_factory, "fpt", FP_SUBNET=SUBNET, FP_SCHEDULER="1",
                             FP_SLOW=f"c={SLOW}")
    with brought_up(bed):
        yield bed


@pytest.mark.parametrize(("slow", "says"), [
    ("z=4", "FP_SLOW: z=4 names no site"),
    ("a=1", "FP_SLOW: a=1: expected ID=FACTOR with FACTOR > 1"),
    ("a=fast", "FP_SLOW: a=fast: expected ID=FACTOR with FACTOR > 1"),
])
def test_a_bad_slow_site_is_refused_before_anything_is_made(
        tmp_path_factory: pytest.TempPathFactory, slow: str, says: str) -> None:
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    bed = NetnsTestbed.fresh(tmp_path_factory, "fpx", FP_SLOW=slow)
    up = _script(bed.env, "up")
    assert up.returncode == 1 and says in up.stderr, up.stderr
    assert not {ns for ns in _namespaces() if ns.startswith(bed.prefix + "-")}
    assert not bed.state.exists()


def test_a_slow_site_runs_under_its_cpu_quota(testbed: NetnsTestbed) -> None:
    """FP_SLOW: the site's daemon (and so the executor and Ray it starts) in a cgroup of
    its own with 1/FACTOR of a fair CPU share, removed by `down` (checked by brought_up)."""
    from scheduler.cpuquota import PERIOD_US

    quota_file = testbed.state / "c" / "cpuquota"
    if not quota_file.exists():  # up must have said why (no writable cgroup cpu controller)
        why = re.search(r"site c slowed by 1.5: (not slowed: .*)", testbed.up_log)
        assert why, f"c was not slowed, and up did not say why:\n{testbed.up_log}"
        pytest.skip(why.group(1))
    cgroup = Path(quota_file.read_text().strip())
    assert str(testbed.pid("c")) in (cgroup / "cgroup.procs").read_text().split()
    share = min(1.0, len(os.sched_getaffinity(0)) / len(CLUSTERS)) / SLOW
    quota = ((cgroup / "cpu.max").read_text().split()[0] if (cgroup / "cpu.max").exists()
             else (cgroup / "cpu.cfs_quota_us").read_text().strip())
    assert int(quota) == int(PERIOD_US * share)
    assert not (testbed.state / "a" / "cpuquota").exists()
    assert re.search(r"site c slowed by 1.5: 0\.\d\d of a CPU", testbed.up_log)


def wait_for_full_mesh(bed: NetnsTestbed, deadline_s: float = MESH_DEADLINE_S) -> dict[str, Any]:
    """Poll `fabricd status` in every namespace until each lists all the others connected."""
    deadline = time.monotonic() + deadline_s
    statuses: dict[str, Any] = {}
    while True:
        statuses = {cid: bed.status(cid) for cid in DAEMONS}
        if all({c["cluster_id"] for c in s["clusters"] if c["connected"]} == set(DAEMONS) - {cid}
               for cid, s in statuses.items()):
            return statuses
        if time.monotonic() > deadline:
            pytest.fail(
                f"mesh did not form within {deadline_s:.0f}s; last statuses:\n"
                f"{json.dumps(statuses, indent=1)[-6000:]}\n{bed.logs()}"
            )
        time.sleep(0.5)


def _sockets(bed: NetnsTestbed, cid: str, *filters: str) -> list[list[str]]:
    proc = bed.run_in(cid, "ss", "-Htnp", *filters)
    assert proc.returncode == 0, proc.stderr
    return [line.split() for line in proc.stdout.splitlines() if line.strip()]


def test_three_namespaced_daemons_mesh_and_probe_over_veth(testbed: NetnsTestbed) -> None:
    bed = testbed
    statuses = wait_for_full_mesh(bed)

    peer_ids = {cid: statuses[cid]["peer_id"] for cid in DAEMONS}
    assert len(set(peer_ids.values())) == len(DAEMONS)
    assert statuses["scheduler"]["role"] == "scheduler"
    for cid in DAEMONS:
        status = statuses[cid]
        assert status["cluster_id"] == cid
        own = f"/ip4/{bed.ip(cid)}/tcp/{PORT}"
        assert any(addr.startswith(own) for addr in status["listen_addrs"]), status["listen_addrs"]
        # Every other cluster is known under its real peer id.
        for other in status["clusters"]:
            assert other["peer_id"] == peer_ids[other["cluster_id"]]
        # The daemon itself (its recorded pid) listens on its own namespace IP, and only
        # there: nothing on the wildcard address or on another cluster's IP.
        listeners = _sockets(bed, cid, "-l")
        mine = [s for s in listeners if s[3] == f"{bed.ip(cid)}:{PORT}"]
        assert mine, f"no listener on {bed.ip(cid)}:{PORT} in {bed.ns(cid)}: {listeners}"
        assert f"pid={bed.pid(cid)}," in " ".join(mine[0]), mine[0]
        assert not [s for s in listeners if s[3] in (f"0.0.0.0:{PORT}", f"*:{PORT}")]
        # Its mesh connections run over the veth link between namespace addresses.
        established = _sockets(bed, cid, "state", "established")
        remote_ips = {s[3].rsplit(":", 1)[0] for s in established if s[2].startswith(bed.ip(cid) + ":")}
        assert {bed.ip(o) for o in DAEMONS if o != cid} <= remote_ips, established

    # c -> a probe: a few MiB as one update stream, across c's veth, the bridge, a's veth.
    _, c_tx0 = bed.link_bytes(bed.ns("c"), "eth0")
    a_rx0, _ = bed.link_bytes(bed.ns("a"), "eth0")
    bridge_c_rx0, _ = bed.link_bytes(f"{bed.prefix}-br", "v-c")
    result = bed.fabricd(
        "c", "probe", "--config", bed.config("c"), "--cluster", "a", "--bytes", str(PROBE_BYTES)
    )
    assert result["cluster_id"] == "a"
    assert result["bytes"] == PROBE_BYTES
    assert result["seconds"] > 0 and result["throughput_mb_s"] > 0 and result["rtt_ms"] >= 0
    _, c_tx1 = bed.link_bytes(bed.ns("c"), "eth0")
    a_rx1, _ = bed.link_bytes(bed.ns("a"), "eth0")
    bridge_c_rx1, _ = bed.link_bytes(f"{bed.prefix}-br", "v-c")
    assert c_tx1 - c_tx0 >= PROBE_BYTES, "the probe's bytes did not leave c's eth0"
    assert bridge_c_rx1 - bridge_c_rx0 >= PROBE_BYTES, "the probe's bytes did not cross the bridge"
    assert a_rx1 - a_rx0 >= PROBE_BYTES, "the probe's bytes did not reach a's eth0"

    # The script's own status agrees that all three run.
    status = _script(bed.env, "status")
    assert status.returncode == 0, status.stdout + status.stderr
    blocks = status.stdout.split("\n" + CLUSTERS[1] + ": ")
    for cid in DAEMONS:
        assert f"{cid}: namespace {bed.ns(cid)}, {bed.ip(cid)}, fabricd pid {bed.pid(cid)} running" in status.stdout
    for other in ("b", "c", "scheduler"):
        assert f"{other} connected" in blocks[0], status.stdout


TINY_JOB = """
[job]
id = "netns-tiny"
seed = 0

[data]
dataset = "digits"
number_of_clients = 6
data_distribution_kind = "iid"

[model]
name = "mlp"
hidden = 16

[training]
federated_learning_rounds = 2
number_of_epochs = 1
batch_size = 32

[topology]
kind = "star"

[aggregation]
name = "fedavg"

[placement]
strategy = "round_robin"
"""


def test_scheduler_in_its_namespace_runs_a_job_over_the_mesh(
    testbed: NetnsTestbed, tmp_path: Path
) -> None:
    """`fedpilot-scheduler submit --mesh` from the scheduler's namespace, through its own
    daemon, on the three namespaced clusters: the deployment path of the compose file."""
    bed = testbed
    statuses = wait_for_full_mesh(bed)
    served_before = {cid: statuses[cid]["control"]["served"] for cid in CLUSTERS}
    job, out = tmp_path / "tiny.toml", tmp_path / "out"
    job.write_text(TINY_JOB)
    scheduler = str(Path(sys.executable).with_name("fedpilot-scheduler"))
    proc = bed.run_in(
        "scheduler", scheduler, "submit", str(job), "--mesh", bed.config("scheduler"),
        "--clusters", ",".join(CLUSTERS), "--out", str(out), "--quiet",
        "--wait", "60", "--round-timeout", "120", timeout=300,
    )
    assert proc.returncode == 0, f"submit failed:\n{proc.stderr[-4000:]}\n{bed.logs()}"
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert printed["clusters"] == list(CLUSTERS)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["job_id"] == "netns-tiny"
    assert [c["cluster_id"] for c in summary["clusters"]] == list(CLUSTERS)
    assert sum(c["clients"] for c in summary["clusters"]) == 6
    assert all(c["clients"] > 0 for c in summary["clusters"])
    assert [r["round"] for r in summary["rounds"]] == [1, 2]
    # Every cluster's daemon served the job's control requests, which came from the
    # scheduler's daemon over the mesh (the only link between the namespaces).
    for cid in CLUSTERS:
        control = bed.status(cid)["control"]
        assert control["served"] > served_before[cid], (cid, control)
        assert control["refused"] == 0, (cid, control)
