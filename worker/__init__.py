"""The Ray side of one cluster.

Import what you need from the subpackages; this module imports nothing so that
`import worker.data` stays free of torch and ray (the scheduler relies on it):

- `worker.context`: `ExecutionContext`, `InProcessContext`, `RayContext`, `PlacementError`
- `worker.nodes`: `VirtualNode`, `FederatedNode`, `NodeManager`, `NodeConfig`
- `worker.topology`: graph builders (`build_topology`, `star`, `ring`, ...),
  `TopologyManager`, `RemoteTransport`, `Message`
- `worker.runner`: `run_job`, `RoundMetrics`, `JobRun`, `JobError`, `prepare_job`
- `worker.data`, `worker.models`, `worker.training`, `worker.aggregators`,
  `worker.serialization`: datasets, models, local training, aggregation, safetensors
"""
