"""Daemons for tests, forked from a warm process instead of started from nothing.

A test run starts about 240 `fabricd` daemons (LocalTestbed's and tests/fabricd's
harness's), and each spent 0.9 s of CPU importing libp2p, trio and numpy before it did
anything: 3-4 minutes of the suite's 2 cores. Each pytest process now starts one zygote,
`python -m tests._zygote`, which imports fabricd once and forks a daemon per request; the
child sets its session, log file, working directory and environment as `subprocess.Popen`
would and runs `fabricd.cli.main(argv)`: the same code from the command line on, in its own
process, over real sockets. The zygote reaps its children and reports their exit codes, so
`ZygoteProcess` answers `pid`, `poll`, `wait`, `send_signal`, `kill` and `terminate` as a
`Popen` does (`ps` shows a forked daemon with the zygote's command line; its pid is the
one `ZygoteProcess.pid` gives). Anything else (and every daemon that `fedpilot-scheduler
submit --local` or `fabricd --config` starts outside the tests) is started from nothing.
"""

from __future__ import annotations

import io
import json
import math
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


# ---- the zygote (its own process) ---------------------------------------------------------

def _child(req: dict[str, Any], closing: list[int], ready: int) -> int:
    """In the forked child: become the process Popen would have started (its session
    before the zygote answers, as Popen returns after the child's setsid), run fabricd."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in closing:
        os.close(fd)
    if req["session"]:
        os.setsid()
    os.write(ready, b"1")
    os.close(ready)
    log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(devnull)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra  # as a fresh interpreter would see them
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    sys.argv = [req["argv0"], *req["argv"]]
    import fabricd.cli

    return fabricd.cli.main(req["argv"])


def _serve() -> None:
    import fabricd.cli
    import fabricd.daemon  # noqa: F401 - the warm part every child shares
    import fedcore.logs  # noqa: F401

    # a daemon must see SIGTERM whichever thread of the test process started the zygote
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    out = sys.stdout.buffer

    def send(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg).encode() + b"\n")
        out.flush()

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    buf = b""
    while True:
        for key, _ in sel.select():
            if key.fd == wake_r:
                os.read(wake_r, 4096)
                reap()
                continue
            data = os.read(0, 1 << 16)
            if not data:
                return  # the test process is gone; its children are the tests' to end
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                ready_r, ready_w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        code = _child(req, [wake_r, wake_w, sel.fileno(), ready_r], ready_w)
                    except SystemExit as exc:
                        code = exc.code if isinstance(exc.code, int) else 1
                    except BaseException:  # noqa: BLE001 - the child's last words, in its log
                        traceback.print_exc()
                    finally:
                        sys.stdout.flush()
                        sys.stderr.flush()
                        os._exit(code)
                os.close(ready_w)
                os.read(ready_r, 1)  # its session is made (or it died: end of file)
                os.close(ready_r)
                send({"id": req["id"], "pid": pid})
            reap()


# ---- the test process's side --------------------------------------------------------------

class ZygoteProcess:
    """A daemon the zygote forked, with the part of `subprocess.Popen` the tests use."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self._zygote = zygote
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            code = self._zygote.wait_exit(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.returncode = code
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    def __init__(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "tests._zygote"], cwd=ROOT,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._cond = threading.Condition()
        self._pids: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self._ids = 0
        self._gone = False
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if "exit" in msg:
                    self._exits[msg["exit"]] = msg["code"]
                else:
                    self._pids[msg["id"]] = msg["pid"]
                self._cond.notify_all()
        with self._cond:
            self._gone = True
            self._cond.notify_all()

    def spawn(self, argv0: str, argv: list[str], *, log: str, env: dict[str, str] | None,
              session: bool) -> ZygoteProcess:
        with self._cond:
            if self._gone:
                raise RuntimeError("the test zygote exited (its stderr says why)")
            self._ids += 1
            ident = self._ids
            req = {"id": ident, "argv0": argv0, "argv": argv, "log": log, "cwd": os.getcwd(),
                   "env": dict(os.environ if env is None else env), "session": session}
            assert self._proc.stdin is not None
            self._proc.stdin.write(json.dumps(req).encode() + b"\n")
            self._proc.stdin.flush()
            if not self._cond.wait_for(lambda: ident in self._pids or self._gone, timeout=60):
                raise RuntimeError("the test zygote did not fork a daemon within 60 s")
            if ident not in self._pids:
                raise RuntimeError("the test zygote exited (its stderr says why)")
            return ZygoteProcess(self, self._pids.pop(ident), [argv0, *argv])

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            if pid in self._exits:
                return self._exits[pid]
            if self._gone and not _alive(pid):
                return -1  # reaped by init once the zygote died: its code is lost
            return None

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        """Its exit code; None when `timeout` ran out first (also once the zygote died and
        the orphan is watched through /proc)."""
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self._gone, timeout)
        code = self.exit_code(pid)
        while code is None and self._gone and time.monotonic() < deadline:
            time.sleep(0.05)
            code = self.exit_code(pid)
        return code


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


ENABLED = os.environ.get("FEDPILOT_TEST_ZYGOTE", "1") != "0"
_zygote: Zygote | None = None
_lock = threading.Lock()


def popen(args: list[str], *, stdout: Any = None, stderr: Any = None,
          start_new_session: bool = False, env: dict[str, str] | None = None,
          **kwargs: Any) -> Any:
    """`subprocess.Popen` for a `fabricd --config FILE` daemon whose output goes to a log
    file: forked from this process's zygote. Anything else, or every daemon with
    FEDPILOT_TEST_ZYGOTE=0 in the environment: subprocess.Popen."""
    from scheduler.testbed import fabricd_command

    prefixes = (fabricd_command(), [sys.executable, "-m", "fabricd.cli"])
    command = next((p for p in prefixes if args[:len(p)] == p), None)
    log = getattr(stdout, "name", None)
    to_log = stderr in (subprocess.STDOUT, stdout)
    if (not ENABLED or command is None or kwargs or not isinstance(log, str) or not to_log
            or args[len(command):len(command) + 1] != ["--config"]):
        return subprocess.Popen(args, stdout=stdout, stderr=stderr,
                                start_new_session=start_new_session, env=env, **kwargs)
    global _zygote
    with _lock:
        if _zygote is None:
            _zygote = Zygote()
        zygote = _zygote
    return zygote.spawn(args[0], args[len(command):], log=log, env=env, session=start_new_session)


if __name__ == "__main__":
    _serve()
