"""The job specification: what `job.toml` says and what travels from the scheduler to clusters.

Sections mirror job.toml tables. Field names follow FedPilot's config.yaml where one
exists. `JobSpec.from_dict` validates (every error names the source, key, value and what
is allowed); `JobSpec.to_dict` gives plain msgpack/TOML-safe data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DISTRIBUTIONS = ("iid", "dirichlet", "labels", "shards", "quantity")
TOPOLOGIES = ("star", "hierarchical", "ring", "k_connected", "full", "custom", "hybrid")
AGGREGATORS = (
    "fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad",
    "median", "trimmed_mean", "krum",
)
PLACEMENT_STRATEGIES = ("locality", "round_robin", "random", "precomputed")
PLACEMENT_GROUP_STRATEGIES = ("SPREAD", "PACK")
COMPRESSIONS = ("none", "fp16", "int8", "topk")
OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class DataSpec:
    dataset: str = "digits"                 # "digits" or "npz:PATH"
    number_of_clients: int = 30
    data_distribution_kind: str = "dirichlet"
    dirichlet_beta: float = 0.5
    labels_per_client: int = 2              # for "labels"
    shards_per_client: int = 2              # for "shards"
    quantity_beta: float = 0.5              # for "quantity" (Dirichlet over client sizes)
    client_test_fraction: float = 0.2       # each client's own test split (personalized eval)


@dataclass(frozen=True)
class ModelSpec:
    name: str = "mlp"                       # mlp | cnn | lenet | package.module:Class
    hidden: int = 64                        # width for mlp


@dataclass(frozen=True)
class TrainingSpec:
    federated_learning_rounds: int = 30
    number_of_epochs: int = 2
    batch_size: int = 16
    optimizer: str = "sgd"
    learning_rate: float = 0.05
    weight_decay: float = 0.0
    momentum: float = 0.0
    fedprox_mu: float = 0.0                 # > 0 adds the FedProx proximal term
    client_fraction: float = 1.0            # share of clients that train each round


@dataclass(frozen=True)
class TopologySpec:
    kind: str = "star"
    client_k_neighbors: int = 3             # k for k_connected
    k_connected_mode: str = "similarity"    # "random" (random regular) | "similarity"
    hierarchy_levels: int = 2               # for hierarchical: levels of aggregators
    hierarchy_branching: int = 5            # children per aggregator
    adjacency_file: str = ""                # for custom: CSV adjacency
    inter_cluster_period: int = 1           # for hybrid: groups exchange every N rounds


@dataclass(frozen=True)
class AggregationSpec:
    name: str = "fedavg"
    server_learning_rate: float = 1.0
    server_momentum: float = 0.9            # fedavgm
    beta1: float = 0.9                      # fedadam / fedyogi
    beta2: float = 0.99
    tau: float = 1e-3                       # adaptivity (fedadam / fedyogi / fedadagrad)
    trim_ratio: float = 0.1                 # trimmed_mean
    krum_byzantine: int = 1                 # krum: f


@dataclass(frozen=True)
class PlacementSpec:
    strategy: str = "locality"
    placement_group_strategy: str = "SPREAD"
    clustering_period: int = 0              # 0 = never re-plan
    max_materialized: int = 8               # live FederatedNode actors per cluster
    ap_damping: float = 0.7
    ap_preference: float | None = None      # None = median similarity
    ap_max_exemplar_candidates: int = 2000  # above this, AP runs on distinct/sampled histograms
    precomputed_file: str = ""              # for precomputed: JSON/CSV client -> cluster


@dataclass(frozen=True)
class TransferSpec:
    compression: str = "none"
    topk_ratio: float = 0.1


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
