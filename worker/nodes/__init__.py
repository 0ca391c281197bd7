"""VirtualNodes (tiny placeholders) and FederatedNode actors (the materialized clients).

A `VirtualNode` is an id plus a reference to the job's shared `NodeConfig`; a million of
them fit in well under 300 MB. A `FederatedNode` is the actor that holds one client at a
time: its data indices, model weights and aggregator state; it trains and evaluates.
`NodeManager` turns the first call on a client into a materialization inside the job's
placement group and keeps at most `max_materialized` actors alive.

Actor processes are expensive on Ray (a worker process that imports torch: about 1.5 s of
CPU and ~300 MB RSS on a 2-core box), so by default the manager *recycles* actors:
dematerializing the least recently used client saves its state into the object store and
the same actor process then loads the next client. With `recycle=False` the actor is
killed and a fresh one is created instead (FedPilot's original behaviour).
"""

from .federated import client_seed
from .manager import NodeManager
from .virtual import NodeConfig, VirtualNode

__all__ = [
    "NodeConfig",
    "NodeManager",
    "VirtualNode",
    "client_seed",
]
