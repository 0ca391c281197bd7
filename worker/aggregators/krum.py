"""Krum (Blanchard et al., 2017): pick the single update closest to its neighbours.

With fewer than krum_byzantine + 3 updates krum cannot score them. A job's plan cannot
always rule that out: a hierarchy's root or a hybrid group at `client_fraction` < 1 has
as many updates as the round left it active children (wine, 20 clients at 0.3: 3 at a
hierarchy's root, 1 in a hybrid group), and the round failed with AggregationError. Such
a round now takes the coordinate-wise median of what came (still robust to a minority
per coordinate from 3 updates; with 2, their mean) and logs `krum_too_few` once per
aggregator. Where the count is known to be too small, the job is refused instead
(proto.job: the clients a star's round draws; a decentralized job at a fraction < 1).
Flower's Krum clamps the neighbours it scores by to at least 1 and picks an update;
with 2 that is the first, whatever the other is."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .base import AggregationError, Aggregator, Update, Weights, cast_like, check_updates, require
from .median import coordinate_median

if TYPE_CHECKING:
    from proto.job import AggregationSpec

log = logging.getLogger(__name__)


class Krum(Aggregator):
    """With n updates and f = `krum_byzantine` of them possibly malicious, score each update
    by the sum of squared distances to its n - f - 2 nearest other updates (all tensors
    flattened together) and return the update with the lowest score (ties: the first)."""

    name = "krum"

    def __init__(self, spec: AggregationSpec) -> None:
        super().__init__(spec)
        self.byzantine = int(spec.krum_byzantine)
        require(self.byzantine >= 0, self.name, "krum_byzantine", self.byzantine, "an integer >= 0")
        self.last_selected: int | None = None
        self._warned = False

    def scores(self, updates: Sequence[Update]) -> np.ndarray:
        """Krum score of every update (lower is more central)."""
        n = len(updates)
        neighbours = n - self.byzantine - 2
        if neighbours < 1:
            raise AggregationError(
                f"krum needs at least krum_byzantine + 3 = {self.byzantine + 3} updates, got {n}; "
                "lower aggregation.krum_byzantine or aggregate more clients"
            )
        names = sorted(updates[0][0])
        flat = np.stack([
            np.concatenate([np.asarray(w[k], dtype=np.float64).ravel() for k in names])
            for w, _ in updates
        ])
        # Row by row: exact (no |a|^2 + |b|^2 - 2ab cancellation) and O(n * params) memory.
        dist = np.stack([((flat - row) ** 2).sum(axis=1) for row in flat])
        np.fill_diagonal(dist, np.inf)
        nearest = np.sort(dist, axis=1)[:, :neighbours]
        return nearest.sum(axis=1)

    def aggregate(self, global_weights: Mapping[str, np.ndarray], updates: Sequence[Update]) -> Weights:
        check_updates(global_weights, updates, self.name)
        if len(updates) < self.byzantine + 3:
            if not self._warned:
                self._warned = True
                log.warning("event=krum_too_few updates=%d krum_byzantine=%d hint=krum needs "
                            "krum_byzantine + 3 updates; this aggregation takes their "
                            "coordinate-wise median (raise training.client_fraction or "
                            "lower aggregation.krum_byzantine)", len(updates), self.byzantine)
            self.last_selected = None
            return coordinate_median(global_weights, updates)
        chosen = int(np.argmin(self.scores(updates)))
        self.last_selected = chosen
        weights = updates[chosen][0]
        return cast_like({k: np.asarray(weights[k], dtype=np.float64) for k in global_weights},
                         global_weights)
