"""Names and limits every party on the wire agrees on: protocol IDs, topics, DHT keys, sizes."""

from __future__ import annotations

SCHEMA_VERSION = 1
SUPPORTED_VERSIONS = frozenset({SCHEMA_VERSION})

PROTOCOL_UPDATE = "/fedpilot/update/1.0.0"
#: Same messages as 1.0.0, but a stream carries one update after another (header, body,
#: ack, next header) until either end closes it.
PROTOCOL_UPDATE_POOLED = "/fedpilot/update/1.1.0"
PROTOCOL_CONTROL = "/fedpilot/control/1.0.0"
PROTOCOL_MEMBER = "/fedpilot/member/1.0.0"
#: Tickets for the bulk data plane (TLS 1.3 connections for large update bodies).
PROTOCOL_DATAPLANE = "/fedpilot/dataplane/1.0.0"
#: A member behind NAT asks its gateway to join a sender's data-plane connection to its own.
PROTOCOL_SPLICE = "/fedpilot/dataplane-splice/1.0.0"
#: A member with reachability "auto" asks a gateway to dial it back: can it be reached?
PROTOCOL_DIALBACK = "/fedpilot/dialback/1.0.0"

TOPIC_HEARTBEAT = "fedpilot/heartbeat/1"

DHT_NAMESPACE = "fedpilot"

PROBE_JOB_ID = "_probe"

KIB = 1024
MIB = 1024 * KIB

#: Largest encoded message (control bodies carry job specs and routing matrices).
MAX_MESSAGE_BYTES = 4 * MIB
#: Largest bridge header; control bodies travel inside it, so it matches MAX_MESSAGE_BYTES.
MAX_BRIDGE_HEADER_BYTES = MAX_MESSAGE_BYTES
#: Default chunk for update bodies; yamux frames must stay under 16 MiB.
DEFAULT_CHUNK_BYTES = 4 * MIB
MAX_CHUNK_BYTES = 8 * MIB
#: Largest certificate blob.
MAX_CERTIFICATE_BYTES = 4 * KIB


def dht_key(cluster_id: str) -> str:
    """The Kademlia record key for a cluster: `/fedpilot/<cluster_id>`."""
    return f"/{DHT_NAMESPACE}/{cluster_id}"
