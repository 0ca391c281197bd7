"""A large update received on the data plane: the receiving daemon unmaps the body's
mapping after the ack, in a thread of its own and not on the event loop (unmapping 64 MiB
takes 10-20 ms here, time in which the loop would not read the next update), and the
mapping is closed once the consumer has let go of it. In one process, against a real
listener on 127.0.0.1."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import blake3
import pytest
import trio

from fabricd import updates as fabricd_updates
from fabricd._sender import exchange_half_duplex
from fabricd.updates import UpdateService
from proto.messages import UpdateHeader
from tests.fabricd.test_dataplane_digest import _Members
from tests.fabricd.test_dataplane_tickets import _context, _Host, _identity, _peer, _ticket

BODY = os.urandom(3 * 1024 * 1024)


class _Consumer:
    def __init__(self) -> None:
        self.delivered: list[tuple[str, bytes, str]] = []

    def consumer_for(self, job_id: str) -> str | None:
        return None

    async def deliver(self, header: UpdateHeader, payload: Any, source_cluster: str) -> None:
        self.delivered.append((header.message_id, bytes(payload), type(payload.obj).__name__))


@pytest.mark.trio
async def test_a_received_body_is_unmapped_after_its_ack_off_the_event_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fabricd._dataplane import DataPlane, TlsStream, dial

    closed: list[tuple[int, bool]] = []  # (thread, the mapping is closed after the call)

    class Watched(fabricd_updates._Unmapper):
        def put(self, mapping: object) -> None:
            close = mapping.close  # type: ignore[attr-defined]

            def watched_close() -> None:
                close()
                closed.append((threading.get_ident(), bool(mapping.closed)))  # type: ignore[attr-defined]

            mapping.close = watched_close  # type: ignore[attr-defined]
            super().put(mapping)

    monkeypatch.setattr(fabricd_updates, "_UNMAPPER", Watched())
    alice = _peer()
    consumer = _Consumer()
    service = UpdateService(_Host(), _Members(str(alice)), consumer, cluster_id="b",  # type: ignore[arg-type]
                            max_update_bytes=1 << 30, max_inflight_bytes=1 << 30)
    plane = DataPlane(_Host(), listen_ip="127.0.0.1", is_member=lambda p: p == str(alice),  # type: ignore[arg-type]
                      serve=service.serve_dataplane, state_dir=tmp_path)
    service.use_dataplane(plane, 1, "blake3")
    alice_tls = _identity(str(alice), tmp_path / "alice")
    header = UpdateHeader(job_id="j", round=1, source_node="s", target_node="t", message_id="j-1",
                          tensor_count=1, byte_length=len(BODY), blake3=blake3.blake3(BODY).digest())

    async with trio.open_nursery() as nursery:
        await nursery.start(plane.run)
        loop_thread = threading.get_ident()
        answer = await _ticket(plane, alice, alice_tls)
        ctx = _context(alice_tls, server=False, pinned=answer.certificate)
        records = await trio.to_thread.run_sync(dial, "127.0.0.1", plane.port, ctx, answer.ticket)
        stream = TlsStream(records, alice, plane.limiter)
        ack, completed = await exchange_half_duplex(stream, header, BODY, 1024 * 1024, 10, 30)
        assert completed and ack.status == "ok", ack
        with trio.fail_after(10):
            while not closed:
                await trio.sleep(0.01)
        await stream.close()
        nursery.cancel_scope.cancel()
    # delivered from a shared mapping (the memfd the bridge hands on), byte for byte
    assert consumer.delivered == [("j-1", BODY, "SharedMapping")]
    assert closed == [(closed[0][0], True)], closed
    assert closed[0][0] != loop_thread, "the received body was unmapped on the event loop"
