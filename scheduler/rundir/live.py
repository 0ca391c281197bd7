"""The live page of a running job: `submit --metrics HOST:PORT` serves it at `/`.

`/` is a static HTML+JS file shipped in the package (scheduler/rundir/static/live.html: no
build step, nothing fetched from the internet) that polls `/api/state`, a JSON object made
of what the run directory says (`read_run`: state, rounds — the same figures as
summary.json) and what the driver knows now (the mesh: each cluster connected, lost or
returned; the placement: clients per cluster and the data communities on each).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from importlib.resources import files
from pathlib import Path
from typing import Any

from fedcore.metrics import Route
from scheduler.rundir.status import RunDirError, read_run

ROUND_KEYS = ("round", "accuracy", "loss", "personalized_accuracy", "bytes_intra", "bytes_inter",
              "seconds", "epsilon", "stalls", "contributions", "dropped")


class LiveState:
    """What `/api/state` answers for the job whose results go to ``run_dir``.

    `driver` is set once the driver exists (before that the page shows the run directory
    only); the driver is only read, never steered."""

    def __init__(self, run_dir: str | Path, job_id: str = "") -> None:
        self.run_dir = Path(run_dir)
        self.job_id = job_id
        self.driver: Any = None
        self._rounds_total: int | None = None
        self._seen: dict[str, str] = {}  # every cluster ever in the job -> its peer id

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"job_id": self.job_id, "state": "starting", "round": 0,
                               "rounds_total": None, "rounds": [], "error": "", "notes": []}
        try:
            status = read_run(self.run_dir)
        except RunDirError as exc:  # not written yet: the testbed or the mesh is starting
            out["notes"] = [str(exc)]
        else:
            # the final summary.json has no rounds_total: keep the one seen while it ran
            self._rounds_total = status.rounds_total or self._rounds_total
            out.update(job_id=status.job_id, state=status.state, round=status.current_round,
                       rounds_total=self._rounds_total, error=status.error,
                       notes=status.notes, details=status.details,
                       rounds=[{k: _finite(r.get(k)) for k in ROUND_KEYS} for r in status.rounds])
        faults = list(getattr(getattr(self.driver, "summary", None), "faults", None) or [])
        out["faults"] = faults
        out["stage"] = str(getattr(self.driver, "stage_line", "") or "")
        out["mesh"] = self._mesh(faults)
        out["placement"] = self._placement()
        out["time"] = time.time()
        return out

    def _mesh(self, faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for c in getattr(self.driver, "clusters", None) or []:
            self._seen.setdefault(str(c.cluster_id), str(getattr(c, "peer_id", "")))
        for f in faults:
            self._seen.setdefault(str(f.get("cluster")), "")
        mesh = []
        for cid, peer in sorted(self._seen.items()):
            events = [str(f.get("event")) for f in faults if str(f.get("cluster")) == cid]
            state = ("lost" if events and events[-1] == "lost"
                     else "returned" if "returned" in events else "connected")
            mesh.append({"cluster": cid, "peer_id": peer, "state": state,
                         "losses": events.count("lost"), "returns": events.count("returned")})
        return mesh

    def _placement(self) -> dict[str, Any]:
        plan = getattr(self.driver, "plan", None)
        if plan is None:
            return {}
        p = plan.placement
        by_cluster: dict[str, Counter[int]] = {c: Counter() for c in p.clusters}
        absent = set(p.absent)
        for i, (k, community) in enumerate(zip(p.cluster_index.tolist(),
                                               p.client_community.tolist(), strict=True)):
            if i not in absent:
                by_cluster[p.clusters[k]][int(community)] += 1
        return {"strategy": p.strategy, "epoch": int(plan.routing.epoch),
                "communities": int(p.communities), "clients_per_cluster": p.clients_per_cluster(),
                "communities_per_cluster": {c: {str(k): n for k, n in sorted(cnt.items())}
                                            for c, cnt in by_cluster.items()},
                "sitting_out": len(absent)}

    def routes(self) -> dict[str, Route]:
        """`/` (the page) and `/api/state` for `RunMetrics.serve`."""
        page = files("scheduler.rundir").joinpath("static/live.html").read_bytes()
        return {"/": lambda: (page, "text/html; charset=utf-8"),
                "/api/state": lambda: (json.dumps(self.state(), default=str).encode(),
                                       "application/json")}


def _finite(value: Any) -> Any:
    """NaN and infinities as null: JSON.parse rejects them."""
    return None if isinstance(value, float) and not math.isfinite(value) else value
