"""The Ray side of one cluster.

Import what you need from the subpackages; this module imports nothing. Datasets and
partitions live in `fedcore.data` (shared with the scheduler, which imports nothing
from here).

- `worker.context`: `ExecutionContext`, `InProcessContext`, `RayContext`, `PlacementError`
- `worker.nodes`: `VirtualNode`, `FederatedNode`, `NodeManager`, `NodeConfig`
- `worker.executor`: the one round engine (`ClusterEngine`), the round graph (a view of
  the routing matrix), the hybrid transport, the control service; `python -m
  worker.executor` is one cluster's executor process
- `worker.payload`: the update payload (weights + kind + samples + compression, one header)
- `worker.errors`: `WorkerError`, the root of the worker's errors
- `worker.models`, `worker.training`, `worker.aggregators`, `worker.serialization`:
  models, local training, aggregation, safetensors
"""
