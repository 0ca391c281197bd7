"""Revocation: the local list plus a CA-signed list spread over gossip.

The serials this daemon treats as revoked are the union of
- ``revoked.txt`` (one serial per line, edited by this daemon's operator; re-read when
  it changes, via proto.certs.RevocationWatcher - the one file watcher), and
- the newest CA-signed revocation list (``fabricd certs revoke --ca``). Dropping such a
  list as ``revocations.signed`` next to ``revoked.txt`` on ANY member publishes it: that
  daemon verifies it, applies it and gossips it on TOPIC_REVOCATIONS; every member
  verifies the CA signature, applies it within a second (fabricd.membership drops
  revoked peers), stores it next to its own revoked.txt (so it survives restarts) and
  republishes it now and then for members that join later. Lists are cumulative; an
  older or equal ``issued_at`` than the one held is ignored, so nobody can roll one back.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import trio
from libp2p.peer.id import ID

from fabricd._bounded import Throttle
from fabricd.gossip import ReliableGossip
from fedcore.logs import get_logger
from proto.certs import (
    MAX_REVOCATIONS_BYTES,
    RevocationList,
    RevocationWatcher,
    verify_revocations,
)
from proto.errors import ProtocolError

log = get_logger("fabricd.revocation")

TOPIC_REVOCATIONS = "fedpilot/revocations/1"
SIGNED_FILE = "revocations.signed"
REPUBLISH_EVERY = 3.0


class Revocations:
    """The effective revocation list (local file + newest CA-signed list)."""

    def __init__(self, path: Path, ca_public: bytes) -> None:
        self.watcher = RevocationWatcher(path)
        self.ca_public = ca_public
        self.signed_path = path.with_name(SIGNED_FILE)
        self.signed: bytes = b""
        self.signed_serials: frozenset[int] = frozenset()
        self.signed_at = -1
        self._signed_stamp: tuple[int, int] | None = None
        self._merged: tuple[tuple[int, int], RevocationList] | None = None
        self.check_signed_file()

    def current(self) -> RevocationList:
        local = self.watcher.current()
        if not self.signed_serials:
            return local
        key = (id(local), self.signed_at)
        if self._merged is None or self._merged[0] != key:
            self._merged = (key, RevocationList(local.serials | self.signed_serials, local.path))
        return self._merged[1]

    def offer(self, data: bytes, source: str) -> bool:
        """Apply a CA-signed list if it verifies and is newer than ours; True if applied."""
        try:
            revocations = verify_revocations(data, self.ca_public)
        except ProtocolError as exc:
            log.warning("revocations.refused", source=source, reason=f"{type(exc).__name__}: {exc}")
            return False
        if revocations.issued_at <= self.signed_at:
            return False
        self.signed, self.signed_at = bytes(data), revocations.issued_at
        self.signed_serials = frozenset(revocations.serials)
        log.info("revocations.applied", source=source, serials=len(self.signed_serials),
                 issued_at=revocations.issued_at)
        if source != "file":
            self._store(data)
        return True

    def _store(self, data: bytes) -> None:
        tmp = self.signed_path.with_name(SIGNED_FILE + ".tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self.signed_path)
            st = self.signed_path.stat()
            self._signed_stamp = (st.st_mtime_ns, st.st_size)
        except OSError as exc:
            log.error("revocations.unsaved", path=str(self.signed_path), reason=str(exc))

    def check_signed_file(self) -> bool:
        """Apply ``revocations.signed`` if it changed; True if a newer list was applied."""
        try:
            st = self.signed_path.stat()
        except FileNotFoundError:
            return False
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._signed_stamp:
            return False
        self._signed_stamp = stamp
        if st.st_size > MAX_REVOCATIONS_BYTES + 1024:
            log.warning("revocations.refused", source="file", reason=f"{self.signed_path} is too large")
            return False
        return self.offer(self.signed_path.read_bytes(), "file")


class RevocationGossip:
    """Spreads the newest CA-signed revocation list to every member over gossip."""

    def __init__(self, pubsub: Any, revocations: Revocations, is_member: Any, own_peer: str) -> None:
        self.pubsub = pubsub
        self.gossip = ReliableGossip(pubsub)
        self.revocations = revocations
        self.is_member = is_member
        self.own_peer = own_peer
        self._throttle = Throttle(log)

    def _validate(self, forwarder: ID, msg: Any) -> bool:
        fwd = str(forwarder)
        if fwd != self.own_peer and not self.is_member(fwd):
            self._throttle.warning("gossip.rejected", peer=fwd, topic=TOPIC_REVOCATIONS,
                                   reason="forwarder is not a member")
            return False
        try:
            verify_revocations(bytes(msg.data), self.revocations.ca_public)
        except ProtocolError as exc:
            self._throttle.warning("gossip.rejected", peer=fwd, topic=TOPIC_REVOCATIONS,
                                   reason=f"revocation list refused: {type(exc).__name__}: {exc}")
            return False
        return True

    async def _publish(self) -> None:
        if self.revocations.signed:
            # Straight to pubsub, not through ReliableGossip's backpressure: one stuck peer
            # queue must not hold a revocation back from everyone else (it is republished
            # every few seconds, so a peer that missed it gets it later).
            try:
                with trio.move_on_after(5):
                    await self.pubsub.publish(TOPIC_REVOCATIONS, self.revocations.signed)
            except Exception as exc:  # noqa: BLE001 - retried on the next tick
                log.debug("revocations.publish_failed", reason=str(exc))

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.pubsub.set_topic_validator(TOPIC_REVOCATIONS, self._validate, False)
        subscription = await self.gossip.subscribe(TOPIC_REVOCATIONS)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive, subscription)
            task_status.started()
            last = trio.current_time()
            while True:
                await trio.sleep(0.5)
                fresh = self.revocations.check_signed_file()
                if fresh or trio.current_time() - last > REPUBLISH_EVERY:
                    last = trio.current_time()
                    await self._publish()

    async def _receive(self, subscription: Any) -> None:
        while True:
            msg = await subscription.get()
            if self.revocations.offer(bytes(msg.data), f"gossip from {ID(bytes(msg.from_id))}"):
                # Pass it on at once: members that do not hear the origin still get it.
                await self._publish()
