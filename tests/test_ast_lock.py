"""CPython 3.11's AST constructor keeps its recursion depth per interpreter: threads that
parse at once (``ast.parse``, and ``traceback`` placing its carets) raise a spurious
``SystemError: AST constructor recursion depth mismatch`` when the collector runs a
finaliser mid-parse and switches threads (seen once in CI, in a job.start). Once fedcore
is imported (every process of ours imports it), parses take turns.

Reproduced here (2026-11-26): four threads parsing a 200-function module while making
objects whose ``__del__`` sleeps, switch interval 1 us: the SystemError within 4-40 s
without fedcore, none in the same runs with it. Too slow and too random for the suite;
these tests check the turn-taking itself."""

from __future__ import annotations

import ast
import threading

import pytest

import fedcore  # noqa: F401 - installs the lock
from fedcore import _ast_lock


def test_a_parse_waits_while_another_thread_parses() -> None:
    assert getattr(ast.parse, "_fedpilot_locked", False)
    done = threading.Event()

    def parse() -> None:
        ast.parse("x = 1")
        done.set()

    with _ast_lock._LOCK:  # as if this thread were mid-parse
        thread = threading.Thread(target=parse, daemon=True)
        thread.start()
        assert not done.wait(0.3), "a second thread parsed while the first held the parser"
    assert done.wait(30), "the second parse never ran once the first was done"
    thread.join(30)


def test_the_locked_parse_is_still_ast_parse() -> None:
    tree = ast.parse("x: int = 1", mode="exec", type_comments=True)
    assert isinstance(tree.body[0], ast.AnnAssign)
    with pytest.raises(SyntaxError, match="f.py|invalid syntax"):
        ast.parse("x = = 1", filename="f.py")
    wrapped = ast.parse
    _ast_lock._install()  # a second install does not wrap it twice
    assert ast.parse is wrapped
    assert not _ast_lock._LOCK._is_owned()  # type: ignore[attr-defined]
