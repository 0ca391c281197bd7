"""The watch behind the progress line (scheduler/run/health.py): which keys its at-chance
note names, from the job's spec and its rounds alone."""

from __future__ import annotations

import pytest

from proto.job import JobSpec
from proto.rounds import RoundRecord
from scheduler.run.health import CHANCE_ROUNDS, LearningWatch


def _note_at_chance(data: dict[str, object], **training: object) -> str:
    spec = JobSpec.from_dict({"data": data, "training": training,
                              "aggregation": {"name": "fedavg"}})
    watch = LearningWatch(spec, classes=10)
    notes = [watch.observe(RoundRecord(r, accuracy=0.1, loss=2.31))
             for r in range(1, CHANCE_ROUNDS + 1)]
    assert all(not n for n in notes[:-1]) and notes[-1], notes
    return notes[-1]


@pytest.mark.parametrize(("data", "says"), [
    ({"data_distribution_kind": "labels", "labels_per_client": 1}, "data.labels_per_client"),
    ({"data_distribution_kind": "shards", "shards_per_client": 2}, "data.shards_per_client"),
    ({"data_distribution_kind": "dirichlet", "dirichlet_beta": 0.05}, "data.dirichlet_beta 0.05"),
])
def test_at_chance_on_a_split_of_few_labels_a_client_it_names_the_local_passes(
        data: dict[str, object], says: str) -> None:
    note = _note_at_chance(data, number_of_epochs=2)
    assert "training.learning_rate (now" in note
    assert "training.number_of_epochs (now 2;" in note and says in note, note


@pytest.mark.parametrize(("data", "training"), [
    ({"data_distribution_kind": "labels", "labels_per_client": 3}, {"number_of_epochs": 2}),
    ({"data_distribution_kind": "dirichlet", "dirichlet_beta": 0.3}, {"number_of_epochs": 2}),
    ({"data_distribution_kind": "iid"}, {"number_of_epochs": 5}),
    ({"data_distribution_kind": "labels", "labels_per_client": 1}, {"number_of_epochs": 1}),
    # a pinned job's split is the sites' own, not the job file's
    ({"placement": "pinned", "dataset": "site", "data_distribution_kind": "labels",
      "labels_per_client": 1}, {"number_of_epochs": 2}),
])
def test_otherwise_it_names_the_rates_only(data: dict[str, object],
                                           training: dict[str, object]) -> None:
    note = _note_at_chance(data, **training)
    assert "training.learning_rate (now" in note and "number_of_epochs" not in note, note
