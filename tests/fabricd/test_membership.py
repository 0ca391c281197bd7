"""Must-show 3: a foreign-CA daemon and a revoked member get nothing through, without restarts."""

from __future__ import annotations

import re

import pytest

from tests.fabricd._harness import bridge_status, connected_fast, init_ca, wait_until

pytestmark = pytest.mark.slow


def _received_probe_bytes(node) -> int:
    return int(bridge_status(node)["jobs"].get("_probe", {}).get("received_bytes", 0))


def test_foreign_ca_daemon_is_refused_both_ways(mesh) -> None:
    a = mesh.nodes["a"]
    foreign_ca = init_ca(mesh.root, "foreign-ca")
    f = mesh.add("f", [a.addr()], ca=foreign_ca)
    # a rejects f's certificate at connect time and logs who and why.
    wait_until(lambda: re.search(r"event=member\.rejected peer=\S+ claimed_cluster=f reason=.*ForeignCertificate",
                                 a.log()), timeout=30)
    before_a, before_f = _received_probe_bytes(a), _received_probe_bytes(f)

    to_f = a.probe("f", 4096, check=False)
    assert to_f.returncode != 0
    assert "not a member" in to_f.stderr, to_f.stderr
    from_f = f.probe("a", 4096, check=False)
    assert from_f.returncode != 0
    assert "not a member" in from_f.stderr, from_f.stderr
    # Each side logged the rejection of the other; nothing was delivered anywhere.
    assert re.search(r"event=member\.rejected .*claimed_cluster=a .*ForeignCertificate", f.log())
    assert _received_probe_bytes(a) == before_a and _received_probe_bytes(f) == before_f
    assert "f" not in connected_fast(a)
    assert "a" not in connected_fast(f)
    refused = {r["cluster_id"] for r in bridge_status(a)["refused"]}
    assert "f" in refused


def test_revoked_member_is_dropped_without_restart(mesh) -> None:
    from tests.fabricd._harness import cli_json

    a = mesh.nodes["a"]
    c = mesh.add("d", [a.addr()])  # a member of its own, so the shared mesh stays whole
    wait_until(lambda: "d" in connected_fast(a), timeout=60)
    a.probe("d", 4096)  # a member: works
    a_pid, c_pid = a.proc.pid, c.proc.pid
    out = cli_json("certs", "revoke", "--config", a.config, "--cert", str(c.dir / "membership.cert"))
    assert out["cluster_id"] == "d" and out["revoked_serial"] > 0
    wait_until(lambda: "d" not in connected_fast(a), timeout=15)
    assert re.search(r"event=member\.rejected peer=\S+ claimed_cluster=\? reason=.*revoked", a.log()) or \
        re.search(r"event=member\.rejected .*revoked", a.log())
    before = _received_probe_bytes(a)

    to_c = a.probe("d", 4096, check=False)
    assert to_c.returncode != 0 and "not a member" in to_c.stderr, to_c.stderr
    from_c = c.probe("a", 4096, check=False)
    assert from_c.returncode != 0 and "not a member" in from_c.stderr, from_c.stderr
    assert "revoked" in from_c.stderr
    assert _received_probe_bytes(a) == before
    # No restarts were needed, and b (which did not revoke c) is unaffected.
    assert a.proc.pid == a_pid and c.proc.pid == c_pid
    assert a.proc.poll() is None and c.proc.poll() is None
    mesh.nodes["b"].probe("a", 4096)
