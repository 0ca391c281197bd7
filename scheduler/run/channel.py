"""The scheduler's side of its conversation with the clusters: `ClusterChannel` (control
requests to a cluster's executor, update streams to the scheduler) and `ClusterInfo`.
The driver, the lease keeper and recovery all speak through it; the bridge mesh
(`scheduler.run.mesh`) and the in-process `fedpilot.loopback` implement it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class ClusterChannel(Protocol):
    #: the cluster id under which the scheduler's side receives update streams
    local_cluster: str

    def request(self, cluster_id: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send a control message to a cluster's executor and return its reply body.

        Raises `JobFailed` naming the cluster if it is unreachable or refuses."""
        ...

    def take_update(self, job_id: str, source_node: str, timeout: float) -> bytes:
        """The payload of the update `source_node` streamed to the scheduler for `job_id`.

        Raises `JobFailed` if it does not arrive within `timeout` seconds."""
        ...


@dataclass(frozen=True)
class ClusterInfo:
    cluster_id: str
    peer_id: str = ""
    capacity: int = 0


__all__ = ["ClusterChannel", "ClusterInfo"]
