"""The data plane is on by default, and a peer it cannot reach still gets every update.

a reaches b only through a TCP relay on 127.0.0.2 that passes b's libp2p port (b listens
on 127.0.0.1), as a NAT or forwarder would: a's dial to b's data-plane port is refused, the
body goes over libp2p through the relay at once, and b is remembered as unreachable, so
the next large updates do not dial again. c has ``limits.dataplane_min_bytes = 0``: it
offers no data plane, and large updates to it go over libp2p too."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fabricd._harness import (
    Node,
    configure,
    connected_fast,
    init_ca,
    init_node,
    transfer,
    wait_until,
)
from tests.fabricd._transfer_load import blast

pytestmark = pytest.mark.slow

MIB = 1024 * 1024
FAR_HOST = "127.0.0.2"


class Relay:
    """Forwards every connection to FAR_HOST:<port> to ``node``'s libp2p port on 127.0.0.1;
    counts bytes. ``addr``: ``node``'s multiaddr through it."""

    def __init__(self, node: Node) -> None:
        self.target = node.port
        self.forwarded = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server((FAR_HOST, 0))
        self.port = self._listener.getsockname()[1]
        self.addr = node.addr().replace(f"/ip4/127.0.0.1/tcp/{node.port}/", f"/ip4/{FAR_HOST}/tcp/{self.port}/")
        self._open: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:  # the node behind it stopped (a dial after its test ended)
                client.close()
                continue
            self._open += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 20):
                dst.sendall(data)
                with self._lock:
                    self.forwarded += len(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for sock in self._open:
            with contextlib.suppress(OSError):
                sock.close()


@pytest.fixture(scope="module")
def trio_of_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Node, Node, Relay]]:
    root: Path = tmp_path_factory.mktemp("fallback")
    ca = init_ca(root)
    b = init_node(root, "b", ca)
    c = init_node(root, "c", ca)
    configure(c, limits="dataplane_min_bytes = 0")
    nodes = [b, c]
    relay: Relay | None = None
    try:
        for node in (b, c):
            node.start()
            node.wait_ready()
        relay = Relay(b)
        a = init_node(root, "a", ca, [relay.addr, c.addr()])
        nodes.append(a)
        a.start()
        a.wait_ready()
        wait_until(lambda: {"b", "c"} <= connected_fast(a), timeout=60)
        yield a, b, c, relay
    finally:
        for node in nodes:
            node.stop()
        if relay is not None:
            relay.close()


def test_on_by_default_and_an_unreachable_plane_falls_back_at_once_and_is_remembered(
        trio_of_nodes: tuple[Node, Node, Node, Relay]) -> None:
    a, b, _, relay = trio_of_nodes
    assert transfer(b)["dataplane_port"] > 0, "the data plane is on by default"
    before = relay.forwarded
    first = blast(a, b, count=1, size=2 * MIB, sockets=1)
    assert first.failed == [] and first.delivered == 1 and first.digest_mismatch == 0, first.summary()
    sent = transfer(a)
    assert sent["dataplane_failed"] == 1 and sent["dataplane_fallbacks"] == 1, sent
    assert sent["dataplane_opened"] == 0 and sent["dataplane_unreachable_peers"] == 1, sent
    assert transfer(b)["dataplane_accepted"] == 0
    assert relay.forwarded - before >= 2 * MIB, "the body went over libp2p through the relay"
    more = blast(a, b, count=3, size=2 * MIB, sockets=1)
    assert more.failed == [] and more.delivered == 3 and more.digest_mismatch == 0, more.summary()
    sent = transfer(a)
    # remembered: no second dial, every body at once over libp2p
    assert sent["dataplane_failed"] == 1 and sent["dataplane_fallbacks"] == 4, sent
    assert a.log().count("event=update.dataplane_fallback") == 1


def test_a_peer_with_the_plane_off_gets_large_updates_over_libp2p(
        trio_of_nodes: tuple[Node, Node, Node, Relay]) -> None:
    a, _, c, _ = trio_of_nodes
    assert "dataplane_port" not in transfer(c), "limits.dataplane_min_bytes = 0 turns it off"
    before = transfer(a)
    result = blast(a, c, count=2, size=2 * MIB, sockets=1)
    assert result.failed == [] and result.delivered == 2 and result.digest_mismatch == 0, result.summary()
    after = transfer(a)
    assert after["dataplane_failed"] == before["dataplane_failed"] + 1, (before, after)
    assert after["dataplane_opened"] == before["dataplane_opened"], (before, after)
    assert (after["streams_opened"] + after["streams_reused"]
            - before["streams_opened"] - before["streams_reused"]) == 2, (before, after)
