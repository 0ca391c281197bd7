"""One log style for every process: key=value by default, JSON with --log-format json;
libp2p quieted; the worker's and scheduler's `event=NAME k=v` messages come out alike."""

from __future__ import annotations

import json
import logging
import os

import pytest

from fedcore.logs import LOG_FORMAT_ENV, get_logger, setup_logging


def test_key_value_and_json_lines(capsys, monkeypatch) -> None:
    monkeypatch.delenv(LOG_FORMAT_ENV, raising=False)  # setup_logging hands it to children
    log = get_logger("fabricd.test")
    setup_logging("kv")
    log.warning("member.rejected", peer="12D3Koo", reason="not a member: foreign CA")
    line = capsys.readouterr().err.strip()
    assert "\n" not in line
    assert 'event=member.rejected peer=12D3Koo reason="not a member: foreign CA"' in line
    setup_logging("json")
    log.info("update.received", job="j1", bytes=42)
    data = json.loads(capsys.readouterr().err.strip())
    assert data["event"] == "update.received" and data["job"] == "j1" and data["bytes"] == 42
    logging.getLogger("libp2p.host").error("noisy library line")
    assert capsys.readouterr().err == ""
    _drop_ours()


def test_records_go_to_the_stderr_of_the_moment_not_a_closed_one(monkeypatch) -> None:
    """A thread that logs after sys.stderr was swapped (a test's capture closed, a daemon
    redirecting it) writes to the stderr of the moment: before, each record raised
    "I/O operation on closed file" inside logging and was lost."""
    import io

    monkeypatch.delenv(LOG_FORMAT_ENV, raising=False)
    first = io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    setup_logging("kv")
    first.close()
    second = io.StringIO()
    monkeypatch.setattr("sys.stderr", second)
    errors: list[BaseException] = []
    monkeypatch.setattr(logging.Handler, "handleError", lambda self, record: errors.append(
        RuntimeError(record.getMessage())))
    logging.getLogger("fedpilot.leases").warning("event=cluster_lost cluster=%s", "c1")
    _drop_ours()
    assert not errors and "event=cluster_lost cluster=c1" in second.getvalue()


def _drop_ours() -> None:
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() == "fedpilot-stderr"]:
        root.removeHandler(handler)


def test_event_messages_of_the_worker_and_scheduler_come_out_alike(capsys, monkeypatch) -> None:
    monkeypatch.delenv(LOG_FORMAT_ENV, raising=False)
    log = logging.getLogger("fedpilot.executor")
    reason = 'cluster "b" has no executor = 1'
    setup_logging("kv")
    log.warning("event=send_retry message=%s attempt=%d reason=%s", "m1", 2, reason)
    line = capsys.readouterr().err.strip()
    assert f"logger=fedpilot.executor event=send_retry message=m1 attempt=2 reason={reason}" in line
    setup_logging("json")
    log.warning("event=send_retry message=%s attempt=%d reason=%s", "m1", 2, reason)
    log.info('not an event line: "quoted"')
    log.info("event=round_done round=%d seconds=%.2f node=%r ok=%s kind=peer", 3, 1.234,
             "c1", True)
    log.info("event=odd some words without=%s keys", "x")
    first, second, third, fourth = (json.loads(x)
                                    for x in capsys.readouterr().err.strip().splitlines())
    # each key of the format is a field of its own, its value the call's argument, even
    # one with spaces, quotes and '=' in it
    assert first["event"] == "send_retry" and first["level"] == "warning"
    assert (first["message"], first["attempt"], first["reason"]) == ("m1", 2, reason)
    assert "detail" not in first
    assert second["event"] == 'not an event line: "quoted"' and "detail" not in second
    assert (third["round"], third["seconds"], third["node"], third["ok"], third["kind"]) == (
        3, 1.23, "'c1'", True, "peer")
    # a format that is not key=value tokens keeps its text
    assert fourth["event"] == "odd" and fourth["detail"] == "some words without=x keys"
    # the processes this one starts log the same way (fabricd -> its executors)
    assert os.environ[LOG_FORMAT_ENV] == "json"
    _drop_ours()


def test_the_scheduler_and_the_executor_take_the_same_formats(monkeypatch) -> None:
    from scheduler.cli import build_parser
    from worker.executor.__main__ import parse_args

    monkeypatch.setenv(LOG_FORMAT_ENV, "json")
    required = ["--bridge", "b.sock", "--cluster-id", "a", "--job", "j"]
    assert parse_args(required).log_format == "json"  # the daemon's, by default
    assert parse_args([*required, "--log-format", "kv"]).log_format == "kv"
    args = build_parser().parse_args(["--log-format", "json", "plan", "job.toml"])
    assert args.log_format == "json"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--log-format", "xml", "plan", "job.toml"])
    with pytest.raises(ValueError, match="log format 'xml'"):
        setup_logging("xml")
