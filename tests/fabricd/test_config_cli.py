"""cluster.toml validation and the one-shot CLI commands (no daemon needed)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from fabricd.cli import main
from fabricd.config import ConfigError, load_config
from proto.certs import RevocationList, load_ca_public, parse_certificate, verify_certificate
from tests.fabricd._harness import cli_inprocess


@pytest.fixture
def node_dir(tmp_path: Path) -> Path:
    cli_inprocess("certs", "init-ca", "--out", str(tmp_path / "ca"))
    cli_inprocess("init", "--cluster-id", "a", "--listen", "/ip4/127.0.0.1/tcp/45123",
                  "--ca", str(tmp_path / "ca"), "--out", str(tmp_path / "a"), "--capacity", "4")
    return tmp_path / "a"


def test_init_writes_a_loadable_config_with_private_keys(node_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(node_dir / "cluster.toml")
    assert (cfg.cluster_id, cfg.role, cfg.capacity) == ("a", "cluster", 4)
    assert cfg.listen == ("/ip4/127.0.0.1/tcp/45123",)
    assert stat.S_IMODE(os.stat(cfg.identity_key).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "ca" / "ca.key").st_mode) == 0o600
    assert len(str(cfg.bridge_socket)) < 100 and cfg.revocation_list.name == "revoked.txt"
    ident = cli_inprocess("id", "--config", str(node_dir / "cluster.toml"))
    assert ident["addrs"] == [f"/ip4/127.0.0.1/tcp/45123/p2p/{ident['peer_id']}"]
    cert = verify_certificate(cfg.certificate.read_bytes(), load_ca_public(tmp_path / "ca"),
                              now=time.time(), expected_peer_id=ident["peer_id"])
    assert (cert.cluster_id, cert.role) == ("a", "cluster")


def _rewrite(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new))


@pytest.mark.parametrize(("old", "new", "key", "value"), [
    ('id = "a"', 'id = "a b"', "cluster.id", "'a b'"),
    ('role = "cluster"', 'role = "boss"', "cluster.role", "'boss'"),
    ('listen = ["/ip4/127.0.0.1/tcp/45123"]', 'listen = ["/ip4/127.0.0.1/udp/1"]', "network.listen",
     "/ip4/127.0.0.1/udp/1"),
    ("bootstrap = []", 'bootstrap = ["/ip4/127.0.0.1/tcp/1"]', "network.bootstrap", "/ip4/127.0.0.1/tcp/1"),
    ("heartbeat_timeout = 5.0", "heartbeat_timeout = 0.5", "limits.heartbeat_timeout", "0.5"),
    ("capacity = 4", 'capacity = "four"', "cluster.capacity", "'four'"),
    ('key = "identity.key"', 'key = "missing.key"', "identity.key", "missing.key"),
    ("[limits]\n", '[limits]\ndataplane_digest = "md5"\n', "limits.dataplane_digest", "'md5'"),
    ("[limits]\n", "[limits]\ndataplane_small_bytes = 65537\n", "limits.dataplane_small_bytes", "65537"),
    ("[network]\n", "[network]\nrelay_silent_after = 0.2\n", "network.relay_silent_after", "0.2"),
    ("[network]\n", "[network]\nrelay_max_bytes_per_second = -1\n", "network.relay_max_bytes_per_second", "-1"),
    ("[network]\n", '[network]\nhole_punching = "yes"\n', "network.hole_punching", "'yes'"),
])
def test_config_errors_name_file_key_value_and_allowed(node_dir: Path, old: str, new: str, key: str,
                                                       value: str) -> None:
    path = node_dir / "cluster.toml"
    _rewrite(path, old, new)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert str(path) in text and f"'{key}'" in text and value in text and "allowed" in text, text


def test_unknown_section_and_missing_file(node_dir: Path, tmp_path: Path) -> None:
    path = node_dir / "cluster.toml"
    path.write_text(path.read_text() + "\n[nonsense]\nx = 1\n")
    with pytest.raises(ConfigError, match="nonsense"):
        load_config(path)
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.toml")


def test_bad_config_exits_nonzero_before_opening_any_socket(node_dir: Path, capsys) -> None:
    path = node_dir / "cluster.toml"
    _rewrite(path, "heartbeat_interval = 1.0", "heartbeat_interval = -1")
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "limits.heartbeat_interval" in err and str(path) in err
    assert not (node_dir / "bridge.sock").exists()


def test_open_identity_file_is_refused(node_dir: Path, capsys) -> None:
    os.chmod(node_dir / "identity.key", 0o644)
    assert main(["--config", str(node_dir / "cluster.toml")]) == 1
    assert "chmod 600" in capsys.readouterr().err


def test_long_socket_path_falls_back_to_a_short_one(node_dir: Path) -> None:
    path = node_dir / "cluster.toml"
    _rewrite(path, 'socket = "bridge.sock"', f'socket = "{"x" * 120}/bridge.sock"')
    sock = load_config(path).bridge_socket
    assert len(str(sock)) < 100 and str(sock).startswith("/tmp")


def test_issue_and_revoke(node_dir: Path, tmp_path: Path) -> None:
    peer = cli_inprocess("id", "--config", str(node_dir / "cluster.toml"))["peer_id"]
    out = cli_inprocess("certs", "issue", "--ca", str(tmp_path / "ca"), "--peer-id", peer,
                        "--cluster-id", "sched", "--role", "scheduler", "--out", str(tmp_path / "s.cert"))
    cert = parse_certificate((tmp_path / "s.cert").read_bytes())
    assert (cert.role, cert.cluster_id, cert.serial) == ("scheduler", "sched", out["serial"])
    rev = cli_inprocess("certs", "revoke", "--config", str(node_dir / "cluster.toml"),
                        "--cert", str(tmp_path / "s.cert"))
    assert cert.serial in RevocationList.load(node_dir / "revoked.txt")
    assert rev["revoked_serial"] == cert.serial


def test_issue_refuses_a_bad_peer_id_in_one_line(node_dir: Path, tmp_path: Path,
                                                 capsys) -> None:
    ca = str(tmp_path / "ca")  # the node_dir fixture made it
    assert main(["certs", "issue", "--ca", ca, "--peer-id", "0OIl-not-base58",
                 "--cluster-id", "a", "--out", str(tmp_path / "a.cert")]) == 1
    err = capsys.readouterr().err.strip()
    assert "is not an ed25519 libp2p peer id" in err and "\n" not in err
    assert not (tmp_path / "a.cert").exists()


def test_status_without_a_daemon_says_what_to_do(node_dir: Path, capsys) -> None:
    assert main(["status", "--config", str(node_dir / "cluster.toml")]) == 1
    assert "is fabricd running" in capsys.readouterr().err


def test_help_lists_every_command(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for word in ("certs", "init", "id", "status", "probe", "--log-format"):
        assert word in text


@pytest.mark.parametrize("name", ["a", "b", "c", "scheduler"])
def test_example_cluster_configs_load(node_dir: Path, name: str) -> None:
    example = Path(__file__).resolve().parents[2] / "deploy" / "examples" / f"cluster-{name}.toml"
    target = node_dir / "cluster.toml"
    target.write_text(example.read_text())
    cfg = load_config(target)
    assert cfg.cluster_id == name and cfg.listen == ("/ip4/0.0.0.0/tcp/4001",)
    assert cfg.role == ("scheduler" if name == "scheduler" else "cluster")
