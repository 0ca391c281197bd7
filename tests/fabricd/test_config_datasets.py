"""cluster.toml [datasets]: the files a cluster holds for pinned-data jobs, validated when
the config is loaded (inside [allow] data_roots) and handed to the executor fabricd starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from fabricd.config import ConfigError, load_config
from fabricd.executors import ExecutorLauncher
from proto import bridge
from proto._bridge_fds import SpareMemfds
from tests.fabricd._harness import cli_inprocess
from worker.executor.__main__ import apply_spare_bytes, parse_args


@pytest.fixture
def cfg_path(tmp_path: Path) -> Path:
    cli_inprocess("certs", "init-ca", "--out", str(tmp_path / "ca"))
    cli_inprocess("init", "--cluster-id", "a", "--listen", "/ip4/127.0.0.1/tcp/45124",
                  "--ca", str(tmp_path / "ca"), "--out", str(tmp_path / "a"))
    return tmp_path / "a" / "cluster.toml"


def with_datasets(path: Path, table: str) -> Path:
    path.write_text(path.read_text() + "\n[datasets]\n" + table)
    return path


def test_relative_paths_resolve_against_the_config_and_reach_the_executor(cfg_path: Path) -> None:
    base = cfg_path.parent
    config = load_config(with_datasets(
        cfg_path, 'site = "npz:data/site-a.npz"\ntable = "csv:data/t.csv#label=y"\n'))
    assert dict(config.datasets) == {"site": f"npz:{base / 'data' / 'site-a.npz'}",
                                     "table": f"csv:{base / 'data' / 't.csv'}#label=y"}
    launcher = ExecutorLauncher(cluster_id="a", bridge_socket=config.bridge_socket,
                                ray_address="inprocess", log_dir=base, datasets=config.datasets)
    command = launcher.command_for("job-1")
    args = parse_args(command[command.index("--bridge"):])
    assert args.datasets == dict(config.datasets)
    # a config without the table declares nothing, and the executor is told nothing
    bare = ExecutorLauncher(cluster_id="a", bridge_socket=config.bridge_socket,
                            ray_address="inprocess", log_dir=base)
    assert "--dataset" not in bare.command_for("job-1")


@pytest.mark.parametrize(("table", "needles"), [
    ('site = "/etc/passwd"\n', ["datasets.site", "KIND:PATH", "npz, imagefolder, csv, parquet"]),
    ('site = "npz:"\n', ["datasets.site", "KIND:PATH"]),
    ('site = 3\n', ["datasets.site", "KIND:PATH"]),
    ('"bad name" = "npz:data/x.npz"\n', ["datasets.bad name", "dataset name"]),
    ('site = "npz:/srv/elsewhere/x.npz"\n',
     ["datasets.site", "inside [allow] data_roots", "/srv/elsewhere/x.npz"]),
    ('site = "npz:data/../../secret.npz"\n', ["datasets.site", "inside [allow] data_roots"]),
])
def test_bad_entries_name_the_file_and_key(cfg_path: Path, table: str,
                                           needles: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(with_datasets(cfg_path, table))
    message = str(err.value)
    assert message.startswith(str(cfg_path))
    for needle in needles:
        assert needle in message


def test_a_symlink_out_of_the_data_roots_is_refused(cfg_path: Path, tmp_path: Path) -> None:
    (cfg_path.parent / "data").mkdir()
    (tmp_path / "secret.npz").write_bytes(b"x")
    (cfg_path.parent / "data" / "link.npz").symlink_to(tmp_path / "secret.npz")
    with pytest.raises(ConfigError, match="inside \\[allow\\] data_roots"):
        load_config(with_datasets(cfg_path, 'site = "npz:data/link.npz"\n'))


def test_no_spares_on_the_daemon_means_none_in_its_executors(monkeypatch: pytest.MonkeyPatch) -> None:
    """limits.dataplane_spare_bytes = 0 reaches the executors fabricd starts as --spare-bytes
    0, which turns their memfds made ahead off; by default they keep theirs."""
    monkeypatch.setattr(bridge, "SEND_SPARES", SpareMemfds(limit=256 * 1024 * 1024, count=1))
    common = {"cluster_id": "a", "bridge_socket": Path("/tmp/b.sock"), "ray_address": "inprocess",
              "log_dir": Path("/tmp")}
    default = ExecutorLauncher(**common).command_for("job-1")  # type: ignore[arg-type]
    off = ExecutorLauncher(**common, spares=False).command_for("job-1")  # type: ignore[arg-type]
    assert parse_args(default[default.index("--bridge"):]).spare_bytes is None
    args = parse_args(off[off.index("--bridge"):])
    assert args.spare_bytes == 0
    apply_spare_bytes(None)
    assert bridge.SEND_SPARES.limit == 256 * 1024 * 1024
    apply_spare_bytes(args.spare_bytes)
    bridge.SEND_SPARES.refill(4 * 1024 * 1024)
    assert bridge.SEND_SPARES.limit == 0 and bridge.SEND_SPARES.held_bytes == 0
    with pytest.raises(SystemExit):
        parse_args(["--bridge", "b", "--cluster-id", "a", "--job", "j", "--spare-bytes", "-1"])
