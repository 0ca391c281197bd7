"""What a daemon remembers about the peers it met: verdicts and refusals, all bounded.

Shared by fabricd.membership (the tables), fabricd._preauth (the deadline) and
fabricd._member_hello (the certificate exchange that fills them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID

from proto.certs import Certificate, parse_certificate
from proto.errors import ProtocolError

#: refusals of CA-signed (revoked, expired, refusing) certificates, by cluster id
MAX_REFUSALS = 1024
#: claims whose certificate did not verify, by peer id (status display only)
MAX_UNVERIFIED_CLAIMS = 64
MAX_REFUSED_BY = 1024


@dataclass
class PeerVerdict:
    """What we know about one connected peer's membership."""

    decided: trio.Event = field(default_factory=trio.Event)
    #: set once OUR certificate was presented and answered (or the attempt ended)
    answered: trio.Event = field(default_factory=trio.Event)
    exchanging: bool = False
    certificate: Certificate | None = None
    reason: str = ""
    since: float = field(default_factory=time.time)

    @property
    def member(self) -> bool:
        return self.decided.is_set() and self.certificate is not None


@dataclass
class Refusal:
    """A cluster id we saw claimed (or asked for) that is not a member, and why."""

    cluster_id: str
    peer_id: str
    reason: str
    addrs: tuple[str, ...] = ()
    at: float = field(default_factory=time.time)
    #: the CA signed this certificate for this peer (False: anyone could have made the claim)
    verified: bool = True


def claimed_cluster(cert_bytes: bytes | None) -> str:
    """The cluster id a certificate names, verified or not ("" if it does not parse)."""
    if not cert_bytes:
        return ""
    try:
        return parse_certificate(cert_bytes).cluster_id
    except ProtocolError:
        return ""


def peer_addrs(host: IHost, peer_id: str) -> tuple[str, ...]:
    try:
        return tuple(str(a) for a in host.get_peerstore().addrs(ID.from_base58(peer_id)))
    except (KeyError, ValueError):  # PeerStoreError (a KeyError): unknown or expired peer; not base58
        return ()


def protect(host: IHost, peer_id: str, on: bool) -> None:
    """Keep a verified member's connection out of libp2p's connection pruning."""
    network: Any = host.get_network()
    method = getattr(network, "protect" if on else "unprotect", None)
    if method is not None:
        method(ID.from_base58(peer_id), "fedpilot-member")


def is_connected(host: IHost, peer_id: str) -> bool:
    return bool(host.get_network().connections.get(ID.from_base58(peer_id)))
