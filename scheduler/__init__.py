"""The scheduler: job specs, data-driven placement, the routing matrix, the round driver.

Public entry points (imported from their modules so that `import scheduler` stays light):

- `scheduler.jobfile.load_job(path) -> proto.job.JobSpec`
- `scheduler.planning.plan.plan_job(spec, clusters, *, strategy, histograms, compare, epoch) -> Plan`
  and `scheduler.planning.plan.plan_placement(spec, histograms, clusters, ...) -> PlacementResult`
- `scheduler.planning.clusters.ClusterSlot`, `scheduler.planning.clusters.parse_clusters("a:100,b:100")`
- `scheduler.planning.topology.build_topology(...)`
- the pipeline stages in `scheduler.planning.placement`
- `scheduler.cli.main` (the `fedpilot-scheduler` console script)
"""
