"""job.toml validation: defaults, round trips, and one clear error line per bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from proto.job import JobSpec, JobSpecError
from scheduler.jobfile import load_job

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_and_round_trip() -> None:
    spec = JobSpec.from_dict({})
    assert spec == JobSpec()
    custom = JobSpec.from_dict({"job": {"id": "x-1", "seed": 7},
                                "training": {"number_of_epochs": 3},
                                "placement": {"ap_preference": -0.5}})
    assert custom.seed == 7 and custom.training.number_of_epochs == 3
    assert JobSpec.from_dict(custom.to_dict()) == custom
    assert "ap_preference" not in JobSpec().to_dict()["placement"]  # None is left out


def test_integer_accepted_for_float_keys() -> None:
    spec = JobSpec.from_dict({"data": {"dirichlet_beta": 1}})
    assert spec.data.dirichlet_beta == 1.0 and isinstance(spec.data.dirichlet_beta, float)


@pytest.mark.parametrize("path", sorted((REPO / "deploy" / "examples").glob("*.toml")))
def test_example_job_files_load(path: Path) -> None:
    if "[job]" not in path.read_text():
        pytest.skip("not a job file")
    spec = load_job(path)
    assert spec.job_id


BAD = [
    # (toml text, substrings the one-line error must contain)
    ("[trainig]\nnumber_of_epochs = 2\n", ["unknown table [trainig]", "did you mean [training]"]),
    ("[training]\nnumber_of_epoch = 2\n",
     ["unknown key training.number_of_epoch", "did you mean training.number_of_epochs"]),
    ("[data]\nnumbr_of_clients = 2\n", ["data.numbr_of_clients", "data.number_of_clients"]),
    ("[job]\nname = 'x'\n", ["unknown key job.name", "allowed: id, seed"]),
    ("[training]\nnumber_of_epochs = '2'\n", ["training.number_of_epochs = '2'", "integer >= 1"]),
    ("[training]\nnumber_of_epochs = 2.5\n", ["training.number_of_epochs = 2.5", "integer"]),
    ("[training]\nnumber_of_epochs = true\n", ["training.number_of_epochs = True", "integer"]),
    ("[training]\nnumber_of_epochs = 0\n", ["training.number_of_epochs = 0", "integer >= 1"]),
    ("[data]\nnumber_of_clients = -3\n", ["data.number_of_clients = -3", ">= 1"]),
    ("[data]\ndirichlet_beta = 0\n", ["data.dirichlet_beta = 0", "number > 0"]),
    ("[data]\ndirichlet_beta = 'high'\n", ["data.dirichlet_beta = 'high'", "number"]),
    ("[data]\nclient_test_fraction = 1.0\n", ["data.client_test_fraction = 1.0", "< 1.0"]),
    # optional (unset: the step form's own default), but bounded when set
    ("[aggregation]\nserver_momentum = 1.0\n",
     ["aggregation.server_momentum = 1.0", ">= 0.0 and < 1.0"]),
    ("[aggregation]\nserver_momentum = 'high'\n", ["aggregation.server_momentum = 'high'"]),
    ("[data]\ndata_distribution_kind = 'dirichlet2'\n",
     ["data.data_distribution_kind = 'dirichlet2'", "one of iid, dirichlet", "'dirichlet'"]),
    ("[data]\ndataset = 'mnistt'\n", ["data.dataset = 'mnistt'", "npz:PATH"]),
    ("[model]\nname = 'resnet'\n", ["model.name = 'resnet'", "mlp, cnn, lenet"]),
    ("[topology]\nkind = 'starr'\n", ["topology.kind = 'starr'", "did you mean 'star'"]),
    ("[topology]\nk_connected_mode = 'nearest'\n", ["topology.k_connected_mode", "similarity"]),
    ("[aggregation]\nname = 'fedprox'\n[training]\nfedprox_mu = 0.0\n",
     ["training.fedprox_mu = 0.0", "it is FedAvg", "leave it out for 0.01"]),
    ("[aggregation]\nname = 'fedadam'\n[topology]\nkind = 'k_connected'\n",
     ["aggregation.name = 'fedadam'", "fedavg, fedprox or fedavgm on k_connected", "drift apart"]),
    ("[aggregation]\nname = 'krum'\n[topology]\nkind = 'ring'\n",
     ["aggregation.krum_byzantine = 1", "at most 0 on ring", "median"]),
    # krum in a round that cannot have krum_byzantine + 3 updates (it failed the round)
    ("[aggregation]\nname = 'krum'\n[topology]\nkind = 'k_connected'\n"
     "[training]\nclient_fraction = 0.3\n",
     ["training.client_fraction = 0.3", "1 with krum on k_connected", "as few as 2 models"]),
    ("[aggregation]\nname = 'krum'\n[data]\nnumber_of_clients = 20\n"
     "[training]\nclient_fraction = 0.1\n",
     ["aggregation.krum_byzantine = 1", "a round draws (2 of 20", "client_fraction"]),
    ("[training]\nlr_schedule = 'step'\n", ["training.lr_schedule", "cosine"]),
    ("[aggregation]\nname = 'fedavgg'\n", ["aggregation.name = 'fedavgg'", "'fedavg'"]),
    ("[aggregation]\ntrim_ratio = 0.5\n", ["aggregation.trim_ratio = 0.5", "< 0.5"]),
    ("[aggregation]\nserver_step = 'big'\n", ["aggregation.server_step = 'big'", "scaled, plain"]),
    ("[aggregation]\nmax_step_ratio = -1\n", ["aggregation.max_step_ratio = -1", ">= 0"]),
    ("[aggregation]\nmax_step_ratio = 'x'\n", ["aggregation.max_step_ratio = 'x'", "number"]),
    ("[aggregation]\non_stall = 'stop'\n", ["aggregation.on_stall = 'stop'", "restore, warn"]),
    ("[aggregation]\nnorm_statistics = 'mean'\n",
     ["aggregation.norm_statistics = 'mean'", "auto, measured, pooled"]),
    ("[aggregation]\nlocal_batchnorm = 1\n", ["aggregation.local_batchnorm = 1", "true or false"]),
    ("[aggregation]\nserver_learning_rate = 0\n",
     ["aggregation.server_learning_rate = 0", "> 0"]),
    ("[topology]\ntraffic_budget = -2\n", ["topology.traffic_budget = -2", ">= 0"]),
    ("[placement]\nstrategy = 'nearest'\n", ["placement.strategy = 'nearest'", "locality"]),
    ("[placement]\nplacement_group_strategy = 'spread'\n",
     ["placement.placement_group_strategy = 'spread'", "SPREAD, PACK"]),
    ("[placement]\nap_damping = 0.2\n", ["placement.ap_damping = 0.2", ">= 0.5"]),
    ("[placement]\nclustering_period = -1\n", ["placement.clustering_period = -1", ">= 0"]),
    ("[transfer]\ncompression = 'zip'\n", ["transfer.compression = 'zip'", "fp16"]),
    ("[transfer]\ntopk_ratio = 0\n", ["transfer.topk_ratio = 0", "> 0.0"]),
    ("[job]\nid = 'a b'\n", ["job.id = 'a b'", "letters, digits"]),
    ("[job]\nseed = -1\n", ["job.seed = -1", ">= 0"]),
    ("training = 3\n", ["[training] must be a table"]),
    ("[data]\nnumber_of_clients = 5\n[topology]\nkind = 'k_connected'\nclient_k_neighbors = 5\n",
     ["topology.client_k_neighbors = 5", "< data.number_of_clients (5)"]),
    ("[topology]\nkind = 'custom'\n", ["topology.adjacency_file is required"]),
    ("[placement]\nstrategy = 'precomputed'\n", ["placement.precomputed_file is required"]),
    ("[topology]\nkind = 'custom'\nadjacency_file = 'nope.csv'\n",
     ["topology.adjacency_file", "nope.csv does not exist"]),
    ("[placement]\nstrategy = 'precomputed'\nprecomputed_file = 'missing.json'\n",
     ["placement.precomputed_file", "missing.json does not exist"]),
    ("[data]\ndataset = 'npz:absent.npz'\n", ["data.dataset", "absent.npz does not exist"]),
    ("[training]\nnumber_of_epochs = = 2\n", ["invalid TOML", "line 2"]),
]


@pytest.mark.parametrize(("text", "needles"), BAD, ids=[b[1][0][:40] for b in BAD])
def test_bad_job_file_gives_one_clear_line(tmp_path: Path, text: str, needles: list[str]) -> None:
    path = write(tmp_path, text)
    with pytest.raises(JobSpecError) as info:
        load_job(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    for needle in needles:
        assert needle in message


def test_missing_job_file(tmp_path: Path) -> None:
    with pytest.raises(JobSpecError, match="job file not found"):
        load_job(tmp_path / "absent.toml")


def test_relative_paths_resolve_against_job_file(tmp_path: Path) -> None:
    (tmp_path / "adj.csv").write_text("0,1\n1,0\n")
    path = write(tmp_path, "[data]\nnumber_of_clients = 2\n"
                           "[topology]\nkind = 'custom'\nadjacency_file = 'adj.csv'\n")
    spec = load_job(path)
    assert spec.topology.adjacency_file == str((tmp_path / "adj.csv").resolve())


def test_from_dict_rejects_non_table() -> None:
    with pytest.raises(JobSpecError, match="wire: expected a table"):
        JobSpec.from_dict([1, 2], source="wire")  # type: ignore[arg-type]


def test_docs_list_every_key() -> None:
    from dataclasses import fields

    from proto.job import _SECTIONS

    doc = (REPO / "docs" / "job.md").read_text()
    for name, cls in _SECTIONS.items():
        assert f"## `[{name}]`" in doc
        for f in fields(cls):
            assert f"`{f.name}`" in doc, f"docs/job.md does not document {name}.{f.name}"


def test_a_job_rides_through_a_lost_site_by_default() -> None:
    """on_cluster_loss defaults to continue, and --local's default capacity lets the
    survivors of one lost cluster hold every client (3 clusters, 30 clients: 15 each)."""
    from scheduler.submit import local_capacity

    assert JobSpec().faults.on_cluster_loss == "continue"
    assert local_capacity(30, 3) == 15 and local_capacity(30, 1) == 36
    for clients in (7, 30, 101):
        for clusters in (2, 3, 4, 7):
            assert (clusters - 1) * local_capacity(clients, clusters) >= clients


def test_a_job_spec_error_survives_a_trip_to_another_process() -> None:
    import pickle

    try:
        JobSpec.from_dict({"aggregation": {"name": "fedadam"}, "topology": {"kind": "ring"}})
    except JobSpecError as exc:
        back = pickle.loads(pickle.dumps(exc))  # what a process pool or Ray does with it
        assert (type(back), str(back), back.key) == (JobSpecError, str(exc), exc.key)
    else:
        raise AssertionError("fedadam on a ring was accepted")


def test_the_default_aggregator_is_fedavgm_on_every_topology() -> None:
    # decentralized too, since its scaled step's momentum is 0.5 (docs/job.md: k_connected,
    # ring and full at or above fedavg on every cell measured); a job's own name wins
    for kind in ("ring", "k_connected", "full", "custom", "star", "hierarchical", "hybrid"):
        table = {"kind": kind, "adjacency_file": "a.csv"} if kind == "custom" else {"kind": kind}
        assert JobSpec.from_dict({"topology": table}).aggregation.name == "fedavgm"
    named = JobSpec.from_dict({"topology": {"kind": "ring"}, "aggregation": {"name": "fedavg"}})
    assert named.aggregation.name == "fedavg"
    assert JobSpec.from_dict(named.to_dict()) == named


def test_fedprox_without_a_mu_takes_the_measured_default_and_a_set_one_is_kept() -> None:
    from proto.job import FEDPROX_MU

    left_out = JobSpec.from_dict({"aggregation": {"name": "fedprox"}})
    assert left_out.training.fedprox_mu == FEDPROX_MU > 0
    # the written spec names its mu, so a round trip (the scheduler's signed copy) keeps it
    assert JobSpec.from_dict(left_out.to_dict()) == left_out
    given = JobSpec.from_dict({"aggregation": {"name": "fedprox"},
                               "training": {"fedprox_mu": 0.1}})
    assert given.training.fedprox_mu == 0.1
    # another aggregator leaves the proximal term off
    assert JobSpec.from_dict({"aggregation": {"name": "fedavg"}}).training.fedprox_mu == 0.0
