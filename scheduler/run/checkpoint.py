"""Checkpoints in the run directory, and reading them back for `submit --resume DIR`.

Layout (`DIR/checkpoints/`):

    round-000004/state.json          the job state: round, placement epoch, spec, the
                                     rounds so far (what metrics.csv holds), re-plan counts
    round-000004/0003-g%3Aa.safetensors
                                     the state needed to continue, one file per node: its
                                     model ("model/<tensor>") and its aggregator's server
                                     state ("aggregator/<slot>/<tensor>"), exactly the
                                     update payload its executor streamed here; named by
                                     the node's index and its percent-encoded name (any
                                     node name, e.g. a hybrid group 'g:cluster-1'), and
                                     state.json maps node -> file
    LATEST                           the name of the newest complete checkpoint

A checkpoint is written into a temporary directory, fsynced and renamed into place, and
only then does LATEST (itself written to a temporary file and renamed) point at it, so a
crash mid-write leaves the previous checkpoint intact. The two newest are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from scheduler.errors import JobFailed

KEEP = 2
VERSION = 2
MAX_NODE_NAME = 256
#: a node's file: its index, then its name percent-encoded (shortened; the index is unique)
_FILE = re.compile(r"^[0-9]{4,}-[A-Za-z0-9_.~%-]{0,96}\.safetensors$")
_V1_NODE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")  # version 1: the file was <node>.safetensors


def node_files(nodes: list[str]) -> dict[str, str]:
    """A file name for every node, whatever characters its name has."""
    files = {}
    for i, node in enumerate(sorted(nodes)):
        if not node or len(node) > MAX_NODE_NAME:
            raise JobFailed(f"cannot checkpoint node {node[:80]!r}: a node name is 1 to "
                            f"{MAX_NODE_NAME} characters")
        readable = quote(node, safe="")[:96]
        files[node] = f"{i:04d}-{readable}.safetensors"
    return files


@dataclass
class Checkpoint:
    round: int                              # the last round it includes
    epoch: int                              # the placement epoch in effect after it
    spec: dict[str, Any]
    rounds: list[dict[str, Any]]            # RoundRecord dicts, rounds 1..round
    models: dict[str, bytes]                # node -> its state payload (safetensors)
    replans: int = 0
    migrations: int = 0
    faults: list[dict[str, Any]] = field(default_factory=list)

    def state(self, files: dict[str, str]) -> dict[str, Any]:
        return {"version": VERSION, "round": self.round, "epoch": self.epoch, "spec": self.spec,
                "rounds": self.rounds, "replans": self.replans, "migrations": self.migrations,
                "faults": self.faults, "nodes": files}


def _fsync_write(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_checkpoint(run_dir: Path, ckpt: Checkpoint) -> Path:
    """Write `ckpt` atomically under run_dir/checkpoints; the directory it is in."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"round-{ckpt.round:06d}"
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    files = node_files(list(ckpt.models))
    for node, payload in ckpt.models.items():
        _fsync_write(tmp / files[node], payload)
    _fsync_write(tmp / "state.json", json.dumps(ckpt.state(files), indent=1).encode())
    final = root / name
    if final.exists():  # the same round again (a repeated round): replace it whole
        shutil.rmtree(final)
    os.rename(tmp, final)
    latest_tmp = root / f".LATEST-{os.getpid()}"
    _fsync_write(latest_tmp, name.encode())
    os.replace(latest_tmp, root / "LATEST")
    dir_fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    done = sorted(p for p in root.glob("round-*") if p.is_dir())
    for old in done[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(run_dir: Path) -> Checkpoint:
    """The newest complete checkpoint in `run_dir`; JobFailed saying what is wrong."""
    root = Path(run_dir) / "checkpoints"
    try:
        name = (root / "LATEST").read_text().strip()
    except OSError:
        raise JobFailed(f"{run_dir} has no checkpoint ({root / 'LATEST'} is missing): run the "
                        "job with [faults] checkpoint_every = N to write them") from None
    where = root / name
    if not re.fullmatch(r"round-\d{6}", name) or not where.is_dir():
        raise JobFailed(f"{root / 'LATEST'} names {name!r}, which is not a checkpoint there")
    try:
        state = json.loads((where / "state.json").read_text())
        models = {node: (where / name).read_bytes()
                  for node, name in _files(state["nodes"], int(state.get("version", 1))).items()}
        return Checkpoint(round=int(state["round"]), epoch=int(state["epoch"]),
                          spec=dict(state["spec"]), rounds=list(state["rounds"]), models=models,
                          replans=int(state.get("replans", 0)),
                          migrations=int(state.get("migrations", 0)),
                          faults=list(state.get("faults", [])))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise JobFailed(f"checkpoint {where} cannot be read: {type(exc).__name__}: {exc}") from None


def _files(listed: Any, version: int) -> dict[str, str]:
    """state.json's nodes as node -> file name (checked: a plain name in the directory)."""
    if version == 1:  # a list of plain node names, each file <node>.safetensors
        if not isinstance(listed, list) or not all(isinstance(n, str) and _V1_NODE.match(n)
                                                   for n in listed):
            raise ValueError("nodes must be a list of plain node names")
        return {n: f"{n}.safetensors" for n in listed}
    if version != VERSION:
        raise ValueError(f"checkpoint version {version} is not {VERSION} (a newer fedpilot "
                         "wrote it?)")
    if not isinstance(listed, dict) or not all(
            isinstance(n, str) and 0 < len(n) <= MAX_NODE_NAME and isinstance(f, str)
            and _FILE.match(f) for n, f in listed.items()):
        raise ValueError("nodes must map node names to <index>-<name>.safetensors files")
    return dict(listed)
