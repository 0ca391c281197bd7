"""The bottom tier the cluster side and the scheduler both build on, importing neither.

- `fedcore.data`: datasets, partitioners, file sources and the pre-start data check
  (numpy/scikit-learn; no torch or ray on import). The clusters build their clients from it
  and the scheduler profiles a job from it, so `scheduler` never imports `worker`.
- `fedcore.metrics`: Prometheus metrics of a job as an executor or the scheduler sees it.
- `fedcore.logs`: the one log style of every process (key=value lines, or JSON).
- `fedcore.dp`: differential privacy's clipping, noise and accountant (numpy; Google's
  `dp-accounting` where asked): the executors noise and account with it, and `plan`
  shows a job's noise before it runs.

Named for what it is, the core of the federation that every side shares (`fed` as in
`fedpilot`); it sits above `proto` and below `worker`, `scheduler` and `fedpilot`.
"""

from fedcore import _ast_lock  # noqa: E402, F401 - CPython 3.11: one ast.parse at a time
