"""The public API: run a federated job from Python, or join every cluster in one process.

- `fedpilot.run(job, local=3)`: run a job from Python (a notebook) and get back the same
  summary `fedpilot-scheduler submit` prints.
- `fedpilot.loopback`: every cluster's executor in this process, joined to the scheduler's
  driver without daemons (fast tests and benchmarks).

The data library and the job metrics both sides share live one tier down, in `fedcore`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from proto.job import JobSpec

__all__ = ["run"]


def run(job: str | os.PathLike[str] | JobSpec | Mapping[str, Any], *, local: int | None = None,
        mesh: str | os.PathLike[str] | None = None, backend: str = "ray", quiet: bool = True,
        **options: Any) -> dict[str, Any]:
    """Run a federated job and return the summary `fedpilot-scheduler submit` prints:
    `job_id`, `out` (the results directory), `clusters`, `rounds`, `final_accuracy`,
    `personalized_accuracy`, `bytes_inter_total`, `bytes_intra_total`, `seconds`.

    `job` is a job.toml path, a `proto.job.JobSpec`, or a job.toml-shaped dict
    (``{"data": {"number_of_clients": 9}, "topology": {"kind": "hybrid"}}``; relative paths
    in it start at the working directory). Exactly one of `local` (N cluster daemons and a
    scheduler daemon on this machine, torn down afterwards) and `mesh` (the cluster.toml of
    the scheduler's running fabricd) says where. `backend`: `ray` (each cluster an embedded
    Ray) or `inprocess` (threads; fast). `quiet=False` shows the progress bar on stderr.
    Any other `submit` option by its flag's name: `out`, `capacity`, `clusters`, `resume`,
    `wait`, `round_timeout`, `workdir`, `metrics`.

    With `local`, the caller is every testbed cluster's operator: the job's own model and
    aggregator modules and its dataset's directory are allowed; `allow_module=[...]` and
    `data_root=[...]` (lists, like the repeatable flags) allow more.

    Errors are the CLI's: `proto.job.JobSpecError` for a bad job (naming the key), and
    `scheduler.errors.SchedulerError` subclasses (`JobFailed`, ...) naming the cluster.
    On a `mesh`, the cluster operators' allow-lists apply as to any submitted job.
    """
    from pathlib import Path

    from proto.job import JobSpec
    from scheduler.jobfile import load_job
    from scheduler.submit import options as submit_options
    from scheduler.submit import submit

    if backend not in ("ray", "inprocess"):
        raise ValueError(f"fedpilot.run: backend = {backend!r}; use 'ray' or 'inprocess'")
    if (local is None) == (mesh is None):
        raise ValueError("fedpilot.run needs exactly one of local=N (a testbed of N clusters "
                         "on this machine) or mesh='scheduler.toml' (a running mesh)")
    if isinstance(job, JobSpec):
        spec, source = job, "fedpilot.run"
    elif isinstance(job, Mapping):
        spec = JobSpec.from_dict(job, source="fedpilot.run").with_paths_resolved(
            os.path.abspath)
        source = "fedpilot.run"
    else:
        spec, source = load_job(Path(job)), str(job)
    for key in ("allow_module", "data_root"):  # one name or path is a list of one
        if isinstance(options.get(key), str | os.PathLike):
            options[key] = [options[key]]
    args = submit_options(local=local, mesh=None if mesh is None else str(Path(mesh)),
                          backend=backend, quiet=quiet, **options)
    return submit(spec, source, args)
