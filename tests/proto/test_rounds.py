"""RoundRecord: combining clusters' records, and strict decoding of what a cluster sent."""

from __future__ import annotations

import pytest

from proto.errors import InvalidMessage
from proto.rounds import RoundRecord, personal_choice, personal_reply


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


def _reply(total: int, right: int, local: tuple[int, int], shifted: tuple[int, int]
           ) -> dict[str, object]:
    return {"total": total, "global": right, "local": list(local), "shifted": list(shifted)}


def test_the_final_pass_takes_a_policy_only_where_every_cluster_left_out_agrees() -> None:
    """personal_choice: a cluster's choice is the policy the *other* clusters' samples
    show better than the global model by the sign test; the policy scores the job where
    every cluster's choice is the same, or (choices differing) a policy shown for every
    cluster does, else the global model scores every cluster; one cluster alone is scored
    globally."""
    def counts(*rows: tuple[int, int, tuple[int, int], tuple[int, int]]
               ) -> dict[str, dict[str, object]]:
        out = {}
        for name, row in zip("abc", rows, strict=True):
            reply = personal_reply(_reply(*row))
            assert reply is not None
            out[name] = reply
        return out

    # local shown by the others for each of a, b, c (a: 14-1 from b + c, ...); c's own
    # samples lose with it and are scored with it all the same: the choice is not theirs
    agree = counts((100, 90, (8, 1), (2, 2)), (100, 90, (6, 0), (0, 3)),
                   (100, 90, (1, 2), (0, 0)))
    correct, total, chosen = personal_choice(agree)
    assert chosen == {"a": "local", "b": "local", "c": "local"}
    assert (correct, total) == (90 + 7 + 90 + 6 + 90 - 1, 300)
    # a: others (b, c) local 6-4 (2 <= sqrt 10), shifted 9-0 (9 > 3): shifted; b: others
    # (a, c) local 8-5 (3 <= sqrt 13), shifted 2-2: global; c: local 14-1: choices differ
    differ = counts((100, 90, (8, 1), (2, 2)), (100, 90, (6, 0), (9, 0)),
                    (100, 90, (0, 4), (0, 0)))
    assert personal_choice(differ) == (270, 300, dict.fromkeys("abc", "global"))
    # choices differ (b: shifted, a and c: local) but local is shown for every cluster by
    # the others: local scores them all (a user's BatchNorm CNN on digits; 0.604 before)
    both = counts((127, 67, (42, 17), (45, 18)), (136, 93, (23, 6), (27, 17)),
                  (22, 12, (5, 1), (6, 1)))
    assert personal_choice(both) == (67 + 25 + 93 + 17 + 12 + 4, 285,
                                     dict.fromkeys("abc", "local"))
    assert personal_choice({"a": agree["a"]}) == (90, 100, {"a": "global"})


@pytest.mark.parametrize("reply", [
    {"total": 3, "global": 5, "local": [0, 0], "shifted": [0, 0]},   # more right than held
    {"total": 10, "global": 5, "local": [6, 0], "shifted": [0, 0]},  # wins past the misses
    {"total": 10, "global": 5, "local": [0, 6], "shifted": [0, 0]},  # losses past the hits
    {"total": 10, "global": 5, "local": [0, 0]},                     # a policy missing
    {"total": 10, "global": 5, "local": [0, 0], "shifted": [True, 0]},
    {"total": 10.0, "global": 5, "local": [0, 0], "shifted": [0, 0]},
    {"total": 10, "global": 5, "local": [0, 0, 0], "shifted": [0, 0]},
    {"correct": 5, "total": 3},
])
def test_a_final_pass_reply_that_is_not_a_count_is_refused(reply: dict[str, object]) -> None:
    assert personal_reply(reply) is None
