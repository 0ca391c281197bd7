"""The job specification: what `job.toml` says and what travels from the scheduler to clusters.

Sections mirror job.toml tables. Field names follow FedPilot's config.yaml where one
exists. `JobSpec.from_dict` validates (every error names the source, key, value and what
is allowed); `JobSpec.to_dict` gives plain msgpack/TOML-safe data.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from proto.errors import FabricError
from proto.rounds import clients_per_round

DISTRIBUTIONS = ("iid", "dirichlet", "labels", "shards", "quantity")
#: simulated: every cluster can rebuild every client from one dataset (the job's path);
#: pinned: each cluster builds its clients from the dataset of that name it declares in
#: cluster.toml [datasets], and no client leaves the cluster that holds its data
DATA_PLACEMENTS = ("simulated", "pinned")
STANDARDIZE = ("auto", "features", "none")
TOPOLOGIES = ("star", "hierarchical", "ring", "k_connected", "full", "custom", "hybrid")
#: no server: every node mixes with its neighbours (proto.routing.DECENTRALIZED_KINDS)
DECENTRALIZED_TOPOLOGIES = ("ring", "k_connected", "full", "custom")
AGGREGATORS = (
    "fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad",
    "median", "trimmed_mean", "krum",
)
#: server optimizers with a per-coordinate adaptive step (Reddi et al.)
ADAPTIVE_AGGREGATORS = ("fedadam", "fedyogi", "fedadagrad")
SERVER_STEPS = ("scaled", "plain")
#: training.fedprox_mu when aggregation.name = "fedprox" leaves it out: chosen on
#: bench_learning's grid (docs/job.md, "fedprox's mu"): over the 248 fedprox jobs of 64
#: cells, mu 0.1 put 22 more than 0.01 below FedAvg on the same cell (worst -0.028, small
#: CNNs), 0.01 put 4 (worst -0.017, a cell where FedAvg swings as much); Li et al. (2020)
#: search 0.001-1 per data set
FEDPROX_MU = 0.01
STALL_ACTIONS = ("restore", "warn")
NORM_STATISTICS = ("auto", "measured", "pooled")
PLACEMENT_STRATEGIES = ("locality", "round_robin", "random", "precomputed")
PLACEMENT_GROUP_STRATEGIES = ("SPREAD", "PACK")
COMPRESSIONS = ("none", "fp16", "int8", "topk")
OPTIMIZERS = ("sgd", "adam")
#: the client learning rate over the job's rounds: constant, or a cosine from
#: learning_rate at round 1 to near 0 at the last round
LR_SCHEDULES = ("constant", "cosine")
#: training.learning_rate_check: "auto" tries the learning rate before the job starts
#: (worker.training.learning_rate_trial) and halves it where it leaves the model at a
#: uniform guess; "off" trains at learning_rate as given
LR_CHECKS = ("auto", "off")
DEVICES = ("cpu", "cuda", "auto")           # auto: cuda when the actor sees a GPU, else cpu
DATASETS = ("digits",)                      # plus a file dataset PREFIX:PATH[#options]
# file datasets (fedcore/data reads them; docs/job.md says what each holds)
DATASET_PREFIXES = ("npz:", "imagefolder:", "csv:", "parquet:")
MODELS = ("mlp", "cnn", "lenet")            # plus "package.module:Class"
K_CONNECTED_MODES = ("random", "similarity", "complementary")
#: topology.mixing_steps at most: each step sends every model over every edge once more
MAX_MIXING_STEPS = 4
#: aggregators whose decentralized jobs choose their mixing steps from the graph when
#: topology.mixing_steps = 0 (plain averaging; measured with fedavg). The others mix once:
#: fedavgm's momentum diverges with more steps, a robust rule was not measured with them.
AUTO_MIXING_AGGREGATORS = ("fedavg", "fedprox")


class JobSpecError(FabricError, ValueError):
    """A job specification is invalid. The message is one line naming the source, the
    dotted key, the bad value and what is allowed."""

    def __init__(self, source: str, key: str, message: str) -> None:
        self.source = source
        self.key = key
        self.detail = message
        super().__init__(f"{source}: {message}")

    def __reduce__(self) -> tuple[type[JobSpecError], tuple[str, str, str]]:
        # rebuilt from its own arguments when it crosses a process (a pool, a Ray task)
        return (type(self), (self.source, self.key, self.detail))


@dataclass(frozen=True)
class DataSpec:
    dataset: str = "digits"                 # "digits" or PREFIX:PATH; pinned: a NAME
    placement: str = "simulated"            # simulated | pinned (DATA_PLACEMENTS)
    number_of_clients: int = 30
    data_distribution_kind: str = "dirichlet"
    dirichlet_beta: float = 0.5
    labels_per_client: int = 2              # for "labels"
    shards_per_client: int = 2              # for "shards"
    quantity_beta: float = 0.5              # for "quantity" (Dirichlet over client sizes)
    client_test_fraction: float = 0.2       # each client's own test split (personalized eval)
    # samples shifted and scaled by the training samples' mean and sd (a table's per
    # feature, an image's per channel): "features" always, "auto" where they are off a
    # unit scale in a simulated job (fedcore.data.prepare), "none" never
    standardize: str = "auto"


@dataclass(frozen=True)
class ModelSpec:
    name: str = "mlp"                       # mlp | cnn | lenet | package.module:Class
    hidden: int = 64                        # width for mlp


@dataclass(frozen=True)
class TrainingSpec:
    federated_learning_rounds: int = 30
    number_of_epochs: int = 2
    batch_size: int = 16
    # batch_size is the largest batch (an epoch's are of near-equal sizes); a client with
    # fewer than min_batches_per_epoch batches trains on that many smaller ones while each
    # keeps training.MIN_BATCH samples; 0 = ceil(n / batch_size) batches (worker.training).
    # A model with BatchNorm takes half as many, of MIN_BATCH_NORM (8) samples or more.
    # 8 (down to 4 samples) against 4 (down to 8), the reference FedAvg loop, 15 rounds x
    # 2 epochs: digits SmallCNN beta 0.3 / 50 clients 0.368 -> 0.755, beta 1.0 / 50 0.423
    # -> 0.783, beta 0.1 / 20 0.251 -> 0.518, table mlp 0.920 -> 0.974, MNIST SmallCNN
    # beta 0.3 / 50 0.901 -> 0.931. BatchNorm models at 8 down to 8 lost (MNIST BNCNN beta
    # 0.1 / 100 0.932 -> 0.900, digits BNCNN beta 0.3 / 50 0.961 -> 0.953): they keep 4.
    # A client too small for that many batches passes over its samples again, reshuffled,
    # until it took min_batches_per_epoch steps an epoch (worker.training: digits SmallCNN
    # beta 0.3 / 100 clients, reference loop 0.273 -> 0.841).
    min_batches_per_epoch: int = 8
    optimizer: str = "sgd"
    learning_rate: float = 0.05
    weight_decay: float = 0.0
    momentum: float = 0.9                   # sgd's; restarts every round (no client state)
    lr_schedule: str = "cosine"             # constant | cosine (over the job's rounds)
    learning_rate_check: str = "auto"       # auto | off (LR_CHECKS)
    personal_epochs: int = 0                # > 0: personalized accuracy after a fine-tune
    fedprox_mu: float = 0.0                 # > 0 adds the FedProx proximal term (FEDPROX_MU
                                            # when aggregation.name = "fedprox" leaves it out)
    client_fraction: float = 1.0            # share of clients that train each round
    device: str = "cpu"                     # cpu | cuda | auto (DEVICES)
    num_gpus: float = 0.0                   # GPUs reserved per client actor (Ray), e.g. 0.25


@dataclass(frozen=True)
class TopologySpec:
    kind: str = "star"
    client_k_neighbors: int = 0             # k for k_connected; 0 = auto (k_neighbors)
    k_connected_mode: str = "complementary"  # random (k-regular) | similarity | complementary
    # k_connected: inter-cluster model transfers per round at most this x star's on the same
    # placement (edges inside a cluster are free); 0 = the graph as built
    traffic_budget: float = 3.0
    hierarchy_levels: int = 2               # for hierarchical: levels of aggregators
    hierarchy_branching: int = 5            # children per aggregator
    adjacency_file: str = ""                # for custom: CSV adjacency
    inter_cluster_period: int = 1           # for hybrid: groups exchange every N rounds
    mixing_steps: int = 0                   # decentralized: averagings per round; 0 = auto


@dataclass(frozen=True)
class AggregationSpec:
    name: str = "fedavgm"  # every topology (docs/job.md "Does it learn?")
    server_learning_rate: float | None = None  # None = the algorithm's own default
    # fedavgm; None: 0.5 with the scaled step (momentum only picks its direction), 0.9
    # (Hsu et al.) with the plain one
    server_momentum: float | None = None
    # fedadam / fedyogi / fedadagrad; None: 0.5 with the scaled step, 0.9 (Reddi et al.)
    # with the plain one
    beta1: float | None = None
    beta2: float = 0.99
    tau: float = 1e-3                       # adaptivity (fedadam / fedyogi / fedadagrad)
    # server optimizers: "scaled" (each tensor's step follows its own pseudo-gradient and is
    # at most max_step_ratio x FedAvg's) or "plain" (the literature's form, tuned per model)
    server_step: str = "scaled"
    max_step_ratio: float = 2.0             # 0 = unbounded
    on_stall: str = "restore"               # restore (the best model, half the step) | warn
    # FedBN: each client trains and is scored with its own BatchNorm layers (weights and
    # statistics kept by its executor); the global model still carries their pooled mean
    local_batchnorm: bool = False
    # a new model's BatchNorm running statistics: "measured" on the model itself over its
    # aggregating cluster's own clients' samples, or "pooled" from the clients' (theirs
    # describe their own models, not the mean: a FedAvg'd BatchNorm CNN evaluated at
    # chance); "auto": measured where the pooled ones evaluate far worse on those samples
    norm_statistics: str = "auto"
    trim_ratio: float = 0.1                 # trimmed_mean
    krum_byzantine: int = 1                 # krum: f
    # -- how the aggregation that combines clusters closes (issue 33) --
    mode: str = "sync"                      # sync | buffered (AGGREGATION_MODES)
    buffer_size: int = 2                    # buffered: cluster contributions per aggregation
    staleness: str = "polynomial"           # buffered: weight 1 / sqrt(1 + s) (STALENESS_RULES)
    max_staleness: int = 8                  # buffered: older contributions are dropped


@dataclass(frozen=True)
class PlacementSpec:
    strategy: str = "locality"
    placement_group_strategy: str = "SPREAD"
    clustering_period: int = 0              # 0 = never re-plan
    max_materialized: int = 8               # live FederatedNode actors per cluster
    clients_per_call: int = 0               # 0 = auto (light clients batched), 1 = one each
    ap_damping: float = 0.7
    ap_preference: float | None = None      # None = median similarity
    ap_max_exemplar_candidates: int = 800   # above this, AP runs on distinct/sampled histograms
    precomputed_file: str = ""              # for precomputed: JSON/CSV client -> cluster
    louvain_resolution: float = 1.0         # > 1 gives more, smaller community groups
    similarity_weight: float = 1.0          # weight of data similarity vs topology traffic


@dataclass(frozen=True)
class TransferSpec:
    compression: str = "none"
    topk_ratio: float = 0.1

    @property
    def per_edge(self) -> bool:
        """Whether a message depends on its edge (topk's references, kept per edge by
        both ends): then a model goes once per edge, never once for several nodes of one
        cluster (the executor's transport and the planner's transfer count both ask)."""
        return self.compression == "topk"


FAULT_POLICIES = ("continue", "fail")
#: sync: every round waits for its clusters (or a quorum, [rounds]); buffered: the
#: aggregation that combines clusters applies a model once buffer_size contributions came
AGGREGATION_MODES = ("sync", "buffered")
#: staleness weights of buffered contributions: polynomial 1 / sqrt(1 + s) (FedBuff)
STALENESS_RULES = ("polynomial", "constant")
#: topologies whose aggregation across clusters can close early (quorum, buffered)
EARLY_CLOSE_TOPOLOGIES = ("star",)


@dataclass(frozen=True)
class RoundsSpec:
    """When a synchronous round may close without a slow cluster (docs/job.md, "Rounds")."""

    min_participation: float = 1.0          # fraction of the round's clusters that must report
    straggler_grace: float = 0.0            # seconds the others get once the quorum reported


@dataclass(frozen=True)
class FaultsSpec:
    """How a job survives lost processes (docs/job.md, "Faults")."""

    lease_seconds: float = 15.0             # an executor not renewed this long exits
    checkpoint_every: int = 0               # rounds between checkpoints (0 = none)
    on_cluster_loss: str = "continue"       # continue (ride through a lost site) | fail
    min_clusters: int = 1                   # below this, wait for a cluster to return
    return_wait: float = 300.0              # ... this many seconds, then fail
    round_deadline_floor: float = 60.0      # a round's deadline is never shorter
    round_deadline_factor: float = 4.0      # ... and otherwise this x the slowest round seen


PRIVACY_DP = ("none", "central", "local")
#: topologies whose aggregation [privacy] protects: star's root sums its clients' updates,
#: hybrid groups their clients' and at the exchange each other's models
PRIVACY_TOPOLOGIES = ("star", "hybrid")
#: aggregators that need each update on its own (a sum or a noisy mean defeats them)
ROBUST_AGGREGATORS = ("median", "trimmed_mean", "krum")


@dataclass(frozen=True)
class PrivacySpec:
    """Secure aggregation and differential privacy (docs/security.md, "Privacy")."""

    secure_aggregation: bool = False        # the aggregator learns only the sum of updates
    clip_range: float = 1.0                 # secure aggregation's fixed point: +-this a coordinate
    dp: str = "none"                        # none | central | local (PRIVACY_DP)
    clip_norm: float = 1.0                  # L2 bound of one client's update (the first)
    clip_quantile: float | None = None      # central: clip_norm follows this quantile of norms
    noise_multiplier: float | None = None   # noise std / clip_norm; None = from epsilon
    epsilon: float | None = None            # the job's budget (with noise_multiplier: a cap)
    delta: float = 1e-5


@dataclass(frozen=True)
class JobSpec:
    job_id: str = "job"
    seed: int = 0
    data: DataSpec = field(default_factory=DataSpec)
    model: ModelSpec = field(default_factory=ModelSpec)
    training: TrainingSpec = field(default_factory=TrainingSpec)
    topology: TopologySpec = field(default_factory=TopologySpec)
    aggregation: AggregationSpec = field(default_factory=AggregationSpec)
    placement: PlacementSpec = field(default_factory=PlacementSpec)
    transfer: TransferSpec = field(default_factory=TransferSpec)
    faults: FaultsSpec = field(default_factory=FaultsSpec)
    privacy: PrivacySpec = field(default_factory=PrivacySpec)
    rounds: RoundsSpec = field(default_factory=RoundsSpec)

    # -- validation -------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "<job>") -> JobSpec:
        """Build a validated JobSpec from job.toml-shaped data: a `[job]` table (`id`,
        `seed`) and one table per section. Missing keys take their defaults; unknown
        tables or keys, wrong types and out-of-range values raise JobSpecError."""
        if not isinstance(data, Mapping):
            raise JobSpecError(source, "", f"expected a table of sections, got {_show(data)}")
        _check_keys(source, "", data, ("job", *_SECTIONS))
        header = data.get("job", {})
        if not isinstance(header, Mapping):
            raise JobSpecError(source, "job", f"[job] must be a table, got {_show(header)}")
        _check_keys(source, "job", header, ("id", "seed"))
        job_id = _rule_job_id(source, "job.id", header.get("id", "job"))
        seed = _rule_int(0)(source, "job.seed", header.get("seed", 0))
        sections: dict[str, Any] = {}
        for name, section_cls in _SECTIONS.items():
            table = data.get(name, {})
            if not isinstance(table, Mapping):
                raise JobSpecError(source, name, f"[{name}] must be a table, got {_show(table)}")
            sections[name] = _build_section(source, name, section_cls, table)
        privacy, aggregation = sections["privacy"], sections["aggregation"]
        if (privacy.dp == "central" and privacy.noise_multiplier is None
                and aggregation.name == "fedavgm"
                and "server_step" not in data.get("aggregation", {})):
            # DP-FedAvgM's plain step (McMahan et al. 2018); the scaled step's bound and
            # restarts follow each round's noise (docs/security.md, "Privacy": SmallCNN
            # 0.68 -> 0.74 at epsilon 8, MLP 0.79 -> 0.76)
            sections["aggregation"] = replace(aggregation, server_step="plain")
        if aggregation.name == "fedprox" and "fedprox_mu" not in data.get("training", {}):
            sections["training"] = replace(sections["training"], fedprox_mu=FEDPROX_MU)
        spec = cls(job_id=job_id, seed=seed, **sections)
        _check_cross(source, spec)
        return spec

    def to_dict(self) -> dict[str, Any]:
        """Plain data (msgpack- and TOML-safe) that `from_dict` reads back to an equal spec.
        Optional values that are unset (None) are left out."""
        out: dict[str, Any] = {"job": {"id": self.job_id, "seed": self.seed}}
        for name in _SECTIONS:
            section = getattr(self, name)
            out[name] = {
                f.name: getattr(section, f.name)
                for f in fields(section)
                if getattr(section, f.name) is not None
            }
        return out

    def with_paths_resolved(self, base: Callable[[str], str]) -> JobSpec:
        """A copy where every file reference (npz dataset, adjacency, precomputed
        assignment) has been passed through `base` (e.g. made absolute)."""
        data, topology, placement = self.data, self.topology, self.placement
        prefix, sep, ref = data.dataset.partition(":")
        if sep and prefix + sep in DATASET_PREFIXES:
            data = replace(data, dataset=prefix + sep + base(ref))
        if topology.adjacency_file:
            topology = replace(topology, adjacency_file=base(topology.adjacency_file))
        if placement.precomputed_file:
            placement = replace(placement, precomputed_file=base(placement.precomputed_file))
        return replace(self, data=data, topology=topology, placement=placement)


_SECTIONS: dict[str, type] = {
    "data": DataSpec,
    "model": ModelSpec,
    "training": TrainingSpec,
    "topology": TopologySpec,
    "aggregation": AggregationSpec,
    "placement": PlacementSpec,
    "transfer": TransferSpec,
    "faults": FaultsSpec,
    "privacy": PrivacySpec,
    "rounds": RoundsSpec,
}

Rule = Callable[[str, str, Any], Any]


def fixed_mixing_steps(spec: JobSpec) -> int | None:
    """The mixing steps a job fixes, or None when its plan chooses them from the graph
    (topology.mixing_steps = 0 on a decentralized topology with one of the
    AUTO_MIXING_AGGREGATORS). The scheduler's plan and every executor's check of a routing
    matrix use this one rule, so an executor refuses auto steps for fedavgm too."""
    topo = spec.topology
    if topo.mixing_steps:
        return topo.mixing_steps
    if topo.kind in DECENTRALIZED_TOPOLOGIES and spec.aggregation.name in AUTO_MIXING_AGGREGATORS:
        return None
    return 1


def k_neighbors(topology: TopologySpec, n: int) -> int:
    """The k of a k_connected graph on n clients: the job's, or for 0 (the default) one
    that grows with the federation, ceil(log2 n) + 1 and at least 3. A decentralized
    model reaches consensus only as fast as the graph mixes: a fixed small k leaves a
    large federation's nodes drifting apart on non-IID data (bench_learning, MNIST, 40
    clients: fedavg 0.892 at k = 3, 0.909-0.913 at k = 6...9, as star's 0.913), and
    log-degree graphs are the ones that mix in few rounds (exponential graphs, Ying et
    al. 2021). Capped at n - 1."""
    if n <= 1:
        return 0
    k = topology.client_k_neighbors or max(3, math.ceil(math.log2(n)) + 1)
    return min(k, n - 1)


def _show(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, list):
        return f"a list {value!r}"[:80]
    return repr(value)


def _check_keys(source: str, prefix: str, table: Mapping[str, Any], allowed: Any) -> None:
    allowed = tuple(allowed)
    for key in table:
        if key in allowed:
            continue
        dotted = f"{prefix}.{key}" if prefix else f"[{key}]"
        close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
        suggestion = (f"{prefix}.{close[0]}" if prefix else f"[{close[0]}]") if close else ""
        hint = f"did you mean {suggestion}?" if close else "allowed: " + ", ".join(allowed)
        what = "key" if prefix else "table"
        raise JobSpecError(source, dotted.strip("[]"), f"unknown {what} {dotted} ({hint})")


def _fail(source: str, key: str, value: Any, allowed: str) -> JobSpecError:
    return JobSpecError(source, key, f"{key} = {_show(value)} is invalid: expected {allowed}")


def _rule_int(low: int, high: int | None = None) -> Rule:
    def rule(source: str, key: str, value: Any) -> int:
        bound = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(source, key, value, bound)
        if value < low or (high is not None and value > high):
            raise _fail(source, key, value, bound)
        return value
    return rule


def _rule_float(low: float, high: float | None = None, *, low_open: bool = False,
                high_open: bool = False) -> Rule:
    lo = ">" if low_open else ">="
    hi = "<" if high_open else "<="
    bound = f"a number {lo} {low}" + (f" and {hi} {high}" if high is not None else "")

    def rule(source: str, key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _fail(source, key, value, bound)
        x = float(value)
        if not math.isfinite(x) or x < low or (low_open and x == low):
            raise _fail(source, key, value, bound)
        if high is not None and (x > high or (high_open and x == high)):
            raise _fail(source, key, value, bound)
        return x
    return rule


def _rule_choice(choices: tuple[str, ...]) -> Rule:
    def rule(source: str, key: str, value: Any) -> str:
        if isinstance(value, str) and value in choices:
            return value
        close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise _fail(source, key, value, "one of " + ", ".join(choices) + hint)
    return rule


def _rule_str(source: str, key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _fail(source, key, value, "a string")
    return value


_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_CLASS_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _rule_job_id(source: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not _JOB_ID.match(value):
        raise _fail(source, key, value,
                    "1-64 characters of letters, digits, '.', '_' or '-' (it names runs/<id>/)")
    return value


_DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def dataset_is_path(dataset: str) -> bool:
    """Whether `dataset` is a file dataset PREFIX:PATH (else a built-in or a declared name)."""
    return any(dataset.startswith(p) and len(dataset) > len(p) for p in DATASET_PREFIXES)


def _rule_dataset(source: str, key: str, value: Any) -> str:
    # a bare NAME is a dataset the clusters declare (data.placement = "pinned"; checked
    # with the other keys in _check_cross)
    if isinstance(value, str) and (value in DATASETS or dataset_is_path(value)
                                   or _DATASET_NAME.match(value)):
        return value
    raise _fail(source, key, value, "one of " + ", ".join(DATASETS) + ", or " +
                ", ".join(f"'{p}PATH'" for p in DATASET_PREFIXES) +
                ", or (data.placement = 'pinned') the NAME of a cluster.toml [datasets] entry")


def _rule_aggregator(source: str, key: str, value: Any) -> str:
    # a user class is loaded (and checked against the interface) by worker/aggregators
    if isinstance(value, str) and _CLASS_PATH.match(value):
        return value
    return _rule_choice(AGGREGATORS)(source, key, value)


def _rule_model(source: str, key: str, value: Any) -> str:
    if isinstance(value, str) and (value in MODELS or _CLASS_PATH.match(value)):
        return value
    close = difflib.get_close_matches(str(value), MODELS, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise _fail(source, key, value, "one of " + ", ".join(MODELS) +
                ", or 'package.module:Class'" + hint)


def _rule_optional(inner: Rule) -> Rule:
    """`inner`, or None where the key is left unset (TOML has no null: a default)."""
    def rule(source: str, key: str, value: Any) -> Any:
        return None if value is None else inner(source, key, value)
    return rule


_rule_optional_float = _rule_optional(_rule_float(-math.inf))
_rule_optional_positive_float = _rule_optional(_rule_float(0.0, low_open=True))


_RULES: dict[str, Rule] = {
    "data.dataset": _rule_dataset,
    "data.placement": _rule_choice(DATA_PLACEMENTS),
    "data.standardize": _rule_choice(STANDARDIZE),
    "data.number_of_clients": _rule_int(1, 10_000_000),
    "data.data_distribution_kind": _rule_choice(DISTRIBUTIONS),
    "data.dirichlet_beta": _rule_float(0.0, low_open=True),
    "data.labels_per_client": _rule_int(1),
    "data.shards_per_client": _rule_int(1),
    "data.quantity_beta": _rule_float(0.0, low_open=True),
    "data.client_test_fraction": _rule_float(0.0, 1.0, high_open=True),
    "model.name": _rule_model,
    "model.hidden": _rule_int(1, 1_000_000),
    "training.federated_learning_rounds": _rule_int(1),
    "training.number_of_epochs": _rule_int(1),
    "training.batch_size": _rule_int(1),
    "training.min_batches_per_epoch": _rule_int(0, 10_000),
    "training.optimizer": _rule_choice(OPTIMIZERS),
    "training.learning_rate": _rule_float(0.0, low_open=True),
    "training.weight_decay": _rule_float(0.0),
    "training.momentum": _rule_float(0.0, 1.0, high_open=True),
    "training.lr_schedule": _rule_choice(LR_SCHEDULES),
    "training.learning_rate_check": _rule_choice(LR_CHECKS),
    "training.personal_epochs": _rule_int(0, 100),
    "training.fedprox_mu": _rule_float(0.0),
    "training.client_fraction": _rule_float(0.0, 1.0, low_open=True),
    "training.device": _rule_choice(DEVICES),
    "training.num_gpus": _rule_float(0.0, 64.0),
    "topology.kind": _rule_choice(TOPOLOGIES),
    "topology.client_k_neighbors": _rule_int(0),
    "topology.k_connected_mode": _rule_choice(K_CONNECTED_MODES),
    "topology.traffic_budget": _rule_float(0.0),
    "topology.hierarchy_levels": _rule_int(1, 16),
    "topology.hierarchy_branching": _rule_int(2),
    "topology.adjacency_file": _rule_str,
    "topology.inter_cluster_period": _rule_int(1),
    "topology.mixing_steps": _rule_int(0, MAX_MIXING_STEPS),
    "aggregation.name": _rule_aggregator,
    "aggregation.server_learning_rate": _rule_optional_positive_float,
    "aggregation.server_momentum": _rule_optional(_rule_float(0.0, 1.0, high_open=True)),
    "aggregation.beta1": _rule_optional(_rule_float(0.0, 1.0, high_open=True)),
    "aggregation.beta2": _rule_float(0.0, 1.0, high_open=True),
    "aggregation.tau": _rule_float(0.0, low_open=True),
    "aggregation.server_step": _rule_choice(SERVER_STEPS),
    "aggregation.max_step_ratio": _rule_float(0.0),
    "aggregation.on_stall": _rule_choice(STALL_ACTIONS),
    "aggregation.norm_statistics": _rule_choice(NORM_STATISTICS),
    "aggregation.trim_ratio": _rule_float(0.0, 0.5, high_open=True),
    "aggregation.krum_byzantine": _rule_int(0),
    "aggregation.mode": _rule_choice(AGGREGATION_MODES),
    "aggregation.buffer_size": _rule_int(1, 1024),
    "aggregation.staleness": _rule_choice(STALENESS_RULES),
    "aggregation.max_staleness": _rule_int(0, 1024),
    "rounds.min_participation": _rule_float(0.0, 1.0, low_open=True),
    "rounds.straggler_grace": _rule_float(0.0, 86400.0),
    "placement.strategy": _rule_choice(PLACEMENT_STRATEGIES),
    "placement.placement_group_strategy": _rule_choice(PLACEMENT_GROUP_STRATEGIES),
    "placement.clustering_period": _rule_int(0),
    "placement.max_materialized": _rule_int(1),
    "placement.clients_per_call": _rule_int(0, 1024),
    "placement.ap_damping": _rule_float(0.5, 1.0, high_open=True),
    "placement.ap_preference": _rule_optional_float,
    "placement.ap_max_exemplar_candidates": _rule_int(2, 20_000),
    "placement.precomputed_file": _rule_str,
    "placement.louvain_resolution": _rule_float(0.0, low_open=True),
    "placement.similarity_weight": _rule_float(0.0),
    "transfer.compression": _rule_choice(COMPRESSIONS),
    "transfer.topk_ratio": _rule_float(0.0, 1.0, low_open=True),
    "faults.lease_seconds": _rule_float(2.0, 3600.0),  # what job.lease allows
    "faults.checkpoint_every": _rule_int(0),
    "faults.on_cluster_loss": _rule_choice(FAULT_POLICIES),
    "faults.min_clusters": _rule_int(1),
    "faults.return_wait": _rule_float(0.0),
    "faults.round_deadline_floor": _rule_float(1.0),
    "faults.round_deadline_factor": _rule_float(1.0),
}


def _build_section(source: str, name: str, section_cls: type, table: Mapping[str, Any]) -> Any:
    names = [f.name for f in fields(section_cls)]
    _check_keys(source, name, table, names)
    values = {key: _RULES[f"{name}.{key}"](source, f"{name}.{key}", value)
              for key, value in table.items()}
    return section_cls(**values)


def _check_cross(source: str, spec: JobSpec) -> None:
    """Rules that involve more than one key."""
    _check_data_placement(source, spec)
    _check_privacy(source, spec)
    training = spec.training
    if training.device == "cuda" and training.num_gpus <= 0:
        raise _fail(source, "training.num_gpus", training.num_gpus,
                    "a number > 0 with training.device = 'cuda': a Ray actor sees only the GPUs "
                    "it reserves (e.g. 0.25 shares one GPU among four client actors)")
    if training.device == "cpu" and training.num_gpus > 0:
        raise _fail(source, "training.device", training.device,
                    f"'cuda' or 'auto' with training.num_gpus = {training.num_gpus:g}: the "
                    "reserved GPUs would go unused on 'cpu'")
    n = spec.data.number_of_clients
    topo = spec.topology
    if topo.kind == "k_connected" and topo.client_k_neighbors >= n:
        raise _fail(source, "topology.client_k_neighbors", topo.client_k_neighbors,
                    f"0 (auto) or an integer < data.number_of_clients ({n}) for k_connected")
    if topo.mixing_steps > 1 and topo.kind not in DECENTRALIZED_TOPOLOGIES:
        raise _fail(source, "topology.mixing_steps", topo.mixing_steps,
                    f"1 on {topo.kind}: mixing steps are neighbour averagings of a "
                    "decentralized topology (ring, k_connected, full, custom)")
    if topo.kind == "custom" and not topo.adjacency_file:
        raise JobSpecError(source, "topology.adjacency_file",
                           "topology.adjacency_file is required when topology.kind = 'custom' "
                           "(a CSV adjacency matrix)")
    if spec.placement.strategy == "precomputed" and not spec.placement.precomputed_file:
        raise JobSpecError(source, "placement.precomputed_file",
                           "placement.precomputed_file is required when placement.strategy = "
                           "'precomputed' (JSON or CSV client -> cluster)")
    drawn = clients_per_round(n, training.client_fraction)
    if spec.aggregation.name == "krum" and drawn <= 2 * spec.aggregation.krum_byzantine + 2:
        raise _fail(source, "aggregation.krum_byzantine", spec.aggregation.krum_byzantine,
                    f"an integer f with data.number_of_clients ({n}) > 2f + 2 for krum"
                    if drawn == n else
                    f"an integer f with the clients a round draws ({drawn} of {n} at "
                    f"training.client_fraction = {training.client_fraction:g}) > 2f + 2 "
                    "for krum (or a larger client_fraction)")
    if spec.aggregation.name in ADAPTIVE_AGGREGATORS and topo.kind in ("ring", "k_connected",
                                                                       "custom"):
        raise _fail(source, "aggregation.name", spec.aggregation.name,
                    f"fedavg, fedprox or fedavgm on {topo.kind}: with no server, every node "
                    "would take its own adaptive (sign-like) steps from its own neighbourhood "
                    "and the nodes drift apart (bench_learning, MNIST k_connected: fedadam "
                    "0.70, fedavgm 0.91); adaptive optimizers suit star, hierarchical, hybrid, "
                    "full")
    if spec.aggregation.name == "fedavgm" and topo.mixing_steps > 1:
        raise _fail(source, "topology.mixing_steps", topo.mixing_steps,
                    "1 with fedavgm (or aggregation.name = 'fedavg'): a node's momentum steps "
                    "on its disagreement with its neighbours too, and mixing again after it "
                    "feeds that back (bench_learning, MNIST k_connected fedavgm with 2 steps: "
                    "the loss explodes, chance at round 15)")
    if (spec.aggregation.name == "krum" and topo.kind in DECENTRALIZED_TOPOLOGIES
            and training.client_fraction < 1):
        # a round mixes each drawn node and its neighbours with their drawn neighbours only
        # (worker.executor.engine.Draw): a node with one drawn neighbour has 2 models
        raise _fail(source, "training.client_fraction", training.client_fraction,
                    f"1 with krum on {topo.kind}: at a smaller fraction a node mixes its own "
                    "model with its drawn neighbours' only, as few as 2 models, and krum "
                    "needs krum_byzantine + 3 (use median, or star / hierarchical)")
    if spec.aggregation.name == "krum" and topo.kind in ("ring", "k_connected"):
        # a decentralized node mixes its own model and its neighbours' with the aggregator
        least = 3 if topo.kind == "ring" else k_neighbors(topo, n) + 1
        f = spec.aggregation.krum_byzantine
        if least < f + 3:
            raise _fail(source, "aggregation.krum_byzantine", f,
                        f"at most {least - 3} on {topo.kind}: a node mixes as few as {least} "
                        f"models and krum needs krum_byzantine + 3 (use more "
                        "topology.client_k_neighbors, or median)")
    _check_early_close(source, spec)
    if spec.aggregation.name == "fedprox" and training.fedprox_mu <= 0:
        raise _fail(source, "training.fedprox_mu", training.fedprox_mu,
                    "a number > 0 with aggregation.name = 'fedprox' (with 0 it is FedAvg; "
                    f"leave it out for {FEDPROX_MU})")


def early_close(spec: JobSpec) -> bool:
    """Whether the job's rounds may close before every cluster reported (a quorum, or
    buffered aggregation): then a slow cluster trains on while the others go on."""
    return spec.aggregation.mode == "buffered" or spec.rounds.min_participation < 1.0


def _check_early_close(source: str, spec: JobSpec) -> None:
    kind = spec.topology.kind
    if not early_close(spec):
        return
    key, value = (("aggregation.mode", spec.aggregation.mode)
                  if spec.aggregation.mode == "buffered"
                  else ("rounds.min_participation", spec.rounds.min_participation))
    if spec.privacy.secure_aggregation or spec.privacy.dp != "none":
        raise _fail(source, key, value,
                    f"{'sync' if key == 'aggregation.mode' else 1.0!r} with [privacy]: its "
                    "masks and noise are per round over every cluster, an aggregation that "
                    "closes without one (or with stale updates) is not covered yet")
    if kind in EARLY_CLOSE_TOPOLOGIES:
        return
    ok = "sync" if key == "aggregation.mode" else 1.0
    why = (" its groups exchange their models with each other and must all mix the same ones"
           " to keep one global model, so no group can go on without a slow one and apply"
           " its model later;" if kind == "hybrid" else "")
    raise _fail(source, key, value,
                f"{ok!r} on {kind}:{why} only star's root combines the clusters' contributions "
                "in one place, where a round can close without a slow cluster: use "
                f"topology.kind = 'star' for it, or {key} = {ok!r} on {kind}")


def _check_data_placement(source: str, spec: JobSpec) -> None:
    """Pinned data names a dataset the clusters declare; simulated data is one the job
    names by path (or a built-in). Pinned placement is fixed by where the data is, so no
    assignment strategy applies."""
    dataset = spec.data.dataset
    if spec.data.placement == "pinned":
        if dataset_is_path(dataset) or dataset in DATASETS:
            raise _fail(source, "data.dataset", dataset,
                        "with data.placement = 'pinned', the NAME of a dataset every cluster "
                        "declares in its cluster.toml [datasets] (e.g. \"site\"), not a path or "
                        "a built-in: each cluster reads its own file")
        if spec.placement.strategy != "locality":
            raise _fail(source, "placement.strategy", spec.placement.strategy,
                        "'locality' (the default) with data.placement = 'pinned': every client "
                        "stays on the cluster that holds its data, so no other assignment applies")
        return
    if not (dataset in DATASETS or dataset_is_path(dataset)):
        raise _fail(source, "data.dataset", dataset,
                    "one of " + ", ".join(DATASETS) + ", or " +
                    ", ".join(f"'{p}PATH'" for p in DATASET_PREFIXES) +
                    f"; a bare name ({dataset!r}) means the dataset of that name each cluster "
                    "declares in cluster.toml [datasets]: set data.placement = 'pinned' for that")


# -- [privacy] ------------------------------------------------------------------------------

def _rule_bool(source: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(source, key, value, "true or false")
    return value


_RULES.update({
    "aggregation.local_batchnorm": _rule_bool,
    "privacy.secure_aggregation": _rule_bool,
    "privacy.clip_range": _rule_float(0.0, low_open=True),
    "privacy.dp": _rule_choice(PRIVACY_DP),
    "privacy.clip_norm": _rule_float(0.0, low_open=True),
    "privacy.clip_quantile": _rule_optional(_rule_float(0.0, 1.0, low_open=True,
                                                        high_open=True)),
    "privacy.noise_multiplier": _rule_optional_positive_float,
    "privacy.epsilon": _rule_optional_positive_float,
    "privacy.delta": _rule_float(0.0, 1.0, low_open=True, high_open=True),
})


def _check_privacy(source: str, spec: JobSpec) -> None:
    p = spec.privacy
    if not p.secure_aggregation and p.dp == "none":
        return
    what = "privacy.secure_aggregation" if p.secure_aggregation else "privacy.dp"
    value: Any = True if p.secure_aggregation else p.dp
    kind = spec.topology.kind
    if kind not in PRIVACY_TOPOLOGIES and not (p.dp == "local" and not p.secure_aggregation):
        raise _fail(source, what, value,
                    f"false/'none' on {kind}, or topology.kind = 'star' or 'hybrid' (or "
                    "privacy.dp = 'local' alone): a hierarchy's inner levels and "
                    "decentralized mixing are not protected yet")
    if p.secure_aggregation and kind == "hybrid" and spec.topology.inter_cluster_period != 1:
        raise _fail(source, "topology.inter_cluster_period", spec.topology.inter_cluster_period,
                    "1 with privacy.secure_aggregation: the groups unmask the mean of their "
                    "updates from one common model, which they hold only when they exchange "
                    "every round")
    if p.dp == "local" and kind in DECENTRALIZED_TOPOLOGIES:
        raise _fail(source, "privacy.dp", p.dp, f"'none' or 'central' on {kind}: local noise "
                    "is added to updates a client sends to a parent (star, hierarchical, hybrid)")
    if spec.aggregation.name in ROBUST_AGGREGATORS:
        raise _fail(source, "aggregation.name", spec.aggregation.name,
                    f"a mean-based rule (fedavg, fedavgm, fedadam, ...) with {what}: "
                    f"{spec.aggregation.name} needs each update on its own, the aggregator "
                    "sees only their sum (or a clipped, noised mean)")
    if p.secure_aggregation and spec.transfer.compression != "none":
        raise _fail(source, "transfer.compression", spec.transfer.compression,
                    "'none' with privacy.secure_aggregation: a masked update is uniform in its "
                    "ring, which no codec compresses, and a lossy codec would break the sum")
    if p.clip_quantile is not None and (p.dp != "central" or p.secure_aggregation):
        raise _fail(source, "privacy.clip_quantile", p.clip_quantile,
                    "unset unless privacy.dp = 'central' without secure_aggregation: the "
                    "aggregator clips to the norm it adapts, where clients clipping before "
                    "they mask or noise would need each round's norm")
    if p.dp != "none" and p.noise_multiplier is None and p.epsilon is None:
        raise JobSpecError(source, "privacy.noise_multiplier",
                           f"privacy.dp = {p.dp!r} needs privacy.noise_multiplier or a target "
                           "privacy.epsilon (with privacy.delta)")
