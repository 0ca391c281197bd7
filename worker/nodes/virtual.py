"""VirtualNode: a client that may or may not be materialized (an id and the shared config).

A million of them fit in well under 300 MB (see bench/bench_virtual_nodes.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from proto.job import AggregationSpec, ModelSpec, TrainingSpec


@dataclass(frozen=True)
class NodeConfig:
    """What every client of one job shares; each VirtualNode points at the same instance."""

    job_id: str
    seed: int
    model: ModelSpec
    training: TrainingSpec
    aggregation: AggregationSpec
    input_shape: tuple[int, ...]
    num_classes: int
    #: label counts of every client's training samples, the mix the federation's model
    #: learns (personalized accuracy's reference: `label_offsets`); () where unknown
    pooled_labels: tuple[int, ...] = ()


class VirtualNode:
    """A client that may or may not be materialized: its id and the shared job config."""

    __slots__ = ("node_id", "config")

    def __init__(self, node_id: int, config: NodeConfig) -> None:
        self.node_id = node_id
        self.config = config

    def __repr__(self) -> str:
        return f"VirtualNode({self.node_id}, job={self.config.job_id!r})"
