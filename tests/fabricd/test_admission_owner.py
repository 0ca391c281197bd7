"""Update admission: the job's own scheduler may stream checkpointed states back to its
executors (no node of the matrix lives on its cluster); nobody else may claim its nodes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from fabricd.admission import Placements
from proto.messages import UpdateHeader
from proto.routing import RoutingMatrix


def header(source: str, target: str) -> UpdateHeader:
    return UpdateHeader(job_id="j", round=0, source_node=source, target_node=target,
                        message_id=f"j/0/restore-1/{source}/{target}", tensor_count=1,
                        byte_length=8, sha256=b"\0" * 32)


def star_ab() -> RoutingMatrix:
    """c0 on a; c1 and the server on b."""
    return RoutingMatrix.from_edges(
        job_id="j", clusters=["a", "b"], node_cluster=np.array([0, 1, 1]),
        edges=np.array([[0, 2], [1, 2]]), num_clients=2, aggregators=["server"], kind="star",
        parent=np.array([2, 2, -1]))


def test_the_owning_scheduler_may_restore_and_others_may_not() -> None:
    matrix = star_ab()
    placements = Placements()
    placements.learn("j", matrix.to_bytes(), owner="sched")
    assert placements.refusal(header("server", "restore"), "sched") is None
    refused = placements.refusal(header("server", "restore"), "a")  # a member posing
    assert refused is not None and "places it on cluster 'b'" in refused
    assert placements.refusal(header("server", "c0"), "b") is None  # the genuine sender
    placements.forget("j")
    placements.learn("j", matrix.to_bytes())  # a plan without an owner: no exemption
    assert placements.refusal(header("server", "restore"), "sched") is not None


def test_a_repeated_rounds_attempt_suffix_still_names_source_and_target() -> None:
    matrix = star_ab()
    placements = Placements()
    placements.learn("j", matrix.to_bytes(), owner="sched")
    again = replace(header("server", "c0"), message_id="j/4/down/server/c0~1")
    assert placements.refusal(again, "b") is None
    forged = replace(header("server", "c0"), message_id="j/4/down/server/c1~1")
    assert "does not name" in (placements.refusal(forged, "b") or "")


def test_a_schedulers_daemon_takes_a_jobs_models_only_from_the_clusters_it_planned() -> None:
    placements = Placements()
    final = UpdateHeader(job_id="j", round=0, source_node="server", target_node="scheduler",
                         message_id="j/0/final/server/scheduler", tensor_count=1, byte_length=8,
                         sha256=b"\0" * 32)
    assert placements.refusal(final, "intruder") is None  # no plan sent from here: not its scheduler
    placements.sent("j", star_ab().to_bytes())
    assert placements.refusal(final, "b") is None  # the root aggregator's cluster
    assert placements.refusal(replace(final, source_node="consensus"), "a") is None  # a collector
    refused = placements.refusal(final, "intruder")
    assert refused is not None and "not one of the clusters of job 'j' (a, b" in refused
    # a cluster of the job may send only its own nodes' models
    refused = placements.refusal(final, "a")
    assert refused is not None and "claims node 'server'" in refused and "place it on b" in refused
    state = replace(final, source_node="c0", target_node="checkpoint",
                    message_id="j/2/state/c0/checkpoint")
    assert placements.refusal(state, "a") is None
    assert placements.refusal(state, "b") is not None
    assert placements.refusal(state, "intruder") is not None
    assert "do not name it" in (placements.refusal(replace(state, source_node="c9"), "a") or "")
    # after a re-plan that moves c0 to b, a checkpoint of either placement is taken
    moved = RoutingMatrix.from_edges(
        job_id="j", clusters=["a", "b"], node_cluster=np.array([1, 1, 1]),
        edges=np.array([[0, 2], [1, 2]]), num_clients=2, aggregators=["server"], kind="star",
        parent=np.array([2, 2, -1]), epoch=1)
    placements.sent("j", moved.to_bytes())
    assert placements.refusal(state, "b") is None and placements.refusal(state, "a") is None
    placements.sent("j", b"not a routing matrix")  # unreadable: the clusters already known stay
    assert placements.refusal(final, "intruder") is not None
    placements.forget("j")
    assert placements.refusal(final, "intruder") is None
