"""Bridge payloads as sealed memfds (proto._bridge_fds, proto.bridge framing): what a
reader accepts, what it refuses, and that every descriptor it received is closed."""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import mmap
import os
import socket

import pytest

from proto import bridge
from proto._bridge_fds import (
    FdQueue,
    FdRefused,
    SharedMapping,
    check_sealed,
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
