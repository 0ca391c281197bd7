"""What a job may make this cluster import and read: the cluster operator's allow-lists.

A signed ``job.start`` names a model (built-in, or ``package.module:Class``), maybe an
aggregator class, and a dataset (built-in, or ``PREFIX:PATH``). The cluster's
``cluster.toml`` decides which of those it accepts::

    [allow]
    models = ["mylab.models"]         # modules (and their submodules) job classes may come from
    data_roots = ["data", "/srv/fl"]  # directories job datasets may be read from

Defaults: built-in models only, and the ``data`` directory next to ``cluster.toml``.
fabricd passes the lists to the executor it launches in the environment
(``FEDPILOT_ALLOWED_MODULES``, ``FEDPILOT_DATA_ROOTS``: JSON lists). ``check_job`` runs
before anything is imported or opened.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from proto.job import AGGREGATORS, DATASET_PREFIXES, DATASETS, MODELS, JobSpec
from worker.errors import WorkerError

ENV_MODULES = "FEDPILOT_ALLOWED_MODULES"
ENV_DATA_ROOTS = "FEDPILOT_DATA_ROOTS"


class JobNotAllowed(WorkerError, ValueError):
    """The job names code or data outside this cluster's allow-lists; the message says
    which, and which cluster.toml key to change."""


def _module_allowed(class_path: str, allowed_modules: Iterable[str]) -> bool:
    module = class_path.partition(":")[0]
    for entry in allowed_modules:
        entry = entry.strip()
        if not entry:
            continue
        if entry == class_path or module == entry or module.startswith(entry + "."):
            return True
    return False


def _inside(path: Path, roots: Iterable[str | os.PathLike[str]]) -> bool:
    for root in roots:
        base = Path(os.path.realpath(root))
        if path == base or base in path.parents:
            return True
    return False


def check_job(spec: JobSpec, allowed_modules: Iterable[str], data_roots: Iterable[str | os.PathLike[str]],
              *, cluster_id: str = "this cluster") -> None:
    """Raise JobNotAllowed unless every class and file ``spec`` names is allowed here.

    Pure: nothing is imported or opened (paths are resolved, symlinks included, so a
    link out of an allowed directory is refused)."""
    modules, roots = list(allowed_modules), list(data_roots)
    for key, name, builtin in (("model.name", spec.model.name, MODELS),
                               ("aggregation.name", spec.aggregation.name, AGGREGATORS)):
        if name in builtin:
            continue
        if not _module_allowed(name, modules):
            raise JobNotAllowed(
                f"job {spec.job_id!r}: {key} = {name!r} is not allowed on cluster {cluster_id!r}; "
                f"its operator may add {name.partition(':')[0]!r} to [allow] models in cluster.toml "
                f"(allowed now: {', '.join(modules) or 'built-in classes only'})")
    dataset = spec.data.dataset
    if dataset in DATASETS or spec.data.placement == "pinned":
        # a pinned job names one of this cluster's own [datasets], whose paths were held
        # to the data roots when cluster.toml was loaded (and are again when opened)
        return
    prefix = next((p for p in DATASET_PREFIXES if dataset.startswith(p)), None)
    raw = dataset[len(prefix):] if prefix else dataset
    path = Path(os.path.realpath(raw.partition("#")[0]))
    if not _inside(path, roots):
        raise JobNotAllowed(
            f"job {spec.job_id!r}: data.dataset {dataset!r} reads {path}, which is outside the data "
            f"roots of cluster {cluster_id!r}; its operator may add a directory to [allow] data_roots "
            f"in cluster.toml (allowed now: {', '.join(str(r) for r in roots) or 'none'})")


def check_job_from_environment(spec: JobSpec, *, cluster_id: str = "this cluster",
                               env: Mapping[str, str] | None = None) -> None:
    """``check_job`` with the lists fabricd passed to the executor it launched.

    An executor not launched by fabricd (in-process or loopback runs, whose job the
    same user wrote) has no lists in its environment and no policy to apply."""
    source = os.environ if env is None else env
    if ENV_MODULES not in source and ENV_DATA_ROOTS not in source:
        return
    check_job(spec, _env_list(source, ENV_MODULES), _env_list(source, ENV_DATA_ROOTS), cluster_id=cluster_id)


def _env_list(source: Mapping[str, str], name: str) -> list[str]:
    text = source.get(name, "[]")
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise JobNotAllowed(f"{name} must be a JSON list of strings, got {text[:200]!r}")
    return value
