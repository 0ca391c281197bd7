"""LocalTestbed.prepare writes the CA and every daemon's identity and cluster.toml in this
process (fabricd.cli.call); a step that fails is a JobFailed naming the step and why."""

from __future__ import annotations

from pathlib import Path

import pytest

from fabricd.config import load_config
from scheduler.run.driver import JobFailed
from scheduler.testbed import LocalTestbed


def test_prepare_writes_loadable_configs_bootstrapped_from_the_first(tmp_path: Path) -> None:
    tb = LocalTestbed(2, backend="inprocess", workdir=str(tmp_path / "tb"))
    configs = tb.prepare()
    assert set(configs) == {"cluster-1", "cluster-2", "scheduler"}
    first = load_config(configs["cluster-1"])
    for name in ("cluster-2", "scheduler"):
        cfg = load_config(configs[name])
        assert len(cfg.bootstrap) == 1 and cfg.bootstrap[0].startswith(first.listen[0] + "/p2p/12D3KooW")
    assert load_config(configs["scheduler"]).role == "scheduler"


def test_a_failed_step_names_itself_and_the_cause(tmp_path: Path) -> None:
    (tmp_path / "tb" / "ca").mkdir(parents=True)
    (tmp_path / "tb" / "ca" / "ca.key").write_text("someone else's CA key")
    tb = LocalTestbed(2, backend="inprocess", workdir=str(tmp_path / "tb"))
    with pytest.raises(JobFailed, match=r"testbed: creating the testbed CA failed: .*ca\.key already exists"):
        tb.prepare()
    assert (tmp_path / "tb" / "ca" / "ca.key").read_text() == "someone else's CA key"
