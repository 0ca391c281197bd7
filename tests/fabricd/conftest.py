"""A shared mesh of real fabricd processes: a, b, c (b and c bootstrap from a)."""

from __future__ import annotations

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

    def add(self, name: str, bootstrap: list[str] = (), ca: Path | None = None,  # type: ignore[assignment]
            start: bool = True) -> Node:
        node = init_node(self.root, name, ca or self.ca, bootstrap)
        self.nodes[name] = node
        if start:
            node.start()
            node.wait_ready()
        return node

    def stop_all(self) -> None:
        for node in self.nodes.values():
            node.stop()


@pytest.fixture(scope="module")
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
        others = {"a": {"b", "c"}, "b": {"a", "c"}, "c": {"a", "b"}}
        for name, node in (("a", a), ("b", b), ("c", c)):
            wait_until(lambda n=node, want=others[name]: want <= connected_fast(n), timeout=60)
            m.connect_seconds[name] = time.monotonic() - t0
        yield m
    finally:
        m.stop_all()
