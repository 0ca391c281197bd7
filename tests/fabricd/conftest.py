"""One mesh of real fabricd processes shared by every fabricd integration test:
a, b, c (b and c bootstrap from a). Tests that disturb it (kill -9, revocation) restore
or use their own extra daemons, and every test waits for the state it needs."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fabricd._harness import Node, connected_fast, init_ca, init_node, wait_until


class Mesh:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = init_ca(root)
        self.nodes: dict[str, Node] = {}
        self.connect_seconds: dict[str, float] = {}
        self.ready_seconds = 0.0

    def add(self, name: str, bootstrap: list[str] = (), ca: Path | None = None,  # type: ignore[assignment]
            start: bool = True) -> Node:
        node = init_node(self.root, name, ca or self.ca, bootstrap)
        self.nodes[name] = node
        if start:
            node.start()
            node.wait_ready()
        return node

    def stop_all(self) -> None:
        # SIGTERM to every daemon first: their orderly shutdowns overlap instead of
        # queueing one after the other (stop() waits; a second SIGTERM is only queued).
        for node in self.nodes.values():
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes.values():
            node.stop()


@pytest.fixture(scope="session")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = Mesh(tmp_path_factory.mktemp("mesh"))
    try:
        a = m.add("a", start=False)
        a_addr = a.addr()
        b = m.add("b", [a_addr], start=False)
        c = m.add("c", [a_addr], start=False)
        t0 = time.monotonic()
        for node in (a, b, c):
            node.start()
        for node in (a, b, c):
            node.wait_ready()
        m.ready_seconds = time.monotonic() - t0
        others = {"a": {"b", "c"}, "b": {"a", "c"}, "c": {"a", "b"}}
        pending = dict(others)
        # Poll all three together so each one's time is its own, not the sum of waits.
        def all_connected() -> bool:
            for name in list(pending):
                if pending[name] <= connected_fast(m.nodes[name]):
                    m.connect_seconds[name] = time.monotonic() - t0
                    del pending[name]
            return not pending
        wait_until(all_connected, timeout=120, interval=0.05)
        yield m
    finally:
        m.stop_all()


@pytest.fixture(autouse=True)
def _stop_added_daemons(request: pytest.FixtureRequest) -> Iterator[None]:
    """Daemons a test adds to the shared mesh are stopped when it ends. Left running, a
    foreign-CA daemon or a revoked member redials a, b and c for the rest of the session
    (hundreds of rejected exchanges, gossip and connections under every later test)."""
    if "mesh" not in request.fixturenames:
        yield
        return
    mesh: Mesh = request.getfixturevalue("mesh")
    before = set(mesh.nodes)
    yield
    for name in set(mesh.nodes) - before:
        mesh.nodes.pop(name).stop()
