"""The tests' daemons are forked from a warm process (tests/_zygote.py): each must still be
the process `subprocess.Popen` would have started - its own session, log, environment and
exit code - and anything but a daemon is started from nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import _zygote
from tests.fabricd._harness import FABRICD, init_ca, init_node

pytestmark = pytest.mark.skipif(not _zygote.ENABLED, reason="FEDPILOT_TEST_ZYGOTE=0")


def test_a_forked_daemon_runs_in_its_own_session_and_answers_like_popen(tmp_path: Path) -> None:
    node = init_node(tmp_path, "z1", init_ca(tmp_path))
    node.start()
    try:
        assert isinstance(node.proc, _zygote.ZygoteProcess)
        node.wait_ready(timeout=60)
        assert node.proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            node.proc.wait(timeout=0.2)
        assert node.status()["cluster_id"] == "z1"  # its bridge answers the real CLI
        environ = Path(f"/proc/{node.proc.pid}/environ").read_bytes().split(b"\0")
        assert b"PYTHONUNBUFFERED=1" in environ  # the environment it was given
    finally:
        code = node.stop()
    assert code == 0, node.log()  # SIGTERM: a clean stop, its code reported


def test_exit_codes_sessions_and_what_is_not_forked(tmp_path: Path) -> None:
    log = (tmp_path / "bad.log").open("ab")
    bad = _zygote.popen([*FABRICD, "--config", str(tmp_path / "missing.toml")], stdout=log,
                        stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    assert isinstance(bad, _zygote.ZygoteProcess)
    assert bad.wait(timeout=60) == 2  # EXIT_USAGE, as from the command line
    assert "missing.toml" in (tmp_path / "bad.log").read_text()
    # a killed daemon's code is -SIGKILL, and it led its own session
    node = init_node(tmp_path, "z2", init_ca(tmp_path, "ca2"))
    log = (tmp_path / "z2-own.log").open("ab")
    proc = _zygote.popen([*FABRICD, "--config", node.config], stdout=log,
                         stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    try:
        assert os.getsid(proc.pid) == proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    # not a daemon with its log: a plain subprocess
    plain = _zygote.popen([sys.executable, "-c", "print('x')"], stdout=subprocess.PIPE)
    assert isinstance(plain, subprocess.Popen)
    assert plain.communicate(timeout=60)[0] == b"x\n"


def test_a_daemon_outlives_a_dead_zygote_and_wait_keeps_its_timeout(tmp_path: Path) -> None:
    """The zygote killed under a running daemon: its exit code can no longer come back, so
    the daemon is watched through /proc; `wait(timeout)` still times out while it runs."""
    zygote = _zygote.Zygote()  # its own, not this process's shared one
    node = init_node(tmp_path, "z3", init_ca(tmp_path))
    proc = zygote.spawn(FABRICD[0], ["--config", node.config],
                        log=str(tmp_path / "z3-own.log"), env=None, session=True)
    zygote._proc.kill()
    zygote._proc.wait(timeout=60)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -1  # reaped by init: its code is lost, its end is not
