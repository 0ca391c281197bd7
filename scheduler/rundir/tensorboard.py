"""TensorBoard scalars from a run directory (`fedpilot-scheduler status RUN_DIR --tensorboard DIR`).

An optional extra (`pip install 'fedpilot-fabric[tensorboard]'`): written with the
`tensorboard` package's own event writer, so neither torch nor TensorFlow is imported.
Each round becomes one step: accuracy, loss, personalized accuracy, seconds, inter- and
intra-cluster bytes of the round and cumulative, and per cluster the bytes it sent.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from scheduler.errors import SchedulerError

ROUND_SCALARS = ("accuracy", "loss", "personalized_accuracy", "seconds", "bytes_inter", "bytes_intra")


class TensorBoardError(SchedulerError):
    """TensorBoard output was asked for but cannot be written."""


class ScalarWriter:
    """One step per round in a fresh event file under ``log_dir/<job id>/`` (replacing the
job's earlier ones); `add_rounds` appends only rounds not written yet."""

    def __init__(self, log_dir: str | Path, job_id: str) -> None:
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise TensorBoardError("--tensorboard needs the tensorboard package: "
                                   "pip install 'fedpilot-fabric[tensorboard]' (or tensorboard)") from None
        self._event, self._summary = Event, Summary
        self.path = Path(log_dir) / job_id
        # The run directory holds the whole history: each invocation rewrites it, so
        # older event files of this job would only repeat steps.
        for old in self.path.glob("events.out.tfevents.*"):
            old.unlink()
        self._writer = EventFileWriter(str(self.path))
        self.written = 0  # rounds already written
        self._cumulative = {"bytes_inter": 0, "bytes_intra": 0}

    def add_rounds(self, rounds: list[dict[str, Any]]) -> int:
        """Write the rounds after the last one written; how many were new."""
        new = [r for r in rounds if int(r["round"]) > self.written]
        for r in new:
            step = int(r["round"])
            values = []
            for key in ROUND_SCALARS:
                if r.get(key) is not None:
                    values.append(self._summary.Value(tag=f"round/{key}", simple_value=float(r[key])))
            for key in self._cumulative:
                self._cumulative[key] += int(r.get(key) or 0)
                values.append(self._summary.Value(tag=f"total/{key}", simple_value=float(self._cumulative[key])))
            for cluster, counts in sorted((r.get("by_cluster") or {}).items()):
                for key in ("bytes_inter", "bytes_intra"):
                    if isinstance(counts, dict) and key in counts:
                        values.append(self._summary.Value(tag=f"cluster/{cluster}/{key}",
                                                          simple_value=float(counts[key])))
            self._writer.add_event(self._event(wall_time=time.time(), step=step,
                                               summary=self._summary(value=values)))
            self.written = step
        self._writer.flush()
        return len(new)

    def close(self) -> None:
        self._writer.close()
