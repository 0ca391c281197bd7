"""Strangers cannot deny a member the data plane (fabricd/_dataplane.py): 300 connections
to a daemon's data-plane port, reopened as fast as it closes them - half silent, half a
TLS ClientHello cut short - and a member's 4 MiB updates still go over the plane (none
falls back to libp2p), because a member's connection shows its ticket's tag and takes a
handshake slot strangers cannot hold. The same flood on a gateway's data-plane port does
not keep two private members' updates from being spliced there either (a splice's halves
show their tokens first, as a ticket's holder shows its tag)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fabricd._harness import (
    Node,
    bridge_status,
    init_ca,
    start_pair,
    start_relayed,
    wait_until,
)
from tests.fabricd._transfer_load import blast

pytestmark = pytest.mark.slow

STRANGERS = 300
THREADS = 30
MIB = 1024 * 1024
#: a TLS record header announcing a 512-byte ClientHello, then only part of it
CUT_HELLO = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(40)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Node]]:
    nodes = start_pair(tmp_path_factory.mktemp("dpflood"))
    yield nodes
    for node in nodes:
        node.stop()


def _flood(port: int, stop: threading.Event, opened: list[int], worker: int) -> None:
    """STRANGERS / THREADS connections at a time, each reopened once the daemon closes it."""
    socks: list[socket.socket | None] = [None] * (STRANGERS // THREADS)
    while not stop.is_set():
        for i, sock in enumerate(socks):
            if sock is not None:
                try:
                    if sock.recv(1) != b"":  # still open (nothing is ever sent back)
                        continue
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                sock.close()
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=2)
                if (worker + i) % 2:
                    sock.sendall(CUT_HELLO)
                sock.setblocking(False)
                socks[i] = sock
                opened[worker] += 1
            except OSError:
                socks[i] = None
        stop.wait(0.02)
    for sock in socks:
        if sock is not None:
            sock.close()


def _flooded(port: int, a: Node, b: Node) -> Any:
    """8 updates of 4 MiB from a to b, four at a time, while strangers flood ``port``."""
    stop = threading.Event()
    opened = [0] * THREADS
    threads = [threading.Thread(target=_flood, args=(port, stop, opened, w), daemon=True) for w in range(THREADS)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: sum(opened) >= STRANGERS, timeout=60)
        # four at a time: new data-plane connections are opened during the flood
        return blast(a, b, count=8, size=4 * MIB, sockets=4)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)


def _refused_at_least(node: Node, count: int) -> None:
    try:
        wait_until(lambda: bridge_status(node)["transfer"]["dataplane_refused"] >= count, timeout=30)
    except AssertionError:
        raise AssertionError((count, bridge_status(node)["transfer"])) from None


def test_a_member_keeps_the_data_plane_under_a_stranger_flood(pair: tuple[Node, Node]) -> None:
    a, b = pair
    port = int(bridge_status(b)["transfer"]["dataplane_port"])
    before_a, before_b = bridge_status(a)["transfer"], bridge_status(b)["transfer"]
    result = _flooded(port, a, b)
    assert result.failed == [] and result.delivered == 8 and result.digest_mismatch == 0, result.summary()
    after_a, after_b = bridge_status(a)["transfer"], bridge_status(b)["transfer"]
    assert after_a["dataplane_fallbacks"] == before_a["dataplane_fallbacks"], (before_a, after_a)
    sent = after_a["bytes_by_path"].get("dataplane", 0) - before_a["bytes_by_path"].get("dataplane", 0)
    assert sent >= 8 * 4 * MIB, (before_a, after_a)
    assert after_b["dataplane_accepted"] - before_b["dataplane_accepted"] >= 1, after_b
    # the flood did reach the port and was refused (a stranger is counted when its
    # handshake times out or it hangs up, so the count may trail the flood's end)
    _refused_at_least(b, before_b["dataplane_refused"] + STRANGERS // 2)


def test_private_members_keep_their_splices_under_a_stranger_flood_of_the_gateway(
        tmp_path: Path) -> None:
    nodes = start_relayed(tmp_path, init_ca(tmp_path), ("p", "q"), "relay_service = true")
    g, p, q = nodes
    try:
        wait_until(lambda: "q" in {r["cluster_id"] for r in bridge_status(p)["clusters"] if r["connected"]},
                   timeout=90)
        port = int(bridge_status(g)["transfer"]["dataplane_port"])
        before_p, before_g = bridge_status(p)["transfer"], bridge_status(g)
        result = _flooded(port, p, q)
        after_p, after_g = bridge_status(p)["transfer"], bridge_status(g)
        # the flood did reach the gateway's port and was refused
        _refused_at_least(g, before_g["transfer"]["dataplane_refused"] + STRANGERS // 2)
    finally:
        for node in nodes:
            node.stop()
    assert result.failed == [] and result.delivered == 8 and result.digest_mismatch == 0, result.summary()
    assert after_p["dataplane_fallbacks"] == before_p["dataplane_fallbacks"], (before_p, after_p)
    spliced = (after_p["bytes_by_path"].get("dataplane_relayed", 0)
               - before_p["bytes_by_path"].get("dataplane_relayed", 0))
    assert spliced >= 8 * 4 * MIB, (before_p, after_p)
    service = after_g["relay"]["service"]
    assert service["splices_joined"] > before_g["relay"]["service"]["splices_joined"], service
