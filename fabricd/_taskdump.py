"""What a running daemon is waiting on: ``kill -USR1 <fabricd pid>`` writes every trio
task (its name and the frames it awaits in) and every thread's stack to a file beside
the daemon's config, and logs ``daemon.tasks_dumped path=...``.

For a daemon that looks stuck (a stream that stalls, a transfer that never ends) without
stopping it or attaching a debugger: the file says which task waits where.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from pathlib import Path
from typing import Any, TextIO

import trio

from fedcore.logs import get_logger

log = get_logger("fabricd.taskdump")

#: dumps kept per directory (the oldest are removed): a loop of signals cannot fill the disk
KEEP = 20


def write_task_tree(out: TextIO) -> int:
    """Every task of the current trio run, indented under its parent; returns how many."""
    count = 0

    def walk(task: Any, depth: int) -> None:
        nonlocal count
        count += 1
        pad = "  " * depth
        out.write(f"{pad}- {task.name}\n")
        for frame, lineno in task.iter_await_frames():
            code = frame.f_code
            out.write(f"{pad}    {code.co_filename}:{lineno} in {code.co_name}\n")
        for nursery in task.child_nurseries:
            for child in sorted(nursery.child_tasks, key=lambda t: t.name):
                walk(child, depth + 1)

    walk(trio.lowlevel.current_root_task(), 0)
    return count


def dump(directory: Path) -> Path:
    """Write the task tree and all threads' stacks to a new file in ``directory``."""
    stem = f"fabricd-tasks-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    path = directory / f"{stem}.txt"
    n = 0
    while path.exists():  # two signals within a second
        n += 1
        path = directory / f"{stem}.{n}.txt"
    with path.open("w") as out:
        out.write(f"# fabricd pid {os.getpid()} at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
        out.write("# trio tasks (each with the frames it awaits in)\n")
        tasks = write_task_tree(out)
        out.write(f"# {tasks} tasks\n# threads\n")
        out.flush()
        faulthandler.dump_traceback(out, all_threads=True)
    for old in sorted(directory.glob("fabricd-tasks-*.txt"), key=lambda p: p.stat().st_mtime)[:-KEEP]:
        old.unlink(missing_ok=True)
    return path


async def serve(directory: Path, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Dump on every SIGUSR1 until cancelled."""
    with trio.open_signal_receiver(signal.SIGUSR1) as signals:
        task_status.started()
        async for _ in signals:
            try:
                path = dump(directory)
            except OSError as exc:
                log.warning("daemon.tasks_dump_failed", directory=str(directory),
                            reason=f"{type(exc).__name__}: {exc}")
                continue
            log.info("daemon.tasks_dumped", path=str(path))
