"""One record per round: what a cluster's engine measured, and the job's combination.

The engine fills one `RoundRecord` for its cluster's share of a round; it travels to the
scheduler as plain msgpack data (`to_dict`/`from_dict`, validated field by field); the
scheduler combines the clusters' records into the job's record with `combine`, which is
what `summary.json` and `metrics.csv` hold. Accuracy and loss are means weighted by
`eval_weight` (the samples behind each evaluated model), so combining is exact.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from proto.errors import InvalidMessage

NAN = float("nan")


#: accuracy within this of chance (1 / classes) counts as chance: the progress line's
#: warning (scheduler/run/health.py) and an aggregator's on_stall action use this one rule
CHANCE_MARGIN = 0.05
#: the accuracies whose first reaching a job reports (summary.json's time_to_accuracy, the
#: scheduler's time_to_accuracy_seconds metric, the live page)
ACCURACY_THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def clients_per_round(num_clients: int, fraction: float) -> int:
    """How many of `num_clients` train in a round at `training.client_fraction`: all, or
    the nearest count, at least one (worker.executor.graph.participants draws them; the
    plan's privacy line counts them)."""
    return num_clients if fraction >= 1.0 else max(1, round(fraction * num_clients))


#: the final pass's personalization policies (job.score), each against the global model
#: per held-out sample: "local" scores a sample with the client's trained model where that
#: got more of the client's other held-out samples right than the global model, else with
#: the global model; "shifted" is the same against the global model's outputs shifted to
#: the client's label mix (worker.training.label_offsets)
PERSONAL_POLICIES = ("local", "shifted")
#: a policy scores the job's held-out samples only where, for every cluster, the *other*
#: clusters' samples show it better than the global model by more than this many standard
#: deviations of a sign test (wins - losses > PERSONAL_EVIDENCE x sqrt(wins + losses)) and
#: every cluster's choice agrees (or, choices differing, it is shown for every cluster:
#: personal_choice); else the global model scores them. Measured on the
#: reference FedAvg loop's final model, 13 cells (digits BNCNN beta 0.3 at 100 and 50
#: clients, beta 1.0 at 20 (seeds 0, 2), BNMLP beta 0.1 / 50 and 1.0 / 100, SmallCNN beta
#: 0.3 and 1.0 at 50, MNIST SmallCNN beta 0.3 / 50, the breast-cancer table mlp beta 0.1 /
#: 100, BNMLP beta 0.3 at 100 and 20, 1.0 at 50), clients in 2, 3, 4 or 8 clusters, by index
#: or in blocks (104 cases): none below the global model, mean gain +0.012 (MNIST 0.9274 ->
#: 0.9574). Each cluster by its own choice instead: 12 cases below (to -0.007) at 1, one at
#: 1.5 or 2 (mean gain 0.015 / 0.009)
PERSONAL_EVIDENCE = 1.0


@dataclass
class RoundRecord:
    """One round, of one cluster (from its engine) or of the whole job (combined).

    `accuracy`/`loss`: of the models evaluated this round (the root model for star and
    hierarchical, the group models for hybrid, the mixed node models for decentralized
    topologies), weighted by the samples behind each. `personalized_accuracy`: each
    trained client's model right after local training, on that client's own held-out
    split. `participants`: clients that trained.
    """

    round: int
    accuracy: float = NAN
    loss: float = NAN
    personalized_accuracy: float = NAN
    participants: int = 0
    bytes_intra: int = 0
    bytes_inter: int = 0
    messages_intra: int = 0
    messages_inter: int = 0
    seconds: float = 0.0
    eval_weight: int = 0
    personal_correct: int = 0
    personal_total: int = 0
    #: models an aggregator replaced this round (aggregation.on_stall): the job had stalled
    stalls: int = 0
    # per cluster: {"bytes_inter": sent to other clusters, "bytes_intra": kept inside, ...}
    by_cluster: dict[str, dict[str, int]] = field(default_factory=dict)
    # [privacy] dp: the epsilon spent after this round (NaN without DP)
    epsilon: float = NAN
    # a star root whose rounds close early: the clusters whose contributions this
    # aggregation applied, {cluster: {"round": its model's round, "staleness", "updates"}}
    # (its newest; with "earlier": older ones of the cluster applied too, their updates
    # counted), and the contributions it dropped (late, or beyond aggregation.max_staleness)
    contributions: dict[str, dict[str, int]] = field(default_factory=dict)
    dropped: int = 0

    def add_evaluation(self, accuracy: float, loss: float, weight: int) -> None:
        """Fold one evaluated model into this record's weighted means."""
        total = self.eval_weight + weight
        if total <= 0:
            return
        old = self.eval_weight
        self.accuracy = (_z(self.accuracy) * old + accuracy * weight) / total
        self.loss = (_z(self.loss) * old + loss * weight) / total
        self.eval_weight = total

    def add_personal(self, correct: int, total: int) -> None:
        self.personal_correct += correct
        self.personal_total += total
        if self.personal_total:
            self.personalized_accuracy = self.personal_correct / self.personal_total

    @classmethod
    def combine(cls, round_index: int, records: Mapping[str, RoundRecord],
                seconds: float) -> RoundRecord:
        """The job's record from every cluster's (keyed by cluster id)."""
        out = cls(round_index, seconds=seconds)
        for cluster_id, rec in sorted(records.items()):
            if rec.eval_weight > 0:
                out.add_evaluation(rec.accuracy, rec.loss, rec.eval_weight)
            out.add_personal(rec.personal_correct, rec.personal_total)
            out.participants += rec.participants
            if not math.isnan(rec.epsilon):  # every cluster's accountant says the same
                out.epsilon = max(_z(out.epsilon), rec.epsilon)
            out.contributions.update(rec.contributions)
            out.dropped += rec.dropped
            out.bytes_intra += rec.bytes_intra
            out.bytes_inter += rec.bytes_inter
            out.messages_intra += rec.messages_intra
            out.messages_inter += rec.messages_inter
            out.stalls += rec.stalls
            out.by_cluster[cluster_id] = {"bytes_inter": rec.bytes_inter,
                                          "bytes_intra": rec.bytes_intra,
                                          "participants": rec.participants}
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "round report") -> RoundRecord:
        """Inverse of `to_dict`; raises `InvalidMessage` naming the field on bad input."""
        if not isinstance(data, dict):
            raise InvalidMessage(f"{source} must be a map", field=None)
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            value = data[f.name]
            if f.name in ("by_cluster", "contributions"):
                value = _by_cluster(value, source, f.name)
            elif f.type in ("int",) and (not isinstance(value, int) or isinstance(value, bool)
                                        or value < 0):
                raise InvalidMessage(f"{source}: {f.name} must be a non-negative integer",
                                     field=f.name)
            elif f.type == "float":
                if not isinstance(value, int | float) or isinstance(value, bool):
                    raise InvalidMessage(f"{source}: {f.name} must be a number", field=f.name)
                value = float(value)
            values[f.name] = value
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise InvalidMessage(f"{source} has unknown fields {unknown}", field=unknown[0])
        if "round" not in values:
            raise InvalidMessage(f"{source} names no round", field="round")
        return cls(**values)


def _by_cluster(value: Any, source: str, name: str) -> dict[str, dict[str, int]]:
    ok = isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, dict)
        and all(isinstance(a, str) and isinstance(b, int) for a, b in v.items())
        for k, v in value.items())
    if not ok:
        raise InvalidMessage(f"{source}: {name} must map cluster ids to integer counters",
                             field=name)
    return {k: dict(v) for k, v in value.items()}


def _z(x: float) -> float:
    return 0.0 if math.isnan(x) else x


def personal_reply(reply: Mapping[str, Any]) -> dict[str, Any] | None:
    """A cluster's reply to job.score's apply as counts, or None where it is not one:
    "total" held-out samples, "global" of them right with the global model, and per policy
    of PERSONAL_POLICIES [wins, losses]: samples it gets right where the global model
    does not, and the reverse (ints, none more than the samples there are)."""
    total, right = reply.get("total"), reply.get("global")
    if type(total) is not int or type(right) is not int or not 0 <= right <= total:
        return None
    out: dict[str, Any] = {"total": total, "global": right}
    for policy in PERSONAL_POLICIES:
        pair = reply.get(policy)
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2
                or any(type(n) is not int for n in pair)
                or not (0 <= pair[0] <= total - right and 0 <= pair[1] <= right)):
            return None
        out[policy] = (pair[0], pair[1])
    return out


def personal_choice(replies: Mapping[str, Mapping[str, Any]]
                    ) -> tuple[int, int, dict[str, str]]:
    """(correct, total, the policy the clients of each cluster are scored by) of the
    final pass over `replies` (personal_reply's, keyed by cluster): per cluster, the policy
    of PERSONAL_POLICIES the *other* clusters' samples show best by the sign test, if any,
    else the global model ("global"). Where every cluster's choice is the same policy, it
    scores them all; where the choices differ, the first policy (in PERSONAL_POLICIES'
    order, never by these counts) the other clusters' samples show better than the global
    model for *every* cluster does, else the global model (a choice that leaving one
    cluster out changes is not shown). Until stop 58 differing choices always fell to the
    global model: a user's residual BatchNorm CNN on digits (beta 0.2, 24 clients on 3
    clusters, hybrid fedyogi, 8 rounds), "local" shown for all three clusters and "shifted"
    better still for one, scored 0.604 against the round's own 0.758 (0.765 with "local").
    A job on one cluster is scored with the global model."""
    wins = {p: sum(r[p][0] for r in replies.values()) for p in PERSONAL_POLICIES}
    losses = {p: sum(r[p][1] for r in replies.values()) for p in PERSONAL_POLICIES}

    def gain(policy: str, cluster: str) -> int | None:
        """The other clusters' wins - losses of `policy`, where the sign test shows it."""
        won = wins[policy] - replies[cluster][policy][0]
        lost = losses[policy] - replies[cluster][policy][1]
        shown = won - lost > max(0, PERSONAL_EVIDENCE * math.sqrt(won + lost))
        return won - lost if shown else None

    correct = total = 0
    chosen: dict[str, str] = {}
    for cluster in sorted(replies):
        best, most = "global", 0
        for policy in PERSONAL_POLICIES:
            shown = gain(policy, cluster)
            if shown is not None and shown > most:
                best, most = policy, shown
        chosen[cluster] = best
    if len(set(chosen.values())) > 1:
        common = next((p for p in PERSONAL_POLICIES
                       if all(gain(p, cluster) is not None for cluster in replies)), "global")
        chosen = dict.fromkeys(chosen, common)
    for cluster, reply in replies.items():
        total += reply["total"]
        correct += reply["global"]
        if chosen[cluster] != "global":
            correct += reply[chosen[cluster]][0] - reply[chosen[cluster]][1]
    return correct, total, chosen
