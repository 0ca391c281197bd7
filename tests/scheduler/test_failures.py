"""Errors that several clusters report identically are reported once, naming them all."""

from __future__ import annotations

from scheduler.run.driver import merge_failures


def test_identical_refusals_are_one_line_naming_every_cluster() -> None:
    text = merge_failures({
        "site-b": "cluster site-b refused job.start: module 'labs.net' is outside "
                  "[allow] models of site-b's cluster.toml",
        "site-a": "cluster site-a refused job.start: module 'labs.net' is outside "
                  "[allow] models of site-a's cluster.toml",
        "site-c": "cluster site-c did not answer job.start within 60 s"})
    assert text == ("clusters site-a, site-b refused job.start: module 'labs.net' is outside "
                    "[allow] models of site-a, site-b's cluster.toml; "
                    "cluster site-c did not answer job.start within 60 s")


def test_different_failures_stay_apart_and_names_inside_words_are_left_alone() -> None:
    failures = {"a": "cluster a refused round.run: a bad round",
                "b": "cluster b refused round.run: the mailbox is closed"}
    assert merge_failures(failures) == "; ".join(failures[c] for c in ("a", "b"))
    # "b" in "job.start" is not the cluster's name
    same = {c: f"cluster {c} refused job.start: bad label 10 in data.npz" for c in ("a", "b")}
    assert merge_failures(same) == "clusters a, b refused job.start: bad label 10 in data.npz"
