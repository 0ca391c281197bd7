"""Check a job's data and model once, locally, before any daemon or Ray starts.

`check_job_inputs` loads the dataset (labels must be class ids 0..C-1), builds the model
for (input shape, C) and runs one forward pass on two samples, so a stray label, a missing
user module or a model with the wrong number of outputs is one line naming the key and the
fix, in seconds, instead of tracebacks from every cluster. Imports torch lazily:
`import fedcore.data` stays numpy-only, and `plan` (which must not import torch) checks the
data in-process and a user model in a child Python (`check_model_in_child`); built-in
models take num_classes and cannot get the output size wrong.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import TYPE_CHECKING

from proto.job import JobSpec, JobSpecError

from .datasets import Dataset, load_dataset
from .errors import DatasetError

if TYPE_CHECKING:
    from collections.abc import Sequence


def check_job_inputs(spec: JobSpec, source: str, *, model: bool = True) -> Dataset:
    """The job's dataset, after its model was built and run once (unless ``model`` is
    False); JobSpecError naming ``data.dataset`` or ``model.name`` otherwise."""
    try:
        dataset = load_dataset(spec.data.dataset)
    except DatasetError as exc:
        raise JobSpecError(source, "data.dataset", f"data.dataset: {exc}") from None
    if model:
        _check_model(spec, source, dataset)
    return dataset


def check_before_start(spec: JobSpec, source: str) -> None:
    """What `plan` and `submit` run first: the data here, a user model in a child Python
    (the calling process never imports torch); JobSpecError naming the key otherwise.

    A pinned job's data is on the clusters, not here: each cluster checks its own file and
    the model against it when the job starts (`job.start`)."""
    if spec.data.placement == "pinned":
        return
    check_job_inputs(spec, source, model=False)
    if ":" in spec.model.name:
        check_model_in_child(spec, source)


def check_model_in_child(spec: JobSpec, source: str, timeout: float = 600) -> None:
    """`check_job_inputs` in a fresh Python (same environment), for callers without torch."""
    proc = subprocess.run([sys.executable, "-m", "fedcore.data.preflight", source],
                          input=json.dumps(spec.to_dict()), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode == 0:
        return
    try:
        verdict = json.loads(proc.stdout.strip().splitlines()[-1])
        key, message = str(verdict["key"]), str(verdict["message"])
    except (IndexError, ValueError, KeyError, TypeError):
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        key, message = "model.name", f"model.name {spec.model.name!r}: the model check failed: {tail[0]}"
    raise JobSpecError(source, key, message)


def _check_model(spec: JobSpec, source: str, dataset: Dataset) -> None:
    import torch

    from worker.models import ModelError, build_model

    name = spec.model.name
    try:
        model = build_model(spec.model, dataset.input_shape, dataset.num_classes, seed=spec.seed)
    except ModelError as exc:
        raise JobSpecError(source, "model.name", f"model.name: {exc}") from None
    sample = torch.from_numpy(dataset.x_train[:2].copy())
    try:
        with torch.no_grad():
            out = model.eval()(sample)
    except Exception as exc:  # noqa: BLE001 - user code may raise anything
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise JobSpecError(
            source, "model.name",
            f"model.name {name!r} fails on input of shape {tuple(sample.shape)} from "
            f"{spec.data.dataset}: {type(exc).__name__}: {first}") from None
    if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] != len(sample):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise JobSpecError(source, "model.name",
                           f"model.name {name!r} returns {shape} for {len(sample)} samples; it must "
                           "return logits of shape (batch, num_classes)")
    if out.shape[1] != dataset.num_classes:
        raise JobSpecError(
            source, "model.name",
            f"model.name {name!r} gives {out.shape[1]} outputs per sample but data.dataset "
            f"{spec.data.dataset} has {dataset.num_classes} classes; size the last layer with "
            "the num_classes argument of Class(input_shape, num_classes)")


def main(argv: Sequence[str]) -> int:
    """Child side of `check_model_in_child`: the spec as JSON on stdin, the source as argv[0];
    prints {"key", "message"} and exits 2 if the check fails."""
    source = argv[0] if argv else "<job>"
    try:
        check_job_inputs(JobSpec.from_dict(json.loads(sys.stdin.read()), source=source), source)
    except JobSpecError as exc:
        message = str(exc)
        if message.startswith(source + ": "):
            message = message[len(source) + 2:]
        print(json.dumps({"key": exc.key, "message": message}))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
