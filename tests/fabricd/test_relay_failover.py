"""A gateway that dies or goes silent in the middle of an update (fabricd/_relay.py).

- Two gateways: private members that bootstrap from both hold a reservation at each and
  announce both circuit addresses. The gateway carrying their link is killed (SIGKILL: its
  connections close) or frozen (SIGSTOP: they stay open and nothing answers, as when its
  machine is gone: the members' pings find it silent) while a 256 MiB update is under way.
  That update ends - delivered over the other gateway, or failed naming the relay - and
  the members link again through the other gateway, which carries the next update.
- One gateway, killed mid-update: the update fails and the error names the relay.
Never a hang: every wait is bounded.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.fabricd._harness import FABRICD, Node, bridge_status, init_ca, start_relayed, wait_until

pytestmark = pytest.mark.slow

UPDATE = 256 << 20
#: bounds a hung update (the job's round deadline is at least 60 s: proto.job.Faults)
HANG_S = 180
#: the gateways pass 64 MB/s at most, so the gateway is cut while the update is under way
#: (spliced, 256 MiB would otherwise be through in a fraction of a second)
GATEWAY = "relay_service = true\nrelay_max_bytes_per_second = 64000000"


def _linked(a: Node, b: Node) -> bool:
    return any(r["cluster_id"] == b.name and r["connected"] for r in bridge_status(a)["clusters"])


def _relayed(g: Node) -> int:
    """Bytes gateway g passed on: in circuits, and spliced data-plane connections."""
    service = bridge_status(g)["relay"]["service"]
    return int(service["bytes_relayed"]) + int(service["bytes_spliced"])


def _update_cut_by(g: Node, p: Node, how: signal.Signals) -> tuple[subprocess.CompletedProcess[str], float]:
    """A 256 MiB update from p to q, and ``how`` sent to gateway g once 8 MiB of it went
    through: the update's outcome and seconds from the signal to its end."""
    with subprocess.Popen([*FABRICD, "probe", "--config", p.config, "--cluster", "q", "--bytes", str(UPDATE)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        start = _relayed(g)
        wait_until(lambda: _relayed(g) - start > 8 << 20, timeout=120)
        assert proc.poll() is None, "the update ended before the gateway was cut"
        assert g.proc is not None
        g.proc.send_signal(how)
        cut = time.monotonic()
        out, err = proc.communicate(timeout=HANG_S)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - cut


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_the_other_gateway_carries_the_link_when_one_dies(tmp_path: Path, how: signal.Signals) -> None:
    # the members find a frozen gateway silent after 4 s, not production's 10 (the same code path)
    nodes = start_relayed(tmp_path, init_ca(tmp_path), ("p", "q"), GATEWAY, gateways=("g1", "g2"),
                          member_network="relay_silent_after = 4")
    g1, g2, p, q = nodes
    try:
        for member in (p, q):
            wait_until(lambda m=member: len(bridge_status(m)["relay"]["reservations"]) == 2, timeout=90)
        wait_until(lambda: _linked(p, q) and _linked(q, p), timeout=90)
        dying, other = (g1, g2) if bridge_status(g1)["relay"]["service"]["circuits_open"] else (g2, g1)
        update, took = _update_cut_by(dying, p, how)
        print(f"gateway {how.name}: the update under way ended after {took:.1f} s: "
              f"rc {update.returncode} {update.stdout.strip()[-200:]} {update.stderr.strip()[-600:]}")
        assert update.returncode == 0 or "relay" in update.stderr, update.stderr
        before = _relayed(other)
        wait_until(lambda: _linked(p, q) and _linked(q, p), timeout=120)
        wait_until(lambda: p.probe("q", 4 << 20, check=False).returncode == 0, timeout=120, interval=1)
        assert _relayed(other) - before >= 4 << 20
    finally:
        for node in nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGCONT)  # a frozen gateway, to stop it
            node.stop()


def test_the_update_under_way_fails_naming_the_relay_when_the_only_gateway_dies(tmp_path: Path) -> None:
    nodes = start_relayed(tmp_path, init_ca(tmp_path), ("p", "q"), GATEWAY)
    g, p, q = nodes
    try:
        wait_until(lambda: _linked(p, q) and _linked(q, p), timeout=90)
        update, took = _update_cut_by(g, p, signal.SIGKILL)
        print(f"only gateway killed: the update under way failed after {took:.1f} s: {update.stderr.strip()}")
        assert update.returncode != 0
        assert f"relay {g.addr()} unreachable" in update.stderr, update.stderr
    finally:
        for node in nodes:
            node.stop()
