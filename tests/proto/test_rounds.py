"""RoundRecord: combining clusters' records, and strict decoding of what a cluster sent."""

from __future__ import annotations

import pytest

from proto.errors import InvalidMessage
from proto.rounds import RoundRecord


def test_combine_weighs_accuracy_by_evaluated_samples_and_sums_the_rest() -> None:
    a = RoundRecord(3, participants=2, bytes_inter=10)
    a.add_evaluation(0.5, 1.0, 10)
    a.add_personal(3, 4)
    b = RoundRecord(3, participants=1, bytes_inter=5)
    b.add_evaluation(1.0, 3.0, 30)
    b.add_personal(1, 4)
    job = RoundRecord.combine(3, {"b": RoundRecord.from_dict(b.to_dict()), "a": a}, 2.0)
    assert job.accuracy == pytest.approx((0.5 * 10 + 1.0 * 30) / 40)
    assert job.loss == pytest.approx((1.0 * 10 + 3.0 * 30) / 40)
    assert job.personalized_accuracy == pytest.approx(4 / 8)
    assert (job.participants, job.bytes_inter, job.seconds) == (3, 15, 2.0)
    assert job.by_cluster["a"] == {"bytes_inter": 10, "bytes_intra": 0, "participants": 2}


@pytest.mark.parametrize(("data", "needle"), [
    ([1, 2], "must be a map"),
    ({"accuracy": 0.5}, "names no round"),
    ({"round": 1, "participants": -1}, "participants"),
    ({"round": 1, "bytes_inter": True}, "bytes_inter"),
    ({"round": 1, "accuracy": "high"}, "accuracy"),
    ({"round": 1, "by_cluster": {"a": {"x": "y"}}}, "by_cluster"),
    ({"round": 1, "pickle": 1}, "unknown fields"),
])
def test_a_bad_report_is_refused_naming_the_field(data: object, needle: str) -> None:
    with pytest.raises(InvalidMessage, match=needle):
        RoundRecord.from_dict(data, source="cluster a's round report")
