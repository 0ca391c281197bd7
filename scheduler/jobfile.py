"""Reading job.toml files: TOML → validated `JobSpec`, with errors that name the file."""

from __future__ import annotations

import tomllib
from pathlib import Path

from proto.job import DATASET_PREFIXES, JobSpec, JobSpecError


def load_job(path: str | Path) -> JobSpec:
    """Parse and validate the job file at `path`.

    Relative file references inside it (file datasets such as `npz:`, `topology.adjacency_file`,
    `placement.precomputed_file`) are resolved against the job file's directory and must
    exist. Raises `JobSpecError` with one line naming the file, the dotted key, the bad
    value and what is allowed; broken TOML names the line and column.
    """
    path = Path(path)
    source = str(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise JobSpecError(source, "", "job file not found") from None
    except OSError as exc:
        raise JobSpecError(source, "", f"cannot read job file: {exc.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise JobSpecError(source, "", "job file is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise JobSpecError(source, "", f"invalid TOML: {exc}") from None
    spec = JobSpec.from_dict(data, source=source)
    base = path.parent

    def resolve(ref: str) -> str:
        p = Path(ref)
        return str(p if p.is_absolute() else (base / p).resolve())

    spec = spec.with_paths_resolved(resolve)
    _check_files(source, spec)
    return spec


def _check_files(source: str, spec: JobSpec) -> None:
    refs = []
    prefix, sep, ref = spec.data.dataset.partition(":")
    if sep and prefix + sep in DATASET_PREFIXES:
        path = ref.partition("#")[0]  # options after '#' (see docs/job.md)
        if prefix == "imagefolder":
            if not Path(path).is_dir():
                raise JobSpecError(source, "data.dataset", f"data.dataset: folder {path} does not "
                                   "exist (paths are relative to the job file)")
        else:
            refs.append(("data.dataset", path))
    if spec.topology.kind == "custom":
        refs.append(("topology.adjacency_file", spec.topology.adjacency_file))
    if spec.placement.strategy == "precomputed":
        refs.append(("placement.precomputed_file", spec.placement.precomputed_file))
    for key, ref in refs:
        if not Path(ref).is_file():
            raise JobSpecError(source, key, f"{key}: file {ref} does not exist "
                                            "(paths are relative to the job file)")
