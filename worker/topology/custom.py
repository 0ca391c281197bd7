"""Reading a custom adjacency matrix from CSV, with errors that point at the cell."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np


class AdjacencyError(ValueError):
    """The adjacency CSV is unusable; the message names the file and the row/column."""


def load_adjacency(path: str | Path, *, num_nodes: int | None = None,
                   symmetric: bool = True) -> np.ndarray:
    """Read a square matrix of non-negative numbers (0/1 or weights) from a CSV file.

    Row i, column j > 0 means an edge i -> j (its weight). Blank lines are skipped and a
    first row that is not numeric is taken as a header. With `symmetric`, entry (i, j)
    must equal (j, i). The diagonal is ignored (no self loops). With `num_nodes`, the
    matrix must be exactly that size. Raises `AdjacencyError` naming file, row and column
    (1-based, counting data rows).
    """
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise AdjacencyError(f"cannot read adjacency file {str(file)!r}: {exc.strerror}") from exc
    rows = [r for r in csv.reader(text.splitlines()) if any(cell.strip() for cell in r)]
    if rows and not _numeric(rows[0][0]):
        rows = rows[1:]  # header
    if not rows:
        raise AdjacencyError(f"adjacency file {str(file)!r} has no data rows")
    n = len(rows)
    values = np.zeros((n, n), dtype=np.float64)
    for i, row in enumerate(rows):
        cells = [c.strip() for c in row]
        if len(cells) != n:
            raise AdjacencyError(
                f"adjacency file {str(file)!r}: row {i + 1} has {len(cells)} columns but the "
                f"file has {n} rows; the matrix must be square (n rows of n values)"
            )
        for j, cell in enumerate(cells):
            try:
                value = float(cell)
            except ValueError:
                raise AdjacencyError(
                    f"adjacency file {str(file)!r}: row {i + 1}, column {j + 1} is {cell!r}, "
                    "not a number (use 0/1 or a non-negative weight)"
                ) from None
            if not math.isfinite(value) or value < 0:
                raise AdjacencyError(
                    f"adjacency file {str(file)!r}: row {i + 1}, column {j + 1} is {cell!r}; "
                    "entries must be finite and >= 0"
                )
            values[i, j] = value
    if num_nodes is not None and n != num_nodes:
        raise AdjacencyError(
            f"adjacency file {str(file)!r} is {n}x{n} but the job has {num_nodes} clients "
            "(data.number_of_clients); they must match"
        )
    np.fill_diagonal(values, 0.0)
    if symmetric:
        diff = np.argwhere(~np.isclose(values, values.T))
        if len(diff):
            i, j = (int(x) for x in diff[0])
            raise AdjacencyError(
                f"adjacency file {str(file)!r} is not symmetric: row {i + 1}, column {j + 1} "
                f"is {values[i, j]:g} but row {j + 1}, column {i + 1} is {values[j, i]:g} "
                "(this topology is undirected)"
            )
    return values


def _numeric(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True
