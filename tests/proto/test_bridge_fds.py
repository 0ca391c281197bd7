"""Bridge payloads as sealed memfds (proto._bridge_fds, proto.bridge framing): what a
reader accepts, what it refuses, and that every descriptor it received is closed."""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import mmap
import os
import socket
import sys
import threading
import time

import pytest

from proto import _bridge_fds, bridge
from proto._bridge_fds import (
    FdQueue,
    FdRefused,
    SharedMapping,
    SpareMemfds,
    check_sealed,
    populate_for_writing,
    sealed_memfd,
    take_checked,
)
from proto.errors import InvalidMessage, MalformedFrame

BODY = os.urandom(3 * 1024 * 1024)
DELIVERY = bridge.Delivery(job_id="j", round=1, source_node="s", target_node="t", message_id="m",
                           tensor_count=1, byte_length=len(BODY),
                           sha256=hashlib.sha256(BODY).digest(), source_cluster="a")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(autouse=True)
def _no_send_spares(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's descriptors are counted here: no spare is made behind the tests'
    backs (the spares have tests of their own below)."""
    monkeypatch.setattr(bridge, "SEND_SPARES", SpareMemfds(0))


def test_sealed_memfd_passes_the_check_and_maps_read_only() -> None:
    fd = sealed_memfd(BODY)
    mapping = take_checked(fd, len(BODY))  # closes fd
    with pytest.raises(OSError):
        os.fstat(fd)
    assert hashlib.sha256(mapping).digest() == hashlib.sha256(BODY).digest()
    with pytest.raises(TypeError):
        mapping[0] = 1  # read-only
    mapping.close()


@pytest.mark.parametrize("case", ["unsealed", "size", "pipe", "empty"])
def test_check_refuses_what_could_change_or_lies(case: str) -> None:
    if case == "pipe":
        fd, other = os.pipe()
        os.close(other)
        expected = "not a memfd"
    else:
        fd = os.memfd_create("t", os.MFD_ALLOW_SEALING)
        os.write(fd, b"x" * (0 if case == "empty" else 10))
        if case != "unsealed":
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK)
        expected = {"unsealed": "not sealed", "size": "holds 10 bytes, the frame declares 11",
                    "empty": "holds 0 bytes"}[case]
    before = _open_fds()
    with pytest.raises(FdRefused, match=expected):
        take_checked(fd, 0 if case == "empty" else 11 if case == "size" else 10)
    assert _open_fds() == before - 1  # closed on the refusal too


def test_delivery_seal_leaves_the_daemons_mapping_but_stops_new_writes() -> None:
    mapping = SharedMapping.allocate(len(BODY))
    mapping[:] = BODY
    fd = mapping.seal_for_reading()
    with pytest.raises(FdRefused, match="F_SEAL_WRITE"):
        check_sealed(fd, len(BODY))  # the strict check (executor -> daemon) wants WRITE
    check_sealed(fd, len(BODY), future_write=True)
    with pytest.raises(PermissionError):
        os.pwrite(fd, b"y", 0)
    mapping.close()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed with the mapping


def test_frame_with_memfd_round_trips_and_closes_every_descriptor() -> None:
    a, b = socket.socketpair()
    with a, b:
        before = _open_fds()
        bridge.send_payload(a, DELIVERY, BODY)
        msg, payload = bridge.recv_bridge(b, len(BODY), fds=FdQueue())
        assert msg == DELIVERY and isinstance(payload, mmap.mmap)
        assert hashlib.sha256(payload).digest() == DELIVERY.sha256
        payload.close()
        assert _open_fds() == before
        # a small payload goes as bytes
        small = dataclasses.replace(DELIVERY, byte_length=4)
        bridge.send_payload(a, small, b"abcd")
        assert bridge.recv_bridge(b, len(BODY), fds=FdQueue()) == (small, b"abcd")


def test_descriptor_on_a_frame_that_claims_none_is_refused_and_closed() -> None:
    a, b = socket.socketpair()
    with a, b:
        status = bridge.bridge_header(bridge.StatusRequest(), 0)
        fd = sealed_memfd(b"abc")
        socket.send_fds(a, [status], [fd])
        os.close(fd)
        before = _open_fds()
        with pytest.raises(MalformedFrame, match="descriptor"):
            bridge.recv_bridge(b, 0, fds=FdQueue())
        assert _open_fds() == before


def test_payload_fd_frame_without_descriptor_or_reader_is_refused() -> None:
    head = bridge.bridge_header(DELIVERY, len(BODY), in_fd=True)
    with pytest.raises(InvalidMessage, match="file descriptor"):
        bridge.decode_bridge_header(head[4:], len(BODY))
    a, b = socket.socketpair()
    with a, b:
        a.sendall(head)
        with pytest.raises(MalformedFrame, match="none did"):
            bridge.recv_bridge(b, len(BODY), fds=FdQueue())
    with pytest.raises(ValueError):
        bridge.bridge_header(bridge.StatusRequest(), 0, in_fd=True)


def test_fd_flood_is_refused_and_closed() -> None:
    queue = FdQueue()
    fds = [os.memfd_create("t") for _ in range(20)]
    before = _open_fds()
    with pytest.raises(FdRefused, match="flood"):
        for fd in fds:
            queue.add([fd])
    assert len(queue) == 0 and _open_fds() < before


def _settled(spares: SpareMemfds) -> int:
    """The bytes ``spares`` holds once its background thread is done."""
    deadline = time.monotonic() + 30
    while spares._making:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return spares.held_bytes


def test_a_spare_is_made_ahead_given_once_and_sealed_like_a_fresh_one() -> None:
    fds = _open_fds()
    spares = SpareMemfds(limit=8 * 1024 * 1024, count=2)
    assert SharedMapping.allocate(len(BODY), spares=spares) is not None and spares.missed == 1
    spares.refill(len(BODY))
    assert _settled(spares) == len(BODY)
    spare = spares.take(len(BODY))
    assert spare is not None and len(spare) == len(BODY) and spares.taken == 1
    assert spares.take(len(BODY)) is None and spares.held_bytes == 0  # handed out once
    spare[:] = BODY
    fd = spare.seal_for_reading()
    check_sealed(fd, len(BODY), future_write=True)
    assert hashlib.sha256(take_checked(os.dup(fd), len(BODY), future_write=True)).digest() == hashlib.sha256(BODY).digest()
    spare.close()
    assert _open_fds() == fds


def test_spares_stay_within_their_bounds_and_go_when_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    size = 2 * 1024 * 1024
    spares = SpareMemfds(limit=5 * 1024 * 1024, count=2)
    for _ in range(4):  # one at a time, at most 2 and 5 MiB
        spares.refill(size)
        _settled(spares)
    assert spares.held_bytes == 2 * size
    assert spares.take(size + 4096) is None  # only the exact size is taken
    SpareMemfds(limit=1024 * 1024).refill(2 * 1024 * 1024)  # over its limit: nothing made
    off = SpareMemfds(limit=0)
    off.refill(size)
    assert off.held_bytes == 0 and off.take(size) is None and off.missed == 0
    spares.refill(100)  # small bodies need none
    monkeypatch.setattr(SpareMemfds, "IDLE_SECONDS", 0.0)
    time.sleep(0.01)
    assert spares.take(size) is None and spares.held_bytes == 0  # idle ones were closed


def test_a_sealed_payload_goes_into_a_spare_made_for_the_next_one() -> None:
    fds = _open_fds()
    spares = SpareMemfds(limit=8 * 1024 * 1024, count=1, name="fedpilot-update")
    first = sealed_memfd(BODY, spares=spares)  # a new memfd; a spare made for the next
    assert _settled(spares) == len(BODY) and spares.taken == 0
    other = os.urandom(len(BODY))
    second = sealed_memfd(other, spares=spares)  # into the spare (no write may remain)
    assert spares.taken == 1
    for fd, body in ((first, BODY), (second, other)):
        check_sealed(fd, len(BODY))
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        assert take_checked(fd, len(BODY))[:] == body  # closes fd
    _settled(spares)
    spares.close()
    assert _open_fds() == fds


def test_pages_are_populated_with_the_gil_released(monkeypatch: pytest.MonkeyPatch) -> None:
    """A spare's pages are made while a daemon's event loop runs in the same process: the
    population must not hold the GIL (mmap.madvise does, for all of it). With a switch
    interval longer than the test, the GIL changes threads only when the holder gives it up,
    so the main thread ticks while the pages are populated only if that call released it
    (holding it, the main thread gets exactly one tick: after the call is over)."""
    mapping = SharedMapping.allocate(128 * 1024 * 1024, "fedpilot-test")
    go, done = threading.Event(), threading.Event()

    def populate() -> None:
        go.wait()
        try:
            populate_for_writing(mapping)
        finally:
            done.set()

    ticks = 0
    worker = threading.Thread(target=populate)
    worker.start()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        go.set()
        while not done.is_set():
            time.sleep(0.0005)  # gives the GIL up; the populating thread takes it
            ticks += 1
    finally:
        sys.setswitchinterval(interval)
    worker.join()
    mapping.close()
    assert ticks >= 3, f"the main thread stood still while the pages were populated ({ticks} ticks)"
    # and a spare is made this way
    called: list[int] = []
    monkeypatch.setattr(_bridge_fds, "populate_for_writing", lambda m: called.append(len(m)))
    spares = SpareMemfds(limit=8 * 1024 * 1024, count=1)
    spares.refill(len(BODY))
    assert _settled(spares) == len(BODY) and called == [len(BODY)]
    spares.close()
