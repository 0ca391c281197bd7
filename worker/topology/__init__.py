"""Topologies as networkx graphs, and the manager that routes messages along them."""

from __future__ import annotations

from .custom import AdjacencyError, load_adjacency
from .graphs import (
    DECENTRALIZED_KINDS,
    KINDS,
    SERVER,
    TREE_KINDS,
    TopologyError,
    aggregators_by_level,
    build_topology,
    children,
    chunk_groups,
    clients_of,
    custom,
    full,
    hierarchical,
    hybrid,
    k_connected_random,
    k_connected_similar,
    ring,
    star,
)
from .manager import NodeId, RemoteTransport, RoutingError, TopologyManager, Traffic
from .messages import LocalUpdate, Message, as_message, decode_message, encode_message

__all__ = [
    "DECENTRALIZED_KINDS",
    "KINDS",
    "SERVER",
    "TREE_KINDS",
    "AdjacencyError",
    "LocalUpdate",
    "Message",
    "NodeId",
    "RemoteTransport",
    "RoutingError",
    "TopologyManager",
    "Traffic",
    "as_message",
    "decode_message",
    "encode_message",
    "TopologyError",
    "aggregators_by_level",
    "build_topology",
    "children",
    "chunk_groups",
    "clients_of",
    "custom",
    "full",
    "hierarchical",
    "hybrid",
    "k_connected_random",
    "k_connected_similar",
    "load_adjacency",
    "ring",
    "star",
]
