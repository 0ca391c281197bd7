"""Large bridge payloads passed as sealed memfds (SCM_RIGHTS) instead of a byte stream.

The bridge is a Unix socket between processes of one user on one host, so a body of
tens of MiB need not be copied through it: the writer puts it into a memfd, seals it
(no write, grow or shrink: the reader may map it and trust that it never changes) and
passes the descriptor with the frame's first byte. The reader checks the seals and the
size before it maps anything, and maps read-only. Nothing here is unpickled: a
descriptor carries bytes, checked like any payload.
"""

from __future__ import annotations

import array
import ctypes
import fcntl
import mmap
import os
import socket
import stat
import threading
import time
import weakref
from collections import deque
from typing import Any

from proto.errors import ProtocolError

#: payloads at least this large go as a memfd when both ends can (smaller ones cost more
#: in memfd set-up and mapping than in copying; measured: see bench/bench_transfer.py)
FD_MIN_BYTES = 1024 * 1024
#: the seals that make a memfd's content immutable for as long as anyone maps it
REQUIRED_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK
#: Linux >= 5.1: no new write() or writable mapping; the daemon's own mapping (the one
#: it received the body into, and verified) stays, so it need not copy or unmap it
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
#: what a delivery from the daemon must carry (the daemon vouches for its own mapping)
DELIVERY_SEALS = F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK
#: descriptors one recvmsg may bring (more is a flood: the connection is dropped)
MAX_FDS_PER_READ = 4
#: descriptors a bridge connection may hold that no frame has claimed yet
MAX_PENDING_FDS = 8
ANC_BYTES = socket.CMSG_SPACE(MAX_FDS_PER_READ * array.array("i").itemsize)


class FdRefused(ProtocolError):
    """A descriptor that is not a sealed memfd of the declared size (the reason says which)."""


def sealed_memfd(data: bytes | bytearray | memoryview, name: str = "fedpilot-update",
                 spares: SpareMemfds | None = None) -> int:
    """A new memfd holding ``data``, sealed against write, grow and shrink; the caller
    closes it (after sending it: the receiver has its own reference by then). With
    ``spares``: copied into a spare of that size if there is one (pages already in place),
    and a spare made for the next payload of that size."""
    view = memoryview(data).cast("B")
    spare = spares.take(len(view)) if spares is not None else None
    if spare is not None:
        try:
            spare[:] = view
            fd = os.dup(spare.fd)
        finally:
            spare.close()  # no writable mapping may remain for F_SEAL_WRITE
    else:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        if spare is None:
            os.ftruncate(fd, len(view))
            written = 0
            while written < len(view):
                written += os.pwrite(fd, view[written:], written)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    if spares is not None:
        spares.refill(len(view))
    return fd


def check_sealed(fd: int, size: int, *, future_write: bool = False) -> None:
    """FdRefused unless ``fd`` is a regular file sealed against write/grow/shrink and
    exactly ``size`` (> 0) bytes long (``future_write``: F_SEAL_FUTURE_WRITE will do
    instead of F_SEAL_WRITE, for deliveries from the daemon)."""
    try:
        info = os.fstat(fd)
    except OSError as exc:
        raise FdRefused(f"the descriptor cannot be inspected ({exc})") from None
    if not stat.S_ISREG(info.st_mode):
        raise FdRefused("the descriptor is not a memfd (not a regular file); send a sealed "
                        "memfd or the payload bytes")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise FdRefused("the descriptor is not a memfd (it cannot carry seals); send a sealed "
                        "memfd or the payload bytes") from None
    if future_write and seals & F_SEAL_FUTURE_WRITE:
        seals |= fcntl.F_SEAL_WRITE
    missing = REQUIRED_SEALS & ~seals
    if missing:
        names = [n for n, bit in (("F_SEAL_WRITE", fcntl.F_SEAL_WRITE), ("F_SEAL_GROW", fcntl.F_SEAL_GROW),
                                  ("F_SEAL_SHRINK", fcntl.F_SEAL_SHRINK)) if missing & bit]
        raise FdRefused(f"the memfd is not sealed ({', '.join(names)} missing): its content "
                        "could change while it is read; seal it (fcntl F_ADD_SEALS) before sending")
    if info.st_size != size or size == 0:
        raise FdRefused(f"the memfd holds {info.st_size} bytes, the frame declares {size}")


def map_readonly(fd: int, size: int) -> mmap.mmap:
    """A read-only shared mapping of a checked memfd (the fd may be closed afterwards)."""
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)


def take_checked(fd: int, size: int, *, future_write: bool = False) -> mmap.mmap:
    """Check ``fd`` (``check_sealed``), map it read-only and close it, on every path."""
    try:
        check_sealed(fd, size, future_write=future_write)
        return map_readonly(fd, size)
    finally:
        close_quietly(fd)


#: madvise(2): fault in every page of a mapping for writing, in one call (Linux >= 5.14)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_libc: Any = None


def populate_for_writing(mapping: mmap.mmap) -> None:
    """Allocate and map every page of ``mapping`` now (``MADV_POPULATE_WRITE``), with the
    GIL released: ``mmap.madvise`` holds it for the whole call, which for 64 MiB is 25-90
    ms here (more under load), and every other thread of the process (a daemon's event
    loop, an executor's bridge reader) stood still meanwhile. ctypes releases the GIL
    around a foreign call. OSError if the kernel refuses (before 5.14: EINVAL)."""
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _libc = libc
    size = len(mapping)
    region = (ctypes.c_char * size).from_buffer(mapping)  # an export: released below
    try:
        if _libc.madvise(ctypes.addressof(region), size, MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_POPULATE_WRITE) of {size} bytes: {os.strerror(err)}")
    finally:
        del region


class SharedMapping(mmap.mmap):
    """A writable shared mapping of a fresh memfd (``fd``), so that what is received into
    it can be handed on as a descriptor without a copy. The memfd is closed with the
    mapping (``close``) or when the object is collected."""

    fd: int

    @classmethod
    def allocate(cls, size: int, name: str = "fedpilot-delivery",
                 spares: SpareMemfds | None = None) -> SharedMapping:
        """A mapping of ``size`` bytes: one of ``spares`` if it has one, else a new memfd."""
        spare = spares.take(size) if spares is not None else None
        if spare is not None:
            return spare
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            mapping = cls(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        mapping.fd = fd
        mapping._closer = weakref.finalize(mapping, os.close, fd)
        return mapping

    def seal_for_reading(self) -> int:
        """Seal the memfd against new writes, growing and shrinking, and return it (still
        ours: it is closed with the mapping). Only once the bytes are complete: this
        mapping stays writable, so the daemon vouches for not writing it again."""
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, DELIVERY_SEALS)
        return self.fd

    def close(self) -> None:
        mmap.mmap.close(self)
        self._closer()

    _closer: weakref.finalize


class SpareMemfds:
    """Memfd mappings made ahead, in a background thread, for the next body of a size
    already seen.

    A fresh memfd's pages are allocated, zeroed and mapped by the kernel as they are first
    written, one fault per 4 KiB page, and here (a VM) that costs several times the copy
    itself: 64 MiB copied into a new memfd mapping took 28-30 ms of CPU, into one whose
    pages were already allocated and mapped (``MADV_POPULATE_WRITE``) 7 ms. So after a
    body of ``size`` bytes went through, ``refill(size)`` makes such a mapping in idle
    time, and the next body of that size ``take``s it instead of faulting in new pages on
    its critical path (updates of one job are the same size round after round). Bounded:
    at most ``limit`` bytes held (``0`` turns it off), at most ``count`` spares, each
    closed when unused for ``IDLE_SECONDS`` (checked on each call). A spare is handed
    out once: ``take`` gives it away, and its memfd is new, never a delivered one."""

    IDLE_SECONDS = 60.0

    def __init__(self, limit: int, count: int = 2, name: str = "fedpilot-spare") -> None:
        self.limit = limit
        self.count = count
        self.name = name
        self._lock = threading.Lock()
        self._spares: list[tuple[SharedMapping, float]] = []  # (mapping, made at)
        self._making = 0  # bytes being made right now (one at a time)
        self.taken = self.missed = 0

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(len(m) for m, _ in self._spares) + self._making

    @property
    def making_bytes(self) -> int:
        """Bytes of the spare being made right now (0: none; counted in ``held_bytes``)."""
        with self._lock:
            return self._making

    @property
    def held(self) -> int:
        """Spares held or being made (each one memfd and one mapping of this process)."""
        with self._lock:
            return len(self._spares) + (self._making > 0)

    def take(self, size: int) -> SharedMapping | None:
        """A spare mapping of exactly ``size`` bytes (now the caller's), or None."""
        with self._lock:
            self._trim()
            for spare in self._spares:
                if len(spare[0]) == size:
                    self._spares.remove(spare)
                    self.taken += 1
                    return spare[0]
            if size >= FD_MIN_BYTES and self.limit:
                self.missed += 1
        return None

    def refill(self, size: int) -> None:
        """Make a spare of ``size`` bytes in a background thread, if within the bounds."""
        with self._lock:
            self._trim()
            held = sum(len(m) for m, _ in self._spares)
            if (size < FD_MIN_BYTES or self._making or held + size > self.limit
                    or len(self._spares) >= self.count):
                return
            self._making = size
        threading.Thread(target=self._make, args=(size,), name="fedpilot-spare-memfd", daemon=True).start()

    def _make(self, size: int) -> None:
        try:  # idle time: the lowest priority for this thread, so it yields to the transfers
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
        mapping: SharedMapping | None = None
        try:
            mapping = SharedMapping.allocate(size, self.name)
            populate_for_writing(mapping)
        except (OSError, ValueError):  # out of memory, or a kernel before 5.14: no spare
            if mapping is not None:
                mapping.close()
            mapping = None
        with self._lock:
            self._making = 0
            if mapping is not None:
                self._spares.append((mapping, time.monotonic()))

    def _trim(self) -> None:
        now = time.monotonic()
        for spare in [s for s in self._spares if now - s[1] > self.IDLE_SECONDS]:
            self._spares.remove(spare)
            spare[0].close()

    def close(self) -> None:
        with self._lock:
            spares, self._spares = self._spares, []
        for mapping, _ in spares:
            mapping.close()


class FdQueue:
    """Descriptors received on one stream socket, in arrival order, until a frame claims
    one. Every descriptor it holds is closed by ``close_all`` (the connection's end)."""

    def __init__(self) -> None:
        self._fds: deque[int] = deque()

    def __len__(self) -> int:
        return len(self._fds)

    def add(self, fds: list[int]) -> None:
        self._fds.extend(fds)
        if len(self._fds) > MAX_PENDING_FDS:
            self.close_all()
            raise FdRefused(f"more than {MAX_PENDING_FDS} file descriptors arrived that no frame "
                            "claimed (a flood); the connection is closed")

    def take(self) -> int | None:
        return self._fds.popleft() if self._fds else None

    def close_all(self) -> None:
        while self._fds:
            close_quietly(self._fds.popleft())


def close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def unmap_quietly(mapping: mmap.mmap) -> None:
    """Unmap now, or, while a view (a sender's chunk, a reader) still refers to the
    mapping, leave it to the collector: unmapped when the last view goes."""
    try:
        mapping.close()
    except BufferError:
        pass


def fds_from_ancillary(ancdata: list[tuple[int, int, bytes]], flags: int) -> tuple[list[int], str | None]:
    """The descriptors in recvmsg's ancillary data, and a reason to drop the connection if
    any came that do not fit (they are closed by the kernel then) or were not SCM_RIGHTS."""
    fds: list[int] = []
    why = None
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[:len(data) - len(data) % arr.itemsize])
            fds.extend(arr)
        else:
            why = f"unexpected ancillary data (level {level}, type {kind}) on the bridge"
    if flags & socket.MSG_CTRUNC:
        why = (f"more than {MAX_FDS_PER_READ} file descriptors came with one read (a flood); "
               "the connection is closed")
    return fds, why


def keep_fds(ancdata: list[tuple[int, int, bytes]], flags: int, queue: FdQueue) -> None:
    """Put the SCM_RIGHTS descriptors of one recvmsg into ``queue`` (FdRefused if they
    flood it or break the limits; every descriptor received is closed then)."""
    if not ancdata and not flags & socket.MSG_CTRUNC:
        return
    fds, why = fds_from_ancillary(ancdata, flags)
    if why is not None:
        for fd in fds:
            close_quietly(fd)
        queue.close_all()
        raise FdRefused(why)
    queue.add(fds)


def recvmsg_fds(sock: socket.socket, n: int, queue: FdQueue, flags: int = 0) -> bytes:
    """``sock.recv(n)`` that keeps SCM_RIGHTS descriptors in ``queue`` (``keep_fds``)."""
    data, ancdata, mflags, _ = sock.recvmsg(n, ANC_BYTES, flags)
    keep_fds(ancdata, mflags, queue)
    return data

