"""The watch behind the progress line (scheduler/run/health.py): which keys its at-chance
note names, from the job's spec and its rounds alone."""

from __future__ import annotations

import pytest

from proto.job import JobSpec
from proto.rounds import CHANCE_MARGIN, RoundRecord
from scheduler.run.health import CHANCE_ROUNDS, LearningWatch, chance_level


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


def _notes(accuracies: list[float], classes: int, labels: list[int] | None) -> list[str]:
    spec = JobSpec.from_dict({"aggregation": {"name": "fedavg"}})
    watch = LearningWatch(spec, classes=classes, labels=labels)
    return [watch.observe(RoundRecord(r, accuracy=a, loss=0.3))
            for r, a in enumerate(accuracies, 1)]


def test_on_data_of_one_label_mostly_a_model_that_always_says_it_is_at_chance() -> None:
    """90% of the clients' samples one label: a model stuck at 0.90 learned nothing but
    that share; 1 / classes (0.50) alone never warned."""
    stuck = [0.9] * CHANCE_ROUNDS
    notes = _notes(stuck, 2, [900, 100])
    assert all(not n for n in notes[:-1]) and notes[-1], notes
    assert "most common label (0.90, label 0" in notes[-1], notes[-1]
    assert not _notes(stuck, 2, None)[-1]   # without the counts: 1 / classes, as before


def test_above_the_majority_share_by_a_share_of_what_is_left_it_learns() -> None:
    """The margin narrows with what is left to learn above the majority: at 90% of one
    label, 0.93 is a model that learned (a third of the errors gone), 0.90-0.905 is not."""
    assert chance_level(2, [900, 100]) == pytest.approx((0.9, 0.01, 0))
    assert not any(_notes([0.93] * (CHANCE_ROUNDS + 2), 2, [900, 100]))
    assert _notes([0.905] * CHANCE_ROUNDS, 2, [900, 100])[-1]


@pytest.mark.parametrize("labels", [[100] * 10, [0] * 10, [], [5, 5, 5], [-3] * 10])
def test_balanced_unknown_or_malformed_counts_keep_one_over_classes(labels: list[int]) -> None:
    assert chance_level(10, labels) == (0.1, CHANCE_MARGIN, None)
    note = _notes([0.12] * CHANCE_ROUNDS, 10, labels)[-1]
    assert "accuracy at chance (0.10) for 5 rounds" in note, note
