"""Memory follows bytes in flight: a daemon holds at most ``limits.max_inflight_bytes`` of
payloads it was asked to send (the bridge stops reading a client until they fit) and the
receiver refuses more than its budget with ``busy``, which the sender retries - so many
more updates than fit at once all arrive, each verified."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fabricd._harness import Node, bridge_status, connected_fast, init_node, wait_until
from tests.fabricd._transfer_load import blast

pytestmark = pytest.mark.slow

MIB = 1024 * 1024
BUDGET = 32 * MIB  # the sender's
RECEIVER_BUDGET = 4 * MIB


def _small_budget(node: Node, budget: int) -> None:
    path = node.dir / "cluster.toml"
    text = path.read_text()
    text = text.replace("max_update_bytes = 1073741824", f"max_update_bytes = {4 * MIB}")
    # 48 MiB pass a 4 MiB receiver one update at a time, and each waiting sender gives up
    # after 4 stream timeouts of busy answers; two daemons on a machine busy with other
    # tests may move them at well under 1 MB/s: the window is 4 x 120 s, not 4 x 30 s.
    text = text.replace("max_inflight_bytes = 2147483648",
                        f"max_inflight_bytes = {budget}\nstream_timeout = 120.0")
    assert f"max_inflight_bytes = {budget}" in text, "the generated config changed shape"
    path.write_text(text)


@pytest.fixture(scope="module")
def pair(mesh) -> Iterator[tuple[Node, Node]]:  # type: ignore[no-untyped-def]
    a_addr = mesh.nodes["a"].addr()
    nodes = []
    # The receiver takes far less than the sender may hold (and sends in parallel, 8 per
    # peer): it must refuse some as busy.
    for name, budget in (("m1", BUDGET), ("m2", RECEIVER_BUDGET)):
        node = init_node(mesh.root, name, mesh.ca, [a_addr])
        _small_budget(node, budget)
        mesh.nodes[name] = node
        node.start()
        nodes.append(node)
    for node in nodes:
        node.wait_ready()
    wait_until(lambda: "m2" in connected_fast(nodes[0]), timeout=60)
    yield nodes[0], nodes[1]
    for node in nodes:
        node.stop()
        del mesh.nodes[node.name]


def test_more_updates_than_the_budget_all_arrive_within_it(pair) -> None:
    sender, receiver = pair
    # The receiving executor reads nothing until the sender had to retry: the receiver holds
    # one 3 MiB update of its 4 MiB meanwhile, so the next one must be refused as busy
    # (without the hold, a loaded machine may send them one after the other, never busy).
    # timeout: blast's wait (+ 60 s for deliveries) ends before pytest-timeout's 600 s, so a
    # stuck transfer fails with its summary instead of a dump of the test's threads
    result = blast(sender, receiver, count=16, size=3 * MIB, sockets=2, sample_status=True, timeout=420,
                   hold_first_until=lambda: bridge_status(sender)["transfer"]["send_retries"] > 0)
    assert result.failed == [] and result.ok == 16, result.summary()
    assert result.delivered == 16 and result.digest_mismatch == 0, result.summary()
    out = bridge_status(sender)["transfer"]
    # 48 MiB went through a daemon that never held more than its budget for sending...
    assert 0 < out["outgoing_peak_bytes"] <= BUDGET, out
    assert out["outgoing_bytes"] == 0, out
    # ...into one that never held more than its own: it refused the rest as busy, and the
    # sender retried those until they fit.
    received = bridge_status(receiver)["transfer"]
    assert 0 < received["inflight_in_peak_bytes"] <= RECEIVER_BUDGET, received
    assert received["inflight_in_bytes"] == 0, received
    assert out["send_retries"] > 0, out
    assert result.status_ms, "status must answer while the transfer runs"
