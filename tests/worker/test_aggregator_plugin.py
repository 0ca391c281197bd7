"""A user aggregator from a module outside the project: named in the job, loaded by the
registry, checked against the interface, and used by a real (in-process) job."""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest

from proto.job import AggregationSpec, DataSpec, JobSpec, JobSpecError, TrainingSpec
from worker.aggregators import AggregationError, get_aggregator

# The docs/job.md example, plus one line recording each call so the test sees it used.
PLUGIN = '''
import numpy as np
from worker.aggregators import Aggregator
from worker.aggregators.base import cast_like, check_updates

CALLS = []


class UnweightedMean(Aggregator):
    """Every client counts the same, whatever its sample count."""

    name = "unweighted_mean"

    def aggregate(self, global_weights, updates):
        check_updates(global_weights, updates, self.name)
        CALLS.append(len(updates))
        mean = {k: np.mean([np.asarray(w[k], np.float64) for w, _ in updates], axis=0)
                for k in global_weights}
        return cast_like(mean, global_weights)


class NotAnAggregator:
    pass
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The module name of PLUGIN, written under tmp_path (outside the project)."""
    name = f"user_agg_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_user_aggregator_is_loaded_and_aggregates(plugin: str) -> None:
    agg = get_aggregator(AggregationSpec(name=f"{plugin}:UnweightedMean"))
    g = {"w": np.zeros(3, np.float32)}
    out = agg.aggregate(g, [({"w": np.ones(3)}, 1), ({"w": np.full(3, 3.0)}, 99)])
    np.testing.assert_allclose(out["w"], 2.0)  # fedavg would give 2.98
    assert out["w"].dtype == np.float32


def test_job_with_user_aggregator_runs_and_uses_it(plugin: str) -> None:
    import importlib

    spec = JobSpec.from_dict({
        "job": {"id": "plugin", "seed": 1},
        "data": {"number_of_clients": 4},
        "training": {"federated_learning_rounds": 2, "number_of_epochs": 1},
        "aggregation": {"name": f"{plugin}:UnweightedMean"},
    }, source="job.toml")
    assert spec.aggregation.name == f"{plugin}:UnweightedMean"
    from tests.e2e.test_one_engine import run

    result, _ = run(spec, ("solo",))
    metrics = result.summary.rounds
    assert [m.round for m in metrics] == [1, 2]
    assert all(np.isfinite(m.accuracy) for m in metrics)
    calls = importlib.import_module(plugin).CALLS
    assert calls == [4, 4]  # one server aggregation per round over the 4 clients


@pytest.mark.parametrize("name, message", [
    ("no_such_module_xyz:Agg", "cannot import module 'no_such_module_xyz'"),
    ("{plugin}:Missing", "has no attribute 'Missing'"),
    ("{plugin}:NotAnAggregator", "NotAnAggregator is not a subclass of worker.aggregators.Aggregator"),
])
def test_bad_user_aggregators_are_one_line_errors(plugin: str, name: str, message: str) -> None:
    with pytest.raises(AggregationError, match=message) as info:
        get_aggregator(AggregationSpec(name=name.format(plugin=plugin)))
    assert "\n" not in str(info.value) and "aggregation.name" in str(info.value)


def test_job_spec_accepts_class_paths_but_still_rejects_typos() -> None:
    with pytest.raises(JobSpecError, match="aggregation.name.*did you mean 'fedavg'"):
        JobSpec.from_dict({"aggregation": {"name": "fedavgg"}}, source="job.toml")
    spec = JobSpec.from_dict({"aggregation": {"name": "my.pkg:Agg"}}, source="job.toml")
    assert spec.aggregation.name == "my.pkg:Agg"
    assert DataSpec().dataset == "digits" and TrainingSpec().federated_learning_rounds > 0
