"""Assignment strategies other than locality: round_robin, random, precomputed.

Each returns the cluster index of every client and never exceeds a capacity.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from scheduler.errors import AssignmentFileError
from scheduler.planning.placement.mapping import check_capacity


def round_robin(num_clients: int, capacities: Sequence[int]) -> np.ndarray:
    """Client i goes to the next cluster in turn that still has room."""
    check_capacity(num_clients, capacities)
    room = np.array(capacities, dtype=np.int64)
    out = np.empty(num_clients, dtype=np.int64)
    k = 0
    for i in range(num_clients):
        while room[k % len(room)] == 0:
            k += 1
        out[i] = k % len(room)
        room[k % len(room)] -= 1
        k += 1
    return out


def random_assignment(num_clients: int, capacities: Sequence[int], seed: int) -> np.ndarray:
    """A uniformly random choice of `num_clients` of the clusters' slots (seeded)."""
    check_capacity(num_clients, capacities)
    slots = np.repeat(np.arange(len(capacities)), np.asarray(capacities, dtype=np.int64))
    return np.random.default_rng(seed).permutation(slots)[:num_clients].astype(np.int64)


def load_precomputed(path: str, num_clients: int,
                     clusters: Sequence[str]) -> tuple[str, np.ndarray]:
    """Read a precomputed placement. Returns `("clusters", cluster index per client)` for a
    client → cluster assignment, or `("groups", group per client)` for FedPilot-style
    `pre_computed_data_driven_clustering` (a JSON list of lists of client ids), which the
    caller then places like data communities.

    Accepted: JSON `{"c0": "cluster-a", ...}` (keys `c<i>` or `<i>`; values cluster ids or
    indices), JSON list of cluster ids/indices (one per client), JSON list of lists of
    client ids, or CSV rows `client,cluster` (an optional header row)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise AssignmentFileError(f"{path}: cannot read the precomputed placement "
                                  f"({exc.strerror})") from None
    if p.suffix.lower() == ".csv":
        rows = [r for r in csv.reader(text.splitlines()) if r and any(x.strip() for x in r)]
        if rows and not rows[0][0].strip().lstrip("c").isdigit():
            rows = rows[1:]
        if any(len(r) != 2 for r in rows):
            raise AssignmentFileError(f"{path}: every CSV row must be 'client,cluster'")
        data: Any = {r[0].strip(): r[1].strip() for r in rows}
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise AssignmentFileError(f"{path}: invalid JSON ({exc})") from None
    if isinstance(data, list) and data and all(isinstance(g, list) for g in data):
        return "groups", _groups(path, data, num_clients)
    if isinstance(data, list):
        data = {str(i): v for i, v in enumerate(data)}
    if not isinstance(data, dict):
        raise AssignmentFileError(f"{path}: expected a JSON object client -> cluster, a list, "
                                  "or a list of client groups")
    index = {c: i for i, c in enumerate(clusters)}
    out = np.full(num_clients, -1, dtype=np.int64)
    for key, value in data.items():
        client = _client(path, key, num_clients)
        if isinstance(value, str) and value in index:
            out[client] = index[value]
        elif isinstance(value, str) and value.isdigit() and int(value) < len(clusters):
            out[client] = int(value)
        elif isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(clusters):
            out[client] = value
        else:
            raise AssignmentFileError(f"{path}: client {key} -> {value!r} names no cluster "
                                      f"(clusters: {', '.join(clusters)}, or 0..{len(clusters) - 1})")
    missing = np.nonzero(out < 0)[0]
    if len(missing):
        raise AssignmentFileError(f"{path}: {len(missing)} clients have no cluster (first: "
                                  f"c{missing[0]}); every one of {num_clients} needs one")
    return "clusters", out


def _client(path: str, key: Any, num_clients: int) -> int:
    text = str(key)
    text = text[1:] if text.startswith("c") else text
    if not text.isdigit() or int(text) >= num_clients:
        raise AssignmentFileError(f"{path}: {key!r} is not a client (expected c0..c"
                                  f"{num_clients - 1} or 0..{num_clients - 1})")
    return int(text)


def _groups(path: str, groups: list[Any], num_clients: int) -> np.ndarray:
    out = np.full(num_clients, -1, dtype=np.int64)
    for g, members in enumerate(groups):
        for key in members:
            client = _client(path, key, num_clients)
            if out[client] >= 0:
                raise AssignmentFileError(f"{path}: client {key!r} is in groups "
                                          f"{out[client]} and {g}")
            out[client] = g
    missing = np.nonzero(out < 0)[0]
    if len(missing):
        raise AssignmentFileError(f"{path}: {len(missing)} clients are in no group (first: "
                                  f"c{missing[0]})")
    return out
