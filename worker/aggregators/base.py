"""The aggregator interface and the checks and helpers every algorithm shares.

An aggregator turns the current global weights and a list of client updates
(weights, number of samples) into new global weights. Everything is numpy on
`dict[str, np.ndarray]`; arithmetic is float64 and results take the global tensors' dtypes.
Stateful algorithms (server momentum, adaptive moments) keep their state in the instance
and expose it through `state_dict`/`load_state_dict` so it can move with a migrating node.

Buffers (BatchNorm's running statistics, counters, any tensor of the model that is not a
trained parameter) are statistics, not weights: a server optimizer never steps them, they
take the sample-weighted mean, and a normalization layer's running variance is the variance
of the pooled clients, sum_i s_i var_i + sum_i s_i ((mean_i - mean)^2 - var_i / n_i), not
the mean of the variances (which leaves out how far the clients' means are apart: with
label-skewed clients it is several times too small, and the averaged model's activations
come out several times too large). The var_i / n_i is what a mean of n_i samples scatters
by chance, so the spread term is an unbiased between-clients variance (clipped at 0): a
client of 4 samples had its noise counted as spread (breast-cancer table BNMLP beta 0.1,
100 clients, star fedavg 0.681 -> 0.708, the reference loop's plain mean 0.735; digits
BNCNN beta 0.3 / 100, table BNMLP beta 0.3 and 1.0 / 20 unchanged).
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import weakref
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from proto.rounds import CHANCE_MARGIN
from worker.errors import WorkerError

if TYPE_CHECKING:
    from proto.job import AggregationSpec

Weights = dict[str, np.ndarray]
Update = tuple[Mapping[str, np.ndarray], int]

log = logging.getLogger(__name__)
#: a job at chance whose loss rose above STALL_RISE x its best this many rounds in a row has
#: stalled. Not any round without progress: a plateau at chance, where FedAvg itself sits
#: for rounds (MNIST-like digits, SmallCNN, 20 clients: 5+ rounds), jitters within 1% of ln
#: classes; restoring and halving the step there only made the plateau endless (measured:
#: fedadam at max_step_ratio 1, digits SmallCNN beta 0.3, 15 rounds at chance, FedAvg 0.60)
STALL_ROUNDS = 2
STALL_RISE = 1.05
#: a job that had learned and lost more than this share of its gain over chance in one
#: round (with a loss above its best) overshot: its best model comes back at once
COLLAPSE_SHARE = 0.5
#: a job that fell: its loss above FALL_RISE x its best. In one round that lost more than
#: COLLAPSE_SHARE of the gain, a collapse; up by 5% (STALL_RISE) was enough until stop 72,
#: and restoring then halved FedAvg's step on a swing its own loop makes and recovers from
#: (digits SmallCNN, beta 0.1, 100 clients, s0: the reference loop and star fedavg alike
#: 0.546 in round 5, 0.265 in round 9 on a loss 1.29 x its best, then 0.808 / 0.777 by
#: round 15; restored and halved in round 9, fedavg ended at 0.727, fedprox 0.724)
FALL_RISE = 1.5
#: a job that slid: at any accuracy, STALL_ROUNDS rounds in a row with its loss above
#: FALL_RISE x its best and its accuracy more than SLIDE_SHARE of its gain over chance
#: below its best. Both: a loss that rises while the accuracy holds is a model growing
#: confident (late rounds on a small data set), and an accuracy that dips on a flat loss
#: is a split that swings, as FedAvg's own does (MNIST SmallCNN, shards:2: the reference
#: loop's 0.74 / 0.70 / 0.59 / 0.62 / 0.76); a slide is the two together. Measured
#: there: hierarchical fedprox slid from 0.813 (its loss 0.567) to 0.588 (1.375) over its
#: last three rounds, below ln(classes) and no round losing half its gain, so the guard
#: let it (docs/job.md, "Does it learn?")
SLIDE_SHARE = 0.1
#: a loss above this x ln(classes) (a uniform guess's) has diverged
DIVERGED_LOSS = 3.0
#: state slots of `Aggregator.observe`
GUARD, BEST, START = "guard", "best", "start"
#: what a state from another cluster (a migrating node, a checkpoint) may hold, checked by
#: `Aggregator.load_state_dict` before any of it is taken: per slot, "model" (tensors of the
#: job's model, its names and shapes), "nonnegative" (the same, none below 0: a second
#: moment), "rounds" (one whole count >= 1 per tensor: Adam's bias correction divides by
#: 1 - beta^t, so t = 0 made the step infinite); each subclass adds its own
#: (`Aggregator.state_slots`). GUARD's scalars and their ranges: a negative step scale
#: turned every server step around, within the step bound
GUARD_RANGES = {"scale": (1e-300, 1.0), "best_accuracy": (-1.0, 1.0), "best_loss": (0.0, math.inf),
                "streak": (0, math.inf), "stalls": (0, math.inf)}

#: the buffers torch's normalization layers keep (BatchNorm, InstanceNorm with running
#: stats, SyncBatchNorm): recognised by name when the model's own buffer list is not known
NORM_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


#: the first moment (fedavgm's server momentum, the adaptive ones' beta1) of a model with
#: BatchNorm statistics when the job leaves it unset under the scaled step: none. The step
#: was at most FedAvg's own length there when this was measured (`Aggregator.step_ratio`
#: 1 until stop 75), so a moment could only turn it away from the round's pseudo-gradient:
#: less progress along it, never more. Measured in fedavgm (MOMENTUM) and adaptive (BETA1),
#: stop 58
NORM_MOMENTUM = 0.0
#: `aggregation.max_step_ratio`'s bound for a model with BatchNorm statistics (at most the
#: job's): the pooled running statistics describe the clients' models, which lie around
#: their mean (FedAvg's step), and a server step far past it is evaluated with statistics
#: its activations no longer have. Measured (stop 74-75; fedadam / fedyogi / fedadagrad,
#: star / hybrid / hierarchical, against the bound of 1): at 2, 26 BatchNorm grid cells
#: +0.008, but digits usercnn:BNResCNN beta 0.3 / 20 / s0 0.852-0.858 -> 0.710-0.719
#: (fedavg 0.838). At 1.5, the same 52 cells (digits BNCNN / BNMLP / BNResCNN / Conv1dBN,
#: MNIST BNCNN, breast-cancer and wine BNMLP; 468 jobs): +0.008 on average, 159 jobs up and
#: 10 down by more than 0.01 (worst -0.022: digits BNMLP beta 0.1 / 20 / s0, a last-round
#: swing to the reference loop's 0.869), that BNResCNN cell 0.886-0.889; jobs below the
#: reference loop 24 -> 9, below fedavg 22 -> 9, below 0.95 x centralized 25 -> 9 (at 2:
#: 21 / 17 / 9); half of those cells were chosen for their misses, where any change gains
#: by chance, but the other half (digits, 20 / 50 clients) gained as much (+0.0078). 17
#: cells chosen for nothing (breast-cancer and wine BNMLP, 20 clients; digits, 100): +0.0006,
#: 9 jobs 2 rows of wine's 178 below the reference loop that were not. fedavgm without
#: momentum (server rate 1) steps FedAvg's length: unchanged
NORM_STEP_RATIO = 1.5


class AggregationError(WorkerError, ValueError):
    """Updates or settings cannot be aggregated; the message names the update, tensor or key."""


class Aggregator(ABC):
    """One aggregation algorithm. Subclasses set `name` and implement `aggregate`."""

    name: ClassVar[str]
    # Used when `spec.server_learning_rate` is None (per-algorithm default).
    default_server_learning_rate: ClassVar[float] = 1.0
    #: a server optimizer acts on the round's pseudo-gradient (the mean update), not on
    #: the individual client updates: where clients are first averaged in groups (hybrid),
    #: it is applied once to the mean of the groups, so the job follows one trajectory
    server_optimizer: ClassVar[bool] = False
    #: whether `on_stall` may act: the aggregator has a server step to halve (every server
    #: optimizer's; FedAvg's move to the mean, `FedAvg.aggregate`). A robust one's (median,
    #: krum...) is its defence against lying members and is left as it is
    stall_step: ClassVar[bool] = False
    #: names of the model's buffers (`get_aggregator(spec, buffers=...)` sets it from the
    #: model); buffers are averaged, never stepped (`is_buffer`)
    buffers: frozenset[str] = frozenset()
    #: the job's number of classes (chance = 1 / classes), for `observe`; 0 = unknown
    classes: int = 0
    #: set by the engine for one decentralized mixing phase: the nodes that average the
    #: same updates share one pooled mean (`SharedMeans`); None: this one computes its own
    means: SharedMeans | None = None
    #: the server state's slots of a subclass and what each holds (`GUARD_RANGES`' note)
    state_slots: ClassVar[dict[str, str]] = {}

    def __init__(self, spec: AggregationSpec) -> None:
        self.spec = spec
        self._state: dict[str, Weights] = {}
        self._moment_noted = False   # the log line of `moment`, once
        self._shared_models = False  # observe(shared=True): best and first by reference

    def mean(self, updates: Sequence[Update]) -> Weights:
        """The sample-weighted mean of `updates` with pooled normalization statistics
        (`pooled_mean`), through `means` when the engine shares one. Never modify it."""
        if self.means is not None:
            return self.means.mean(updates, self.name)
        return pooled_mean(updates, self.name)

    @property
    def step_scale(self) -> float:
        """What `on_stall` backoffs left of the server step (1.0 until the first)."""
        return float(self._state.get(GUARD, {}).get("scale", 1.0))

    def observe(self, model: Mapping[str, np.ndarray], accuracy: float, loss: float,
                start: Mapping[str, np.ndarray] | None = None, *,
                shared: bool = False) -> Weights | None:
        """Called with each model this aggregator produced, once it was evaluated (`start`:
        the model the round started from). Returns None to keep it, or the model to go on
        from instead when a server optimizer stalled the job (`aggregation.on_stall =
        "restore"`, the default): the loss is not finite or above DIVERGED_LOSS x a
        uniform guess's (ln classes); or the job had clearly learned and one round lost
        more than COLLAPSE_SHARE of its gain over chance with a loss above FALL_RISE x its
        best (the best model so far comes back); or it sits at chance (within
        CHANCE_MARGIN), or its loss is above a uniform guess's, with a loss above
        STALL_RISE x its best for STALL_ROUNDS rounds in a row (the best model, or the one
        the job started from); or it slid, at any accuracy, for STALL_ROUNDS rounds in a
        row (FALL_RISE, SLIDE_SHARE: the best model). The server step is halved and
        the optimizer's moments are forgotten (they point where it went wrong). FedAvg's
        step is its move to the clients' mean: halved, the model goes half way there
        (`FedAvg.aggregate`), so restoring does not replay the same rounds. An aggregator
        without a step to halve (`stall_step`) never acts (the progress line still warns).
        `shared=True` (a decentralized node: one aggregator a client): the models given
        are the engine's own, never modified, so the best and the first are kept by
        reference, not copied (a node costs one more model only while its current one is
        worse than its best; the first of a node that trains in round 1 is every such
        node's one initial model); `state_dict` holds the best (a copy) but not the
        first (every node's would be one more model each in a checkpoint): a job
        resumed from a checkpoint goes back to the same best model as the one that was
        not stopped (since stop 72: a decentralized job whose node collapsed after a
        resume went back to its round's start instead, and resumed to another model);
        after a resume, a node with no best yet goes back to `start`, the model it began
        the stalled round from (where that has diverged too, the engine gives it the
        initial model: `restart_from`)."""
        if (not self.stall_step or self.classes < 2
                or getattr(self.spec, "on_stall", "restore") != "restore"):
            return None   # (and keeps no model copies in its state, nor in checkpoints)
        if shared and start is None:
            raise ValueError("observe(shared=True) needs the round's start model")
        self._shared_models = shared

        def keep(weights: Mapping[str, np.ndarray]) -> Weights:
            return dict(weights) if shared else {k: np.array(v) for k, v in weights.items()}
        guard = self._state.setdefault(GUARD, {})
        if START not in self._state and not (shared and guard):   # (guard: a resumed node)
            self._state[START] = keep(start or model)
        chance = 1.0 / self.classes
        best = float(guard.get("best_accuracy", -1.0))
        best_loss = float(guard.get("best_loss", math.inf))
        at_chance = not accuracy > chance + CHANCE_MARGIN
        worse = math.isfinite(best_loss) and loss > best_loss
        # at chance, or worse than a uniform guess (its loss above ln(classes)), and
        # getting worse (accuracy alone jitters in early rounds while the loss keeps
        # falling, and a plateau's loss stays within a few % of its best). Worse than a
        # uniform guess at any accuracy: two classes, one a client (breast-cancer BNMLP,
        # beta 0.1, 20 clients), the mean swung between all-majority (0.62, not chance)
        # and all-minority (0.38) guesses for 5 rounds; now it stalls in round 3 (star
        # 0.861 -> 0.882, k_connected 0.852 -> 0.882, the reference loop 0.863)
        stalled = ((at_chance or loss > math.log(self.classes)) and worse
                   and loss > STALL_RISE * best_loss)
        # fell: the loss well above its best, what a slide and a collapse both need
        fell = worse and loss > FALL_RISE * best_loss
        slid = (fell and best > chance + CHANCE_MARGIN
                and accuracy < best - SLIDE_SHARE * (best - chance))
        stuck = stalled or slid
        streak = int(guard.get("streak", 0)) + 1 if stuck else 0
        guard["streak"] = np.asarray(streak)
        if math.isfinite(loss):
            guard["best_loss"] = np.asarray(min(best_loss, loss), dtype=np.float64)
        # and its loss rose for real: early rounds' accuracy jumps between 0.1 and 0.25
        # on a flat loss (MNIST SmallCNN beta 0.1, 20 clients: two restores on a loss of
        # 2.27 against 2.27 halved fedavgm's step twice, 0.817 against FedAvg's 0.931)
        collapsed = (fell and best >= chance + 3 * CHANCE_MARGIN
                     and accuracy < chance + COLLAPSE_SHARE * (best - chance))
        # a model that guesses uniformly has loss ln(classes): far above it, it is
        # confidently wrong (the step overshot), not slow
        diverged = self.diverged(loss)
        if not diverged and not collapsed and streak < STALL_ROUNDS:
            if not at_chance and accuracy > best:
                self._state[BEST] = keep(model)
                guard["best_accuracy"] = np.asarray(accuracy, dtype=np.float64)
            return None
        back = self._state.get(BEST) or self._state.get(START) or start
        assert back is not None
        guard["scale"] = np.asarray(self.step_scale * 0.5, dtype=np.float64)
        guard["stalls"] = np.asarray(int(guard.get("stalls", 0)) + 1)
        guard["streak"] = np.asarray(0)
        for slot in [s for s in self._state if s not in (GUARD, BEST, START)]:
            del self._state[slot]
        reason = ("diverged" if diverged else "collapsed" if collapsed
                  else "stalled" if stalled else "slid")
        log.warning("event=learning_stalled_action aggregator=%s reason=%s accuracy=%.4f "
                    "loss=%s action=restore restored=%s step_scale=%g", self.name, reason,
                    accuracy, loss, "best" if BEST in self._state
                    else "start" if START in self._state else "round_start",
                    self.step_scale)
        return cast_like(back, model)

    def stall_bound(self, ratio: float) -> float:
        """`ratio`, the bound on a step in lengths of FedAvg's (`bounded_step`), times what
        on_stall's halvings left of the step (`step_scale`): halving the server step
        halves the step taken. Before stop 70 only the optimizer's own step was halved,
        and where the bound was the shorter (a BatchNorm model's: FedAvg's length, against
        2.0 x the momentum's) the step stayed FedAvg's whole: breast-cancer table BNMLP,
        beta 0.1, 20 clients, fold 4 of 5, star fedadam swung between 0.95 and 0.80 every
        other round from round 6 to the end (0.807) after its stall, where fedavg, halved,
        settled at 0.860; now 0.860. Unbounded (`ratio` 0) stays unbounded."""
        return ratio * self.step_scale

    def diverged(self, loss: float) -> bool:
        """A model's loss not finite or above DIVERGED_LOSS x a uniform guess's (`observe`)."""
        return self.classes >= 2 and not loss <= DIVERGED_LOSS * math.log(self.classes)

    def restart_from(self, first: Mapping[str, np.ndarray]) -> bool:
        """A decentralized node (`observe`'s `shared`) without a best model whose start it
        went back to had diverged too: a node that did not train mixed its trained
        neighbours' diverged models into its own, and trained from that in its first
        round. `first` (the job's initial model, which guesses uniformly) becomes the model
        it goes back to, by reference. False (nothing changed) where it has a best."""
        if BEST in self._state or not self._shared_models:
            return False
        self._state[START] = dict(first)
        return True

    def step_ratio(self, weights: Mapping[str, np.ndarray]) -> float:
        """`aggregation.max_step_ratio` (0: unbounded), at most NORM_STEP_RATIO for a
        model with normalization statistics: the pooled running statistics describe the
        clients' models, which lie around their mean (FedAvg's step); a server step far
        past that leaves the statistics behind, and the model is evaluated with
        statistics its activations no longer have (measured in an earlier stop, at the
        code of then: MNIST BNCNN beta 0.3, fedadam's loss went to 4.2 and 10.4 in two
        rounds at ratio 2; digits BNCNN beta 0.1: 0.78 at 2 -> 0.84 at 1; NORM_STEP_RATIO
        for what 1.5 and 2 do at this one).
        A small table overfits at 2 in the last rounds (breast-cancer mlp beta 1.0 / 50:
        fedadam 0.956, fedavg 0.974; wine one row of 36 below). Cooling the bound to 1
        with the clients' cosine schedule fixed the table (0.965) but cost the skewed
        image cells that still gain at the end (MNIST SmallCNN beta 0.1 / 100 fedadam
        0.944 -> 0.935, fedavgm 0.942 -> 0.925; WideCNN 0.952 -> 0.942; digits SmallCNN
        fedavgm 0.922 -> 0.900): not taken."""
        ratio = float(getattr(self.spec, "max_step_ratio", 2.0))
        if plain_step(self.spec):
            return 0.0
        return (min(ratio, NORM_STEP_RATIO) if has_statistics(weights) and ratio > 0
                else ratio)

    def moment(self, weights: Iterable[str], value: float, key: str) -> float:
        """The first-moment weight a server optimizer carries this round: `value`
        (aggregation.`key`: fedavgm's server_momentum, the adaptive ones' beta1), or
        NORM_MOMENTUM for a model with BatchNorm statistics where the job left `key` unset
        under the scaled step (said once, naming the key that keeps one)."""
        if (plain_step(self.spec) or getattr(self.spec, key, None) is not None
                or not has_statistics(weights)):
            return value
        if not self._moment_noted:
            self._moment_noted = True
            log.info("event=momentum_off aggregator=%s reason=batchnorm_statistics %s=%g "
                     "hint=set aggregation.%s to keep one", self.name, key, NORM_MOMENTUM, key)
        return NORM_MOMENTUM

    def is_buffer(self, name: str, value: np.ndarray) -> bool:
        """Whether tensor `name` is a statistic or counter rather than a trained weight."""
        return (name in self.buffers or not is_float(value)
                or name.rpartition(".")[2] in NORM_STATISTICS)

    def trained(self, global_weights: Mapping[str, np.ndarray], names: Iterable[str]) -> Weights:
        """The global model's trained tensors among `names` (buffers left out), in float64:
        what a server optimizer steps."""
        return {name: np.asarray(global_weights[name], dtype=np.float64) for name in names
                if not self.is_buffer(name, global_weights[name])}

    @abstractmethod
    def aggregate(self, global_weights: Mapping[str, np.ndarray], updates: Sequence[Update]) -> Weights:
        """Return the new global weights (fresh arrays; inputs are never modified)."""

    def reset(self) -> None:
        """Forget any server state (a new job or a restart from scratch)."""
        self._state = {}

    def state_dict(self) -> Weights:
        """Server state as flat named arrays ("slot/tensor"), e.g. for safetensors; without
        the first model `observe` keeps by reference (`shared`)."""
        skip = (START,) if self._shared_models else ()
        return {f"{slot}/{k}": v.copy() for slot, tensors in self._state.items()
                if slot not in skip for k, v in tensors.items()}

    def load_state_dict(self, state: Mapping[str, np.ndarray],
                        model: Mapping[str, np.ndarray] | None = None) -> None:
        """Restore what `state_dict` returned. Each key must be a slot this aggregator
        keeps (`state_slots`, `observe`'s) and, given the job's `model`, name one of its
        tensors at its shape; values finite and in their slot's range. AggregationError
        naming the key otherwise, and the state held before is kept: it came from another
        cluster, which may lie."""
        slots = {START: "model", BEST: "model", GUARD: "guard", **self.state_slots}
        restored: dict[str, Weights] = {}
        for key, value in state.items():
            slot, sep, name = key.partition("/")
            where = f"{self.name} server state {key!r}"
            if not sep:
                raise AggregationError(f"{where} is not 'slot/tensor'")
            arr = np.asarray(value)
            if arr.dtype.kind not in "fiub":
                raise AggregationError(f"{where} holds {arr.dtype} values, not numbers")
            arr = arr.astype(np.float64)
            if not np.isfinite(arr).all():
                raise AggregationError(f"{where} holds NaN or infinite values")
            kind = slots.get(slot)
            if kind is None:
                raise AggregationError(f"{where}: {self.name} keeps no {slot!r} (it keeps "
                                       f"{', '.join(sorted(slots))})")
            if kind == "guard":
                if name not in GUARD_RANGES:
                    raise AggregationError(f"{where} is unknown (the guard keeps "
                                           f"{', '.join(GUARD_RANGES)})")
                low, high = GUARD_RANGES[name]
                if arr.shape != () or not low <= float(arr) <= high:
                    raise AggregationError(f"{where} must be one number in [{low}, {high}]")
            elif model is not None and name not in model:
                raise AggregationError(f"{where} names no tensor of the job's model")
            elif kind == "rounds":
                if arr.shape != () or arr < 1 or arr != np.round(arr):
                    raise AggregationError(f"{where} must be one whole round count >= 1")
            elif model is not None and arr.shape != np.shape(model[name]):
                raise AggregationError(f"{where} has shape {arr.shape}, the job's model "
                                       f"{np.shape(model[name])}")
            elif kind == "nonnegative" and bool((arr < 0).any()):
                raise AggregationError(f"{where} holds negative values (a second moment)")
            restored.setdefault(slot, {})[name] = arr
        self._state = restored


def plain_step(spec: AggregationSpec) -> bool:
    """Whether a server optimizer takes the literature's plain step (`server_step`)."""
    return getattr(spec, "server_step", "scaled") == "plain"


def server_learning_rate(spec: AggregationSpec, cls: type[Aggregator]) -> float:
    """`spec.server_learning_rate`, or the algorithm's own default for the job's
    `server_step` when it is None."""
    value = getattr(spec, "server_learning_rate", None)
    if value is not None:
        return float(value)
    if plain_step(spec):
        return float(getattr(cls, "plain_server_learning_rate", cls.default_server_learning_rate))
    return cls.default_server_learning_rate


def check_updates(global_weights: Mapping[str, np.ndarray], updates: Sequence[Update],
                  algorithm: str) -> None:
    """Raise `AggregationError` unless every update has the global tensors' names and shapes
    and a non-negative integer sample count."""
    if not updates:
        raise AggregationError(f"{algorithm}: no updates to aggregate")
    expected = set(global_weights)
    for i, (weights, num_samples) in enumerate(updates):
        if isinstance(num_samples, bool) or not isinstance(num_samples, int | np.integer) \
                or num_samples < 0:
            raise AggregationError(
                f"{algorithm}: update {i} has sample count {num_samples!r}; need an integer >= 0"
            )
        if set(weights) != expected:
            missing = sorted(expected - set(weights))
            extra = sorted(set(weights) - expected)
            raise AggregationError(
                f"{algorithm}: update {i} does not match the global model: missing "
                f"{missing or 'none'}, unexpected {extra or 'none'}"
            )
        for name, value in weights.items():
            if np.shape(value) != np.shape(global_weights[name]):
                raise AggregationError(
                    f"{algorithm}: update {i} tensor {name!r} has shape {np.shape(value)}, the "
                    f"global model has {np.shape(global_weights[name])}"
                )


def sample_weights(updates: Sequence[Update], algorithm: str) -> np.ndarray:
    """Each update's share of the total sample count (they sum to 1)."""
    counts = np.array([n for _, n in updates], dtype=np.float64)
    total = counts.sum()
    if total <= 0:
        raise AggregationError(
            f"{algorithm}: all {len(updates)} updates report 0 samples; nothing to weight by"
        )
    return counts / total


def weighted_average(updates: Sequence[Update], shares: np.ndarray) -> Weights:
    """Per tensor, sum_i shares[i] * update_i, in float64."""
    names = list(updates[0][0])
    out: Weights = {}
    for name in names:
        acc = np.zeros(np.shape(updates[0][0][name]), dtype=np.float64)
        for (weights, _), share in zip(updates, shares, strict=True):
            acc += share * np.asarray(weights[name], dtype=np.float64)
        out[name] = acc
    return out


def pool_statistics(mean: Weights, updates: Sequence[Update], shares: np.ndarray) -> Weights:
    """`mean` (the weighted average of `updates`) with every normalization layer's
    `running_var` replaced by the pooled variance of the clients' populations: their mean
    variance plus max(0, sum_i s_i ((mean_i - mean)^2 - var_i / n_i)), from the sibling
    `running_mean` and the updates' sample counts n_i (module docstring)."""
    out = dict(mean)
    for name in mean:
        prefix, _, leaf = name.rpartition(".")
        mean_name = f"{prefix}.running_mean" if prefix else "running_mean"
        if leaf != "running_var" or mean_name not in mean:
            continue
        between = np.zeros_like(np.asarray(mean[name], dtype=np.float64))
        for (weights, n), share in zip(updates, shares, strict=True):
            spread = np.asarray(weights[mean_name], dtype=np.float64) - mean[mean_name]
            chance = np.asarray(weights[name], dtype=np.float64) / max(int(n), 1)
            between += share * (spread**2 - chance)
        out[name] = np.asarray(mean[name], dtype=np.float64) + np.maximum(between, 0.0)
    return out


def pooled_mean(updates: Sequence[Update], algorithm: str) -> Weights:
    """The sample-weighted mean of `updates` with pooled normalization statistics."""
    shares = sample_weights(updates, algorithm)
    return pool_statistics(weighted_average(updates, shares), updates, shares)


def digest(weights: Mapping[str, np.ndarray]) -> bytes:
    """A 16-byte BLAKE2b digest of a model: its tensors' names, dtypes, shapes and bytes
    (equal models share it, and in practice only they do)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(weights):
        array = np.asarray(weights[name])
        h.update(f"{len(name)}:{name}:{array.dtype.str}:{array.shape}:".encode())
        h.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
    return h.digest()


class Memo:
    """Values computed once per key, by whichever thread asks first; the others wait for
    it, and a failure reaches every asker. With a `capacity`, only that many of the latest
    keys are kept (an older one asked again is computed again)."""

    def __init__(self, capacity: int = 0) -> None:
        self._lock = threading.Lock()
        self._values: OrderedDict[Hashable, Future[Any]] = OrderedDict()
        self._capacity = capacity

    def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        with self._lock:
            future = self._values.get(key)
            owner = future is None
            if future is None:
                future = self._values[key] = Future()
                if self._capacity and len(self._values) > self._capacity:
                    self._values.popitem(last=False)
        if owner:
            try:
                future.set_result(compute())
            except BaseException as exc:  # every asker, the owner too, sees it raised
                future.set_exception(exc)
        return future.result()


#: pooled means a mixing phase keeps (`SharedMeans`): a float64 model each, as many as
#: the engine's node threads held before they were shared; one serves a whole full graph
SHARED_MEANS_KEPT = 8


class SharedMeans:
    """The pooled means (`pooled_mean`) of one decentralized mixing phase, each computed
    once: nodes whose neighbourhoods hold the same models (k_connected on a few clusters
    averages the whole federation at every node, `scheduler.planning.topology`) share one
    computation instead of one each, N^2 model additions a round for N nodes. An update is
    known by its content (`digest`, once per array set), never by its sender's name, so a
    member that sends different models to different neighbours gets each of them averaged
    as received; the mean is taken in the digests' order, so it is the same whichever
    node asks. Nothing here keeps a model alive: the digests are remembered against weak
    references, and only the latest SHARED_MEANS_KEPT means are kept (a sparse graph's
    nodes each average another set). Measured: bench/bench_mixing.py."""

    def __init__(self) -> None:
        self._means = Memo(SHARED_MEANS_KEPT)
        self._lock = threading.Lock()
        self._digests: dict[tuple[tuple[str, int], ...],
                            tuple[tuple[weakref.ref[Any], ...], bytes]] = {}

    def mean(self, updates: Sequence[Update], algorithm: str) -> Weights:
        keyed = sorted(((self._digest(w), int(n)), i) for i, (w, n) in enumerate(updates))
        ordered = [updates[i] for _, i in keyed]
        return self._means.get((algorithm, tuple(k for k, _ in keyed)),
                               lambda: pooled_mean(ordered, algorithm))

    def _digest(self, weights: Mapping[str, np.ndarray]) -> bytes:
        """`digest(weights)`, computed once for the same arrays (an id is trusted only
        while its weak reference still points at that array)."""
        arrays = tuple(weights.items())
        key = tuple((name, id(a)) for name, a in arrays)
        with self._lock:
            held = self._digests.get(key)
        if held is not None and all(r() is a for r, (_, a) in zip(held[0], arrays, strict=True)):
            return held[1]
        value = digest(weights)
        try:
            refs = tuple(weakref.ref(a) for _, a in arrays)
        except TypeError:  # not weakly referenceable: not remembered
            return value
        with self._lock:
            self._digests[key] = (refs, value)
        return value


def has_statistics(weights: Iterable[str]) -> bool:
    """Whether a model (its tensor names) has BatchNorm running statistics."""
    return any(name.rpartition(".")[2] == "running_var" for name in weights)


def bounded_step(step: np.ndarray, delta: np.ndarray, ratio: float) -> np.ndarray:
    """`step`, shrunk (never grown) so that its norm is at most `ratio` times the norm of
    `delta`, FedAvg's own step for the tensor; `ratio` 0 leaves it as it is."""
    if ratio <= 0:
        return step
    norm = float(np.linalg.norm(step))
    limit = ratio * float(np.linalg.norm(delta))
    return step * (limit / norm) if norm > limit else step


def opposes(moment: Mapping[str, np.ndarray], pseudo: Mapping[str, np.ndarray]) -> bool:
    """Whether this round's pseudo-gradient `pseudo` points against the server momentum
    `moment` carried so far (a negative inner product over the tensors both have): the
    job went past a minimum along it, and a server optimizer forgets its momentum (the
    gradient restart of O'Donoghue and Candes, "Adaptive restart for accelerated gradient
    schemes", 2015). Measured, table BNMLP beta 1.0, 20 clients: fedavgm at 0.965 by round
    7 then drifting to 0.894 with the momentum kept, 0.938 (FedAvg's) with restarts."""
    return sum(float(np.vdot(moment[name], pseudo[name]))
               for name in moment if name in pseudo) < 0.0


def stack(updates: Sequence[Update], name: str) -> np.ndarray:
    """The tensor `name` of every update stacked along a new first axis (float64)."""
    return np.stack([np.asarray(w[name], dtype=np.float64) for w, _ in updates])


def cast_like(values: Mapping[str, np.ndarray], like: Mapping[str, np.ndarray]) -> Weights:
    """Cast each float64 result to the dtype of the matching global tensor (ints rounded)."""
    out: Weights = {}
    for name, value in values.items():
        dtype = np.asarray(like[name]).dtype
        if np.issubdtype(dtype, np.integer):
            out[name] = np.rint(value).astype(dtype)
        else:
            out[name] = np.asarray(value).astype(dtype)
    return out


def is_float(array: np.ndarray) -> bool:
    """Whether a tensor is trainable-looking (floating point) rather than a counter."""
    return bool(np.issubdtype(np.asarray(array).dtype, np.floating))


def require(condition: bool, algorithm: str, key: str, value: object, allowed: str) -> None:
    """Raise an `AggregationError` naming the aggregation key unless `condition` holds."""
    if not condition or (isinstance(value, float) and not math.isfinite(value)):
        raise AggregationError(
            f"aggregation.{key} = {value!r} is not valid for {algorithm}; need {allowed}"
        )
