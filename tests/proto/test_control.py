"""Typed control messages: malformed bodies are refused naming the kind and the field;
every message survives to_body -> msgpack -> parse unchanged."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from proto.control import (
    PLAN_PART_BYTES,
    PROFILE_PAGE_BYTES,
    PROFILE_REPLY,
    ControlMessage,
    JobCheckpoint,
    JobLease,
    JobModel,
    JobPlan,
    JobPlanPart,
    JobProfile,
    JobRestore,
    JobStart,
    JobStop,
    NodeExport,
    PlanAssembly,
    RoundAbort,
    RoundRun,
    client_range,
    histogram_reply,
    page_rows,
    parse_control,
    plan_parts,
    read_histograms,
)
from proto.errors import ControlMessageError, InvalidMessage
from proto.routing import RoutingMatrix


def routing(num_clients: int = 3) -> RoutingMatrix:
    star = [[c, num_clients] for c in range(num_clients)]
    return RoutingMatrix.from_edges(job_id="j", clusters=["a"],
                                    node_cluster=np.zeros(num_clients + 1, dtype=np.int64),
                                    edges=np.array(star), num_clients=num_clients,
                                    aggregators=["server"])


def over_the_wire(body: dict[str, Any]) -> dict[str, Any]:
    return dict(msgpack.unpackb(msgpack.packb(body, use_bin_type=True), raw=False))


PLAN = {"kind": "job.plan", "job_id": "j", "routing": routing().to_bytes(), "imports": []}
ROUND = {"kind": "round.run", "job_id": "j", "round": 2, "attempt": 1, "deadline": 30.0}
LEASE = {"kind": "job.lease", "job_id": "j", "lease": 15}


def refused(body: dict[str, Any]) -> ControlMessageError:
    with pytest.raises(ControlMessageError) as caught:
        parse_control(body)
    return caught.value


@pytest.mark.parametrize(("body", "field", "needle"), [
    ({**PLAN, "routing": "c1"}, "routing", "must be a routing matrix's bytes"),
    ({**PLAN, "routing": None}, "routing", "not neither"),
    ({k: v for k, v in PLAN.items() if k != "routing"}, "routing", "not neither"),
    ({**PLAN, "routing_sha256": "ab" * 32, "routing_size": 9}, "routing", "not both"),
    ({**PLAN, "routing": None, "routing_sha256": "ab" * 32}, "routing_size", "required"),
    ({**PLAN, "routing": None, "routing_sha256": "AB" * 32, "routing_size": 9},
     "routing_sha256", "does not match"),
    ({**PLAN, "routing": None, "routing_sha256": "ab" * 32, "routing_size": 1 << 40},
     "routing_size", "outside 1.."),
    ({**PLAN, "routing": b"\x81\xa1v\x09"}, "routing", "routing matrix"),
    ({**PLAN, "imports": "c1"}, "imports", "expected a list"),
    ({**PLAN, "imports": ["c1", 7]}, "imports[1]", "expected a string"),
    ({**PLAN, "next_round": -1}, "next_round", "outside 0.."),
    ({**PLAN, "client_samples": [5, 5]}, "client_samples", "must be 3 non-negative integers"),
    ({**PLAN, "client_samples": [5, -1, 5]}, "client_samples[1]", "outside 0.."),
    ({**PLAN, "client_samples": [5, True, 5]}, "client_samples[1]", "expected an integer"),
    ({**PLAN, "pooled_labels": [5, -1]}, "pooled_labels[1]", "outside 0.."),
    ({**PLAN, "pooled_labels": 7}, "pooled_labels", "expected a list"),
    ({**PLAN, "scaling_mean": [0.0, 1.0]}, "scaling_sd", "together"),
    ({**PLAN, "scaling_mean": [0.0], "scaling_sd": [1.0, 2.0]}, "scaling_sd", "one of each"),
    ({**PLAN, "scaling_mean": [0.0], "scaling_sd": [0.0]}, "scaling_sd[0]", "outside"),
    ({**PLAN, "scaling_mean": [float("nan")], "scaling_sd": [1.0]}, "scaling_mean[0]",
     "finite"),
    ({**PLAN, "learning_rate": 0.0}, "learning_rate", "outside"),
    ({**PLAN, "learning_rate": float("inf")}, "learning_rate", "finite"),
    ({**PLAN, "learning_rate": "0.1"}, "learning_rate", "expected a number"),
    ({**PLAN, "absent": [3]}, "absent", "client ids in 0..2"),
    ({**PLAN, "absent": [0.5]}, "absent[0]", "expected an integer"),
    ({**PLAN, "job_id": ""}, "job_id", "length 0"),
])
def test_a_malformed_plan_is_refused_naming_the_field(body: dict[str, Any], field: str,
                                                     needle: str) -> None:
    error = refused(body)
    assert (error.kind, error.field) == ("job.plan", field)
    assert str(error).startswith(f"job.plan: field {field!r}: ") and needle in str(error)
    assert isinstance(error, InvalidMessage)  # one hierarchy: callers may catch the base


@pytest.mark.parametrize(("body", "field", "needle"), [
    ({k: v for k, v in ROUND.items() if k != "round"}, "round", "missing"),
    ({**ROUND, "round": "2"}, "round", "expected an integer"),
    ({**ROUND, "round": 0}, "round", "outside 1.."),
    ({**ROUND, "attempt": -1}, "attempt", "outside 0.."),
    ({**ROUND, "deadline": 0}, "deadline", "seconds in (0, 86400]"),
    ({**ROUND, "deadline": 86401}, "deadline", "seconds in (0, 86400]"),
    ({**ROUND, "deadline": float("nan")}, "deadline", "seconds in (0, 86400]"),
    ({**ROUND, "deadline": True}, "deadline", "seconds in (0, 86400]"),
])
def test_a_malformed_round_is_refused_naming_the_field(body: dict[str, Any], field: str,
                                                      needle: str) -> None:
    error = refused(body)
    assert (error.kind, error.field) == ("round.run", field)
    assert needle in str(error)


@pytest.mark.parametrize(("lease", "needle"), [
    ("forever", "'forever'"), (0.5, "0.5"), (3601, "3601"), (False, "False"),
    (float("inf"), "inf"),
])
def test_a_lease_out_of_range_is_refused(lease: Any, needle: str) -> None:
    error = refused({**LEASE, "lease": lease})
    assert (error.kind, error.field) == ("job.lease", "lease")
    assert str(error) == f"job.lease: field 'lease': must be seconds in [1, 3600], got {needle}"
    assert refused({"kind": "job.lease", "job_id": "j"}).field == "lease"


@pytest.mark.parametrize(("body", "field"), [
    ({"kind": "node.export", "job_id": "j", "nodes": {"c1": "not a cluster"}}, "nodes.c1"),
    ({"kind": "node.export", "job_id": "j", "nodes": ["c1"]}, "nodes"),
    ({"kind": "job.checkpoint", "job_id": "j", "round": 2}, "to_cluster"),
    ({"kind": "job.restore", "job_id": "j", "phase": "expect", "nodes": ["c1"]},
     "source_cluster"),
    ({"kind": "job.restore", "job_id": "j", "phase": "undo"}, "phase"),
    ({"kind": "job.score", "job_id": "j", "phase": "expect", "round": 3}, "source_cluster"),
    ({"kind": "job.score", "job_id": "j", "phase": "apply"}, "round"),
    ({"kind": "job.score", "job_id": "j", "phase": "undo", "round": 3}, "phase"),
    ({"kind": "job.restore", "job_id": "j", "phase": "apply", "codec": 1}, "codec"),
    ({"kind": "job.model", "job_id": "j", "node": "server"}, "to_cluster"),
    ({"kind": "job.model", "job_id": "j", "collect": "c1", "to_cluster": "a"}, "collect"),
    ({"kind": "round.abort", "job_id": "j", "round": 1, "reason": 7}, "reason"),
    ({"kind": "job.start", "job_id": "j", "job": [], "clients": []}, "job"),
    ({"kind": "job.start", "job_id": "j", "job": {}, "clients": [-1]}, "clients[0]"),
    ({"kind": "job.stop"}, "job_id"),
    ({"kind": "job.launch", "job_id": "j"}, "kind"),
    ({"job_id": "j"}, "kind"),
])
def test_every_kind_refuses_what_it_cannot_use(body: dict[str, Any], field: str) -> None:
    assert refused(body).field == field


def test_unknown_kinds_are_named_with_the_known_ones() -> None:
    assert "unknown control message kind 'job.launch' (known: job.checkpoint, job.lease" in \
        str(refused({"kind": "job.launch", "job_id": "j"}))


def test_unknown_keys_are_ignored_and_optional_ones_take_their_defaults() -> None:
    message = parse_control({**PLAN, "from_the_future": {"x": 1}})
    assert isinstance(message, JobPlan)
    assert (message.imports, message.next_round, message.client_samples, message.absent) == \
        ((), 1, None, ())
    assert "from_the_future" not in message.to_body()
    run = parse_control({"kind": "round.run", "job_id": "j", "round": 1})
    assert run == RoundRun("j", round=1, attempt=0, deadline=None)


MESSAGES: list[ControlMessage] = [
    JobStart("j", job={"job": {"id": "j"}}, clients=(0, 2)),
    JobPlan("j", routing=routing(), imports=("c1",), next_round=4, client_samples=(5, 0, 7),
            absent=(1,)),
    JobPlan("j", routing=routing()),
    RoundRun("j", round=3, attempt=2, deadline=12.5),
    RoundRun("j", round=1),
    RoundAbort("j", round=3, reason="cluster b is gone"),
    JobLease("j", lease=15),
    JobStop("j"),
    NodeExport("j", nodes={"c1": "b"}, epoch=2),
    JobModel("j", node="server", to_cluster="scheduler"),
    JobModel("j", share_to="a"),
    JobModel("j", collect=("c0", "c3"), to_cluster="scheduler"),
    JobCheckpoint("j", round=4, to_cluster="scheduler"),
    JobRestore("j", phase="expect", source_cluster="scheduler", nodes=("c1", "server")),
    JobRestore("j", phase="apply", codec=True),
    JobPlan("j", routing_sha256="ab" * 32, routing_size=9, next_round=2),
    JobPlan("j", routing=routing(), privacy_keys={"a": bytes(32), "b": b"k" * 32}),
    JobPlanPart("j", digest="cd" * 32, index=1, count=2, size=PLAN_PART_BYTES + 5,
                data=b"12345"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m.TYPE)
def test_to_body_and_parse_round_trip_over_msgpack(message: ControlMessage) -> None:
    body = message.to_body()
    assert body["kind"] == message.TYPE and body["job_id"] == "j"
    assert None not in body.values()  # an unset optional field is left out
    again = parse_control(over_the_wire(body))
    assert again == message
    assert again.to_body() == body


def test_bodies_keep_the_keys_older_executors_read() -> None:
    plan = JobPlan("j", routing=routing(), imports=("c1",), next_round=2).to_body()
    assert plan["routing"] == routing().to_bytes()
    assert set(plan) == {"kind", "job_id", "routing", "imports", "next_round", "absent"}
    assert RoundRun("j", round=3, deadline=60.0).to_body() == {
        "kind": "round.run", "job_id": "j", "round": 3, "attempt": 0, "deadline": 60.0}
    assert JobLease("j", lease=15).to_body() == {"kind": "job.lease", "job_id": "j",
                                                 "lease": 15}


def test_the_scheduler_cannot_build_a_malformed_message() -> None:
    with pytest.raises(ControlMessageError, match=r"round.run: field 'deadline'"):
        RoundRun("j", round=1, deadline=-3.0)
    with pytest.raises(ControlMessageError, match=r"job.plan: field 'client_samples'"):
        JobPlan("j", routing=routing(), client_samples=(1, 2))


def large_routing(num_clients: int = 150_000) -> RoutingMatrix:
    """A star over two clusters whose bytes (~26 a client) are over one part."""
    star = np.stack([np.arange(num_clients), np.full(num_clients, num_clients)], axis=1)
    return RoutingMatrix.from_edges(job_id="j", clusters=["a", "b"],
                                    node_cluster=np.arange(num_clients + 1) % 2, edges=star,
                                    num_clients=num_clients, aggregators=["server"],
                                    kind="star",
                                    parent=np.r_[np.full(num_clients, num_clients), -1])


def assembled(parts: list[JobPlanPart]) -> PlanAssembly:
    held = PlanAssembly()
    for part in parts:  # each as the executor gets it: a body parsed from msgpack
        again = parse_control(over_the_wire(part.to_body()))
        assert isinstance(again, JobPlanPart)
        held.add(again)
    return held


def test_a_large_plan_travels_in_parts_named_by_its_digest() -> None:
    matrix = large_routing()
    data = matrix.to_bytes()
    parts, digest = plan_parts("j", data)
    assert len(data) > PLAN_PART_BYTES and len(parts) == -(-len(data) // PLAN_PART_BYTES)
    assert all(len(msgpack.packb(p.to_body(), use_bin_type=True)) < 4 * 1024 * 1024
               for p in parts)
    body = JobPlan("j", routing_sha256=digest, routing_size=len(data), next_round=3).to_body()
    assert "routing" not in body and len(msgpack.packb(body, use_bin_type=True)) < 512
    plan = parse_control(over_the_wire(body))
    assert isinstance(plan, JobPlan) and plan.routing is None
    whole = plan.with_routing(assembled(parts))
    assert whole.routing == matrix and whole.next_round == 3
    assert whole.routing_sha256 is None  # the matrix is inline now


def test_a_plan_whose_parts_do_not_match_the_signed_digest_is_refused() -> None:
    data = large_routing().to_bytes()
    parts, digest = plan_parts("j", data)
    plan = JobPlan("j", routing_sha256=digest, routing_size=len(data))
    last = parts[-1]
    flipped = bytes([last.data[0] ^ 1]) + last.data[1:]  # same place, other bytes
    forged = JobPlanPart("j", digest=digest, index=last.index, count=last.count,
                         size=last.size, data=flipped)
    with pytest.raises(ControlMessageError, match=r"job.plan: field 'routing_sha256': the "
                       r"plan's parts are \d+ bytes with sha256 [0-9a-f]{64}, not the signed"
                       ) as caught:
        plan.with_routing(assembled([*parts[:-1], forged]))
    assert caught.value.field == "routing_sha256"
    with pytest.raises(ControlMessageError, match=r"field 'routing_sha256': parts \[0\] of plan"):
        plan.with_routing(assembled(parts[1:]))
    # a part of another plan drops what was held: nothing mixes two plans
    other, _ = plan_parts("j", large_routing(150_001).to_bytes())
    with pytest.raises(ControlMessageError, match=r"parts \[0, 1\] of plan"):
        plan.with_routing(assembled([*parts, other[0]]))
    assert plan.with_routing(assembled(parts)).routing is not None


@pytest.mark.parametrize(("change", "field", "needle"), [
    ({"count": 3}, "count", "make 2 parts"),
    ({"index": 2, "count": 2}, "index", "must be in 0..1"),
    ({"data": b"123"}, "data", "holds 5 bytes, got 3"),
    ({"digest": "xy" * 32}, "digest", "does not match"),
    ({"size": 0}, "size", "outside 1.."),
])
def test_a_malformed_plan_part_is_refused_naming_the_field(change: dict[str, Any], field: str,
                                                          needle: str) -> None:
    body = {**JobPlanPart("j", digest="cd" * 32, index=1, count=2, size=PLAN_PART_BYTES + 5,
                          data=b"12345").to_body(), **change}
    error = refused(body)
    assert (error.kind, error.field) == ("job.plan.part", field) and needle in str(error)


@pytest.mark.parametrize(("top", "dtype"), [(0, "<u1"), (255, "<u1"), (256, "<u2"),
                                            (70_000, "<u4"), (2**40, "<u8")])
def test_histograms_travel_as_one_array_of_the_smallest_dtype(top: int, dtype: str) -> None:
    rows = np.random.default_rng(0).integers(0, 3, (1000, 10))
    rows[7, 3] = top
    reply = over_the_wire(histogram_reply(rows))
    assert reply["histogram_dtype"] == dtype and reply["histogram_shape"] == [1000, 10]
    assert np.array_equal(read_histograms(reply, 1000), rows)
    # a light client's row costs its labels' bytes, not a map entry of ten ints
    assert len(msgpack.packb(reply, use_bin_type=True)) < 1000 * 10 * np.dtype(dtype).itemsize + 96


def test_no_clients_no_rows() -> None:
    assert read_histograms(over_the_wire(histogram_reply(np.zeros((0, 10)))), 0).shape == (0, 10)


@pytest.mark.parametrize(("change", "field"), [
    ({"histogram_dtype": "<f8"}, "histogram_dtype"),
    ({"histogram_dtype": "|O"}, "histogram_dtype"),
    ({"histogram_shape": [4, 10]}, "histogram_shape"),   # a row per client asked: 3
    ({"histogram_shape": [3, -1]}, "histogram_shape"),
    ({"histogram_shape": [3, True]}, "histogram_shape"),
    ({"histogram_shape": "3x10"}, "histogram_shape"),
    ({"histogram_counts": b"\x00" * 29}, "histogram_counts"),
    ({"histogram_counts": [0] * 30}, "histogram_counts"),
])
def test_a_malformed_histogram_reply_is_refused_naming_the_field(change: dict[str, Any],
                                                                 field: str) -> None:
    reply = {**histogram_reply(np.ones((3, 10), dtype=np.int64)), **change}
    with pytest.raises(ControlMessageError) as caught:
        read_histograms(reply, 3)
    assert (caught.value.kind, caught.value.field) == ("job.start reply", field)
    assert str(caught.value).startswith(f"job.start reply: field {field!r}: ")


def test_a_million_clients_start_in_a_few_bytes_as_a_range() -> None:
    clients = list(range(1, 1_000_000, 2))
    span = client_range(clients)
    assert span == (1, 1_000_000, 2)
    body = over_the_wire(JobStart("j", job={}, client_range=span, histogram_bytes=4096).to_body())
    message = parse_control(body)
    assert isinstance(message, JobStart) and list(message.client_ids()) == clients
    assert message.histogram_bytes == 4096 and message.clients == ()
    assert len(msgpack.packb(body, use_bin_type=True)) < 128
    # a list stays a list, and a message without the new fields reads as before
    listed = parse_control({"kind": "job.start", "job_id": "j", "job": {}, "clients": [4, 2]})
    assert isinstance(listed, JobStart) and list(listed.client_ids()) == [4, 2]
    assert listed.histogram_bytes == PROFILE_PAGE_BYTES


@pytest.mark.parametrize(("clients", "span"), [
    ([], None), ([7], (7, 8, 1)), ([0, 3, 6, 9], (0, 10, 3)), ([2, 1], None),
    ([0, 1, 3], None), ([5, 5], None)])
def test_client_range_is_exactly_the_list(clients: list[int], span: Any) -> None:
    assert client_range(clients) == span
    if span is not None:
        assert list(range(*span)) == clients


@pytest.mark.parametrize(("change", "field", "needle"), [
    ({"clients": [1], "client_range": [0, 4, 1]}, "client_range", "not both"),
    ({"client_range": [5, 3, 1]}, "client_range", "start <= stop"),
    ({"client_range": [0, 9, 0]}, "client_range", "step >= 1"),
    ({"client_range": [0, 9]}, "client_range", "outside 3..3"),
    ({"client_range": [0, 2**40, 1]}, "client_range[1]", "outside"),
    ({"client_range": "0:9"}, "client_range", "expected a list"),
    ({"histogram_bytes": 0}, "histogram_bytes", "outside 1.."),
    ({"histogram_bytes": PROFILE_PAGE_BYTES + 1}, "histogram_bytes", "outside 1.."),
])
def test_a_malformed_job_start_is_refused_naming_the_field(change: dict[str, Any], field: str,
                                                           needle: str) -> None:
    error = refused({"kind": "job.start", "job_id": "j", "job": {}, **change})
    assert (error.kind, error.field) == ("job.start", field) and needle in str(error)


def test_a_profile_request_round_trips() -> None:
    message = JobProfile("j", offset=300_000, count=1000)
    assert parse_control(over_the_wire(message.to_body())) == message


@pytest.mark.parametrize(("change", "field"), [
    ({"offset": -1}, "offset"), ({"offset": "0"}, "offset"), ({"offset": None}, "offset"),
    ({"count": 0}, "count"), ({"count": PROFILE_PAGE_BYTES + 1}, "count"),
    ({"count": 2.5}, "count"), ({"job_id": ""}, "job_id")])
def test_a_malformed_profile_request_is_refused_naming_the_field(change: dict[str, Any],
                                                                 field: str) -> None:
    error = refused({**JobProfile("j", offset=0, count=10).to_body(), **change})
    assert (error.kind, error.field) == ("job.profile", field)
    body = {k: v for k, v in JobProfile("j", offset=0, count=10).to_body().items() if k != field}
    if field in ("offset", "count"):
        assert refused(body).field == field  # missing


@pytest.mark.parametrize(("labels", "dtype", "rows"), [
    (10, "<u1", PROFILE_PAGE_BYTES // 10), (10, "<u8", PROFILE_PAGE_BYTES // 80),
    (0, "<u1", PROFILE_PAGE_BYTES), (1 << 16, "<u8", 6)])
def test_a_page_holds_what_fits_and_at_least_a_row(labels: int, dtype: str, rows: int) -> None:
    assert page_rows(PROFILE_PAGE_BYTES, labels, dtype) == rows
    assert page_rows(1, labels, dtype) == 1


@pytest.mark.parametrize(("reply", "field"), [
    (histogram_reply(np.ones((4, 10), dtype=np.int64), "<u2"), "histogram_dtype"),
    (histogram_reply(np.ones((5, 10), dtype=np.int64), "<u1"), "histogram_shape"),
    (histogram_reply(np.ones((4, 9), dtype=np.int64), "<u1"), "histogram_shape"),
])
def test_a_page_not_as_asked_is_refused_naming_the_field(reply: dict[str, Any],
                                                         field: str) -> None:
    good = histogram_reply(np.ones((4, 10), dtype=np.int64), "<u1")
    assert read_histograms(good, 4, dtype="<u1", labels=10, what=PROFILE_REPLY).shape == (4, 10)
    with pytest.raises(ControlMessageError) as caught:
        read_histograms(over_the_wire(reply), 4, dtype="<u1", labels=10, what=PROFILE_REPLY)
    assert (caught.value.kind, caught.value.field) == ("job.profile reply", field)


def test_a_page_keeps_the_dtype_of_the_whole_cluster() -> None:
    assert histogram_reply(np.ones((2, 3), dtype=np.int64), "<u4")["histogram_dtype"] == "<u4"
    with pytest.raises(ValueError, match="does not hold"):
        histogram_reply(np.full((2, 3), 300, dtype=np.int64), "<u1")
