"""A WAN link in user space, for netns-testbed.sh --wan on a kernel without sch_netem.

    wanlink.py NS_A DEV_A NS_B DEV_B DELAY_MS LOSS_PERCENT

Creates a TAP device DEV_A in network namespace NS_A and DEV_B in NS_B (both vanish with
this process) and carries every Ethernet frame from one to the other after DELAY_MS,
dropping each with probability LOSS_PERCENT / 100, in both directions: what
`tc qdisc add ... netem delay DELAY_MS loss LOSS_PERCENT%` on both ends would do. Frames
keep their order. Prints "ready" once both devices exist. Rate limits stay with tc (tbf).
Linux only, root (setns, /dev/net/tun); standard library only.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import os
import random
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
CLONE_NEWNET = 0x40000000


def tap(ns: str, name: str) -> int:
    """A TAP device ``name`` in namespace ``ns``: its file descriptor, non-blocking."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{ns}") as nsfile:
        if libc.setns(nsfile.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {ns}")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def run(a: int, b: int, delay: float, loss: float) -> None:
    queued: dict[int, collections.deque[tuple[float, bytes]]] = {
        a: collections.deque(), b: collections.deque()}  # frames due out of that fd
    other = {a: b, b: a}
    while True:
        due = min((q[0][0] for q in queued.values() if q), default=None)
        timeout = None if due is None else max(0.0, due - time.monotonic())
        readable, _, _ = select.select([a, b], [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            while True:
                try:
                    frame = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if random.random() >= loss:
                    queued[other[fd]].append((now + delay, frame))
        for fd, queue in queued.items():
            while queue and queue[0][0] <= now:
                try:
                    os.write(fd, queue.popleft()[1])
                except OSError:  # the device is down or its queue full: the frame is lost
                    pass


def main() -> None:
    ns_a, dev_a, ns_b, dev_b, delay_ms, loss_pct = sys.argv[1:]
    a, b = tap(ns_a, dev_a), tap(ns_b, dev_b)
    print("ready", flush=True)
    run(a, b, float(delay_ms) / 1000, float(loss_pct) / 100)


if __name__ == "__main__":
    main()
