"""Check a job's data and model once, locally, before any daemon or Ray starts.

`check_job_data` loads the dataset (labels must be class ids 0..C-1); a user model is
built for (input shape, C) and run once on two samples in a child Python
(`python -m worker.preflight`, which imports torch and the worker: this module, like
`plan` and `submit`, imports neither). So a stray label, a missing user module or a model
with the wrong number of outputs is one line naming the key and the fix, in seconds,
instead of tracebacks from every cluster; built-in models take num_classes and cannot get
the output size wrong.
"""

from __future__ import annotations

import json
import subprocess
import sys

from proto.job import JobSpec, JobSpecError

from .datasets import Dataset, load_dataset
from .errors import DatasetError


def check_job_data(spec: JobSpec, source: str) -> Dataset:
    """The job's dataset; JobSpecError naming ``data.dataset`` if it cannot be used."""
    try:
        return load_dataset(spec.data.dataset)
    except DatasetError as exc:
        raise JobSpecError(source, "data.dataset", f"data.dataset: {exc}") from None


def check_before_start(spec: JobSpec, source: str, *, measure: bool = False) -> int | None:
    """What `plan` and `submit` run first: the data here, a user model (any model with
    `measure`) in a child Python (the calling process never imports torch); JobSpecError
    naming the key otherwise. Returns the model's bytes where the child built it.

    A pinned job's data is on the clusters, not here: each cluster checks its own file and
    the model against it when the job starts (`job.start`)."""
    if spec.data.placement == "pinned":
        return None
    check_job_data(spec, source)
    if measure or ":" in spec.model.name:
        return check_model_in_child(spec, source)
    return None


def check_model_in_child(spec: JobSpec, source: str, timeout: float = 600) -> int | None:
    """`worker.preflight.check_job_inputs` in a fresh Python (same environment), for
    callers without torch; returns the model's bytes (None if the child did not say)."""
    proc = subprocess.run([sys.executable, "-m", "worker.preflight", source],
                          input=json.dumps(spec.to_dict()), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode == 0:
        try:
            return int(json.loads(proc.stdout.strip().splitlines()[-1])["model_bytes"])
        except (IndexError, ValueError, KeyError, TypeError):
            return None
    try:
        verdict = json.loads(proc.stdout.strip().splitlines()[-1])
        key, message = str(verdict["key"]), str(verdict["message"])
    except (IndexError, ValueError, KeyError, TypeError):
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        key, message = "model.name", f"model.name {spec.model.name!r}: the model check failed: {tail[0]}"
    raise JobSpecError(source, key, message)
