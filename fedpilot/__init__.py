"""What both sides of the fabric share, and the pieces that join them in one process.

- `fedpilot.data`: datasets, partitioners and label histograms (numpy/scikit-learn; no
  torch or ray on import). The clusters build their clients from it and the scheduler
  profiles a job from it, so `scheduler` never imports `worker`.
- `fedpilot.metrics`: Prometheus metrics of a job as an executor or the scheduler sees it.
- `fedpilot.loopback`: every cluster's executor in this process, joined to the scheduler's
  driver without daemons (fast tests and benchmarks).
"""
