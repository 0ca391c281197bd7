"""Federation-wide revocation: a CA-signed list published at one member takes effect on
every member of a 5-daemon mesh without restarts; a list not signed by the CA is refused
and changes nothing."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from proto.certs import generate_ca, parse_certificate, sign_revocations
from tests.fabricd._harness import (
    bridge_status,
    cli_json,
    connected_fast,
    revocation_seconds,
    wait_until,
)
from tests.fabricd.conftest import Mesh

pytestmark = pytest.mark.slow


@pytest.fixture()
def five(tmp_path: Path) -> Iterator[Mesh]:
    """A mesh of its own (a, b; the test adds r1, r2, r3): the session mesh carries every
    earlier test's daemons and disturbances (300 stalled strangers, slow-loris senders), and
    on a loaded 2-core runner its gossip then took minutes to settle."""
    m = Mesh(tmp_path)
    try:
        a = m.add("a")
        m.add("b", [a.addr()])
        yield m
    finally:
        m.stop_all()


def test_a_signed_revocation_reaches_every_member_without_restarts(five: Mesh) -> None:
    mesh = five
    a, b = mesh.nodes["a"], mesh.nodes["b"]
    extra = [mesh.add(name, [a.addr()]) for name in ("r1", "r2", "r3")]
    r1, r2, victim = extra
    members = [a, b, r1, r2]
    names = {n.name for n in [*members, victim]}
    for node in [*members, victim]:
        wait_until(lambda node=node: names - {node.name} <= connected_fast(node), timeout=120)
    pids = {n.name: n.proc.pid for n in [*members, victim]}

    # A list signed by another CA, dropped at r2: refused, nothing revoked.
    serial = parse_certificate((victim.dir / "membership.cert").read_bytes()).serial
    (r2.dir / "revocations.signed").write_bytes(sign_revocations(generate_ca(), [serial], int(time.time())))
    wait_until(lambda: re.search(r"event=revocations\.refused .*not signed by this federation's CA",
                                 r2.log()), timeout=30)
    assert "r3" in connected_fast(r2)

    # The CA operator signs a revocation of r3 and it is dropped at r1 only.
    signed = mesh.root / "revocations.signed"
    out = cli_json("certs", "revoke", "--ca", str(mesh.ca), "--cert", str(victim.dir / "membership.cert"),
                   "--out", str(signed))
    assert out["revoked_serial"] == serial
    started = time.monotonic()
    shutil.copyfile(signed, r1.dir / "revocations.signed")
    took = revocation_seconds(members, "r3", started)
    print("revocation applied after (s):", {k: round(v, 2) for k, v in sorted(took.items())})
    for node in members:
        assert re.search(r"event=revocations\.applied ", node.log()), node.name
        assert re.search(rf"event=member\.rejected .*serial {serial} .*revoked", node.log()), node.name
        assert bridge_status(node)["revoked_serials"] >= 1
        # Stored next to its own list: it survives a restart of that daemon.
        assert (node.dir / "revocations.signed").read_bytes() == signed.read_bytes()
    # Nobody restarted; the remaining members still talk to each other.
    assert all(n.proc.pid == pids[n.name] and n.proc.poll() is None for n in members)
    from_victim = victim.probe("a", 4096, check=False)
    assert from_victim.returncode != 0 and "not a member" in from_victim.stderr
    r1.probe("r2", 65536)
    b.probe("r1", 65536)
