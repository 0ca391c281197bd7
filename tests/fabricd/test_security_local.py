"""Local hardening: a readable CA key is refused, head nodes need no ca.key, and the
bridge socket never lands under a guessable name in a shared directory."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from fabricd.cli import main
from fabricd.config import MAX_SOCKET_PATH, ensure_private_dir, load_config, short_socket_path
from fabricd.daemon import StartupError, load_credentials
from tests.fabricd._harness import cli_inprocess


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_readable_ca_key_is_refused_unless_overridden(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ca = tmp_path / "ca"
    cli_inprocess("certs", "init-ca", "--out", str(ca))
    assert stat.S_IMODE((ca / "ca.key").stat().st_mode) == 0o600
    node = tmp_path / "n"
    cli_inprocess("init", "--cluster-id", "n", "--listen", "/ip4/127.0.0.1/tcp/1", "--ca", str(ca),
                  "--out", str(node))
    peer = cli_inprocess("id", "--config", str(node / "cluster.toml"))["peer_id"]
    os.chmod(ca / "ca.key", 0o644)
    args = ("certs", "issue", "--ca", str(ca), "--peer-id", peer, "--cluster-id", "n", "--out",
            str(tmp_path / "x.cert"))
    code, _, err = _run(capsys, *args)
    assert code != 0 and "chmod 600" in err and "--allow-readable-ca-key" in err, err
    assert not (tmp_path / "x.cert").exists()
    code, _, err = _run(capsys, *args, "--allow-readable-ca-key")
    assert code == 0 and (tmp_path / "x.cert").exists(), err
    os.chmod(ca / "ca.key", 0o600)
    (tmp_path / "x.cert").unlink()
    assert _run(capsys, *args)[0] == 0


def test_a_head_node_without_ca_key_gets_its_certificate_from_a_signing_request(tmp_path: Path) -> None:
    ca = tmp_path / "ca"
    cli_inprocess("certs", "init-ca", "--out", str(ca))
    public_only = tmp_path / "ca-public"
    public_only.mkdir()
    (public_only / "ca.pub").write_bytes((ca / "ca.pub").read_bytes())
    head = tmp_path / "head"
    out = cli_inprocess("init", "--cluster-id", "lab-x", "--listen", "/ip4/127.0.0.1/tcp/1",
                        "--ca", str(public_only), "--out", str(head))
    request = Path(out["signing_request"])
    assert json.loads(request.read_text()) == {"peer_id": out["peer_id"], "cluster_id": "lab-x",
                                               "role": "cluster"}
    assert not (head / "membership.cert").exists() and not (head / "ca.key").exists()
    config = load_config(head / "cluster.toml")
    with pytest.raises(StartupError, match="no membership certificate yet; send .*signing-request.json"):
        load_credentials(config)
    # On the CA machine.
    cli_inprocess("certs", "issue", "--ca", str(ca), "--request", str(request),
                  "--out", str(head / "membership.cert"))
    creds = load_credentials(config)
    assert creds.certificate == (head / "membership.cert").read_bytes()


def test_a_long_socket_path_falls_back_to_a_private_directory(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "bridge.sock"
    sock = short_socket_path(deep, "a")
    assert len(str(sock)) < MAX_SOCKET_PATH
    assert sock.parent.name.startswith(f"fabricd-{os.getuid()}-")
    ensure_private_dir(sock.parent)
    try:
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
    finally:
        sock.parent.rmdir()
    # Someone pre-created a world-writable directory under that name: refused.
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(OSError, match="writable by other users"):
        ensure_private_dir(shared)
