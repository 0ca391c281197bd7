"""One ``ast.parse`` at a time in this process.

CPython 3.11 keeps the recursion depth of its AST constructor in per-interpreter state, so
two threads that parse at once (``ast.parse``, and every traceback that ``traceback``
formats: it parses the failing line to place its carets) can trip each other's check and
raise ``SystemError: AST constructor recursion depth mismatch`` (python/cpython#106905 and
the reports around it). Our processes run threads that do both: executors that serve
several clusters' requests (the loopback mesh: one per cluster), Ray's and the bridges'
threads logging failures. Seen once in CI: a job.start on cluster b failed with it.
Reproduced on 3.11.7 (tests/test_ast_lock.py); later versions were not checked, so the
lock applies on every version (parsing is never on a hot path here).
"""

from __future__ import annotations

import ast
import threading
from typing import Any

_LOCK = threading.RLock()


def _install() -> None:
    if getattr(ast.parse, "_fedpilot_locked", False):
        return
    parse = ast.parse

    def locked_parse(*args: Any, **kwargs: Any) -> Any:
        with _LOCK:
            return parse(*args, **kwargs)

    locked_parse._fedpilot_locked = True  # type: ignore[attr-defined]
    locked_parse.__doc__ = parse.__doc__
    ast.parse = locked_parse  # type: ignore[assignment]


_install()
