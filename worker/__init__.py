"""The Ray side of one cluster.

Import what you need from the subpackages; this module imports nothing so that
`import worker.data` stays free of torch and ray (the scheduler relies on it):

- `worker.context`: `ExecutionContext`, `InProcessContext`, `RayContext`, `PlacementError`
- `worker.nodes`: `VirtualNode`, `FederatedNode`, `NodeManager`, `NodeConfig`
- `worker.executor`: the one round engine (`ClusterEngine`), the round graph (a view of
  the routing matrix), the hybrid transport, the control service; `python -m
  worker.executor` is one cluster's executor process
- `worker.payload`: the update payload (weights + kind + samples + compression, one header)
- `worker.errors`: `WorkerError`, the root of the worker's errors
- `worker.data`, `worker.models`, `worker.training`, `worker.aggregators`,
  `worker.serialization`: datasets, models, local training, aggregation, safetensors
"""
