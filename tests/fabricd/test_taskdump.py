"""``kill -USR1 <fabricd pid>``: every trio task with the frames it awaits in, and every
thread's stack, written to a file beside the daemon's config (fabricd/_taskdump.py)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import trio

from fabricd import _taskdump
from tests.fabricd._harness import wait_until


async def _parked_somewhere_findable(event: trio.Event) -> None:
    await event.wait()


@pytest.mark.trio
async def test_the_dump_names_each_task_and_where_it_waits(tmp_path: Path) -> None:
    event = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_parked_somewhere_findable, event, name="the-parked-task")
        await trio.sleep(0.05)
        path = _taskdump.dump(tmp_path)
        again = _taskdump.dump(tmp_path)  # the same second: a second file, not overwritten
        event.set()
    text = path.read_text()
    assert again != path and again.exists()
    # the task, under this test's task, with the frame it waits in
    assert re.search(r"\n  +- the-parked-task\n +\S+test_taskdump\.py:\d+ in _parked_somewhere_findable\n",
                     text), text
    assert re.search(r"# \d+ tasks\n# threads\n", text)
    assert "Current thread" in text or "Thread 0x" in text, text  # faulthandler's stacks


def test_old_dumps_are_removed_beyond_the_kept_number(tmp_path: Path) -> None:
    async def many() -> None:
        for _ in range(_taskdump.KEEP + 5):
            _taskdump.dump(tmp_path)

    trio.run(many)
    assert len(list(tmp_path.glob("fabricd-tasks-*.txt"))) == _taskdump.KEEP


@pytest.mark.slow
def test_a_running_daemon_dumps_its_tasks_on_sigusr1(mesh) -> None:  # type: ignore[no-untyped-def]
    a = mesh.nodes["a"]
    assert a.proc is not None
    before = set(a.dir.glob("fabricd-tasks-*.txt"))
    os.kill(a.proc.pid, signal.SIGUSR1)
    wait_until(lambda: "event=daemon.tasks_dumped" in a.log(), timeout=30)
    new = set(a.dir.glob("fabricd-tasks-*.txt")) - before
    assert len(new) == 1, new
    text = new.pop().read_text()
    assert "in _dial_loop" in text, text[:2000]  # discovery's dial loop, where it sleeps
    assert a.proc.poll() is None, "the daemon stopped on SIGUSR1"
