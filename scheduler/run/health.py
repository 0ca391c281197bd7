"""Is the job learning? A watch over the rounds that says, on the progress line and in the
log, when accuracy sits at chance or the loss explodes, and which key to change.

Pure: it sees the job spec, the number of classes (and the clients' pooled label counts,
where the scheduler profiled them) and each round's record. Rules:
  - a non-finite loss, or a loss above EXPLODE_FACTOR x the first round's: "diverging";
  - accuracy within CHANCE_MARGIN of chance for CHANCE_ROUNDS rounds in a row: "at
    chance" (the keys to check: a server or client rate tuned for another model is the
    usual cause). Chance is what a model that learned nothing but the labels' shares
    scores: its most common label's share (`chance_level`), 1 / classes on balanced data;
    on a table of 90% one label a model that always says that label scores 0.90 and has
    learned nothing, and 1 / classes alone would never see it.
Each condition is logged once (event=learning_stalled / event=learning_diverged); the
note stays on the progress line while the condition holds.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from proto.job import ADAPTIVE_AGGREGATORS, JobSpec
from proto.rounds import CHANCE_MARGIN, RoundRecord

log = logging.getLogger("fedpilot.scheduler")

CHANCE_ROUNDS = 5
EXPLODE_FACTOR = 3.0
#: the aggregators that take a server step of their own size (aggregation.server_learning_rate)
SERVER_STEP = frozenset({*ADAPTIVE_AGGREGATORS, "fedavgm"})


def few_labels(spec: JobSpec) -> str:
    """How the job's split leaves each client one or two labels ('' where it does not, or
    the split is the sites' own): `labels` or `shards` at 2 or fewer a client, Dirichlet
    at beta 0.1 or less."""
    data = spec.data
    if data.placement != "simulated":
        return ""
    kind = data.data_distribution_kind
    if kind == "labels" and data.labels_per_client <= 2:
        return f"each client holds {data.labels_per_client} label(s) (data.labels_per_client)"
    if kind == "shards" and data.shards_per_client <= 2:
        return (f"each client holds {data.shards_per_client} label-sorted shard(s) "
                "(data.shards_per_client)")
    if kind == "dirichlet" and data.dirichlet_beta <= 0.1:
        return (f"data.dirichlet_beta {data.dirichlet_beta:g} leaves most clients one or two "
                "labels")
    return ""


def chance_level(classes: int, labels: Sequence[int] | None = None) -> tuple[float, float, int | None]:
    """(chance, margin, label): the accuracy of a model that always says the most common
    label of `labels` (the clients' pooled label counts; 1 / classes without them, or on
    data that balanced), the margin within which an accuracy counts as chance
    (CHANCE_MARGIN at 1 / classes, narrowed with what is left to learn above it: 0.005 at
    a 95% majority of two labels), and that label (None at 1 / classes)."""
    classes = max(2, int(classes))
    uniform = 1.0 / classes
    counts = [max(0, int(c)) for c in (labels or [])]
    total = sum(counts)
    if total <= 0 or len(counts) != classes or max(counts) / total <= uniform:
        return uniform, CHANCE_MARGIN, None
    share = max(counts) / total
    return share, CHANCE_MARGIN * (1.0 - share) / (1.0 - uniform), counts.index(max(counts))


class LearningWatch:
    """Feed it every round's record (`observe`); `note` is what the progress line shows."""

    def __init__(self, spec: JobSpec, classes: int,
                 labels: Sequence[int] | None = None) -> None:
        self.spec = spec
        self.classes = max(2, int(classes))
        self.chance, self.margin, self.majority = chance_level(self.classes, labels)
        self.first_loss: float | None = None
        self.at_chance = 0
        self.note = ""
        self._said: set[str] = set()

    def hint(self, verb: str) -> str:
        """The keys to change, with their values now; at chance on a split whose clients
        hold one or two labels each (`few_labels`), also the local passes: each client's
        training drifts to its own labels, and the mean of such models can stay at chance
        where the rate is right (digits, `SmallCNN`, 20 clients of one label each, the
        rate its trial keeps: 2 passes x 15 rounds, reference FedAvg loop 0.10 and star
        fedavg 0.14; 1 pass x 30 rounds, the same passes in all, 0.13 and 0.56)."""
        training, aggregation = self.spec.training, self.spec.aggregation
        keys = [f"training.learning_rate (now {training.learning_rate:g})"]
        if aggregation.name in SERVER_STEP:
            value = aggregation.server_learning_rate
            keys.insert(0, "aggregation.server_learning_rate (now "
                        + ("the default" if value is None else f"{value:g}") + ")")
        skew = few_labels(self.spec)
        if verb == "check" and skew and training.number_of_epochs > 1:
            keys.append(f"training.number_of_epochs (now {training.number_of_epochs}; "
                        f"{skew}: fewer local passes over more rounds)")
        return f"{verb} " + " or ".join(keys)

    def observe(self, record: RoundRecord) -> str:
        """Take one round's record; returns the note for the progress line ('' if none)."""
        loss, accuracy = record.loss, record.accuracy
        measured = math.isfinite(accuracy)   # a round with nothing evaluated says nothing
        if measured and math.isfinite(loss) and self.first_loss is None:
            self.first_loss = loss
        diverging = measured and (not math.isfinite(loss) or (
            self.first_loss is not None and self.first_loss > 0
            and loss > EXPLODE_FACTOR * self.first_loss))
        if measured:
            self.at_chance = self.at_chance + 1 if accuracy <= self.chance + self.margin else 0
        job = self.spec.job_id
        if diverging:
            hint = self.hint("lower")
            self.note = f"loss diverging ({loss:.3g}): {hint}"
            self._say("diverged", f"event=learning_diverged job={job} round={record.round} "
                                  f"loss={loss:.4g} first_loss={self.first_loss} hint={hint}")
        elif self.at_chance >= CHANCE_ROUNDS:
            # too large a step is the usual cause (a rate tuned for another model); a
            # decentralized graph that mixes slowly is the other (topology.kind)
            hint = self.hint("check")
            level = (f"chance ({self.chance:.2f})" if self.majority is None else
                     f"the share of its most common label ({self.chance:.2f}, label "
                     f"{self.majority}: a model that always says it scores that)")
            self.note = f"accuracy at {level} for {self.at_chance} rounds: {hint}"
            self._say("chance", f"event=learning_stalled job={job} round={record.round} "
                                f"accuracy={accuracy:.4f} chance={self.chance:.4f} "
                                f"rounds={self.at_chance} hint={hint}")
        else:
            self.note = ""
        return self.note

    def _say(self, kind: str, message: str) -> None:
        if kind not in self._said:
            self._said.add(kind)
            log.warning("%s", message)
