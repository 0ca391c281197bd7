"""The scheduler: job specs, data-driven placement, the routing matrix, the round driver.

Public entry points (imported from their modules so that `import scheduler` stays light):

- `scheduler.jobfile.load_job(path) -> proto.job.JobSpec`
- `scheduler.plan.plan_job(spec, clusters, *, strategy, histograms, compare, epoch) -> Plan`
  and `scheduler.plan.plan_placement(spec, histograms, clusters, ...) -> PlacementResult`
- `scheduler.clusters.ClusterSlot`, `scheduler.clusters.parse_clusters("a:100,b:100")`
- `scheduler.topology.build_topology(...)`, `scheduler.topology.logical_edges(spec, hist)`
- the pipeline stages in `scheduler.placement`
- `scheduler.cli.main` (the `fedpilot-scheduler` console script)
"""
