"""One log style for every process (fabricd, the scheduler, executors): one line per
event, ``key=value`` by default, JSON with ``--log-format json``.

Call sites log an event name plus fields::

    log = get_logger(__name__)
    log.info("member.rejected", peer=peer_id, reason=reason)

A plain logging call whose message is already ``event=NAME key=value ...`` (the worker's
and scheduler's style) comes out the same way: as it is in ``key=value``, and in JSON as
``event`` = NAME with each ``key`` a field of its own, its value the call's argument
(``log.info("event=sent peer=%s bytes=%d", p, n)`` gives ``"peer": p, "bytes": n``). The
fields are read off the format string, never parsed out of the formatted text (a value
may hold spaces and ``=``); a message whose format does not split into ``key=%x`` /
``key=literal`` tokens keeps its text under ``detail``. Any other message is the event. A process
that sets up logging also hands its format to the processes it starts (an executor
started by fabricd logs like its daemon) through ``FEDPILOT_LOG_FORMAT``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from typing import Any

_NOISY_LIBRARIES = ("libp2p", "multiaddr", "async_service", "trio_websocket", "aioquic")
#: ``kv`` (``text`` is the same) or ``json``
LOG_FORMATS = ("kv", "text", "json")
#: the format a process started by one that set up logging uses by default
LOG_FORMAT_ENV = "FEDPILOT_LOG_FORMAT"
_HANDLER_NAME = "fedpilot-stderr"


class EventLogger:
    """A thin wrapper that turns ``log.info("event", k=v)`` into one structured record."""

    def __init__(self, name: str) -> None:
        self._logger = logging.getLogger(name)

    def _log(self, level: int, event: str, fields: dict[str, Any]) -> None:
        if self._logger.isEnabledFor(level):
            self._logger.log(level, event, extra={"fields": fields})

    def debug(self, event: str, **fields: Any) -> None:
        self._log(logging.DEBUG, event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log(logging.INFO, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log(logging.WARNING, event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._log(logging.ERROR, event, fields)


def get_logger(name: str) -> EventLogger:
    return EventLogger(name)


def _quote(value: Any) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' "=\n\t'):
        return json.dumps(text)
    return text


def _event(record: logging.LogRecord) -> tuple[str, str]:
    """(event name, the rest) of a record; the rest is non-empty only for a message
    written as ``event=NAME key=value ...``."""
    message = record.getMessage()
    if not getattr(record, "fields", None) and message.startswith("event="):
        name, _, rest = message[len("event="):].partition(" ")
        return name, rest.strip()
    return message, ""


#: one ``key=value`` token of an ``event=NAME ...`` format string: one conversion, or a literal
_TOKEN = re.compile(r"([A-Za-z_][\w.-]*)=(?:(%[-#0 +]*\d*(?:\.\d+)?[sdifgerxo])|([^%\s]*))")
#: what a record's own keys are called in JSON (an event field of that name stays in detail)
_RESERVED = frozenset({"ts", "level", "logger", "event", "detail", "exc"})


def _format_fields(record: logging.LogRecord) -> dict[str, Any] | None:
    """The fields of a printf-style ``event=NAME key=%s ...`` record, each the call's own
    argument (numbers stay numbers); None when the format is not such a list."""
    fmt, args = record.msg, record.args
    if not isinstance(fmt, str) or getattr(record, "fields", None) or isinstance(args, dict):
        return None
    args = tuple(args or ())
    tokens = fmt.split(" ")
    if not tokens[0].startswith("event=") or "%" in tokens[0]:
        return None
    fields: dict[str, Any] = {}
    used = 0
    for token in tokens[1:]:
        match = _TOKEN.fullmatch(token)
        if match is None or match[1] in _RESERVED or match[1] in fields:
            return None
        key, spec, literal = match.groups()
        if spec is None:
            fields[key] = literal
            continue
        if used >= len(args):
            return None
        arg, used = args[used], used + 1
        try:
            text = spec % (arg,)
            kind = spec[-1]
            fields[key] = (int(text) if kind in "di"
                           else float(text) if kind in "fge"
                           else arg if kind == "s" and isinstance(arg, (int, float, bool, type(None)))
                           else text)
        except (TypeError, ValueError):
            return None
    return fields if used == len(args) else None


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        event, rest = _event(record)
        parts = [
            f"ts={ts}.{int(record.msecs):03d}Z",
            f"level={record.levelname.lower()}",
            f"logger={record.name}",
            f"event={_quote(event)}",
            *([rest] if rest else []),
        ]
        for key, value in getattr(record, "fields", {}).items():
            parts.append(f"{key}={_quote(value)}")
        if record.exc_info:
            parts.append(f"exc={_quote(self.formatException(record.exc_info))}")
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        event, rest = _event(record)
        data: dict[str, Any] = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": event,
        }
        if rest:
            split = _format_fields(record)
            if split is None:
                data["detail"] = rest
            else:
                data.update(split)
        for key, value in getattr(record, "fields", {}).items():
            data[key] = value if isinstance(value, (int, float, bool, type(None))) else str(value)
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, sort_keys=False)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is when a record comes, not the stream it was when
    logging was set up: a process that swaps its stderr (a test runner's capture, a
    daemon redirecting it) must not leave a thread logging into a closed file."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def setup_logging(log_format: str = "kv", level: str = "info") -> None:
    """Route every log record to stderr, one line each; quiet third-party libraries; the
    processes this one starts inherit the format."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r}: expected one of {', '.join(LOG_FORMATS)}")
    os.environ[LOG_FORMAT_ENV] = log_format
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else KeyValueFormatter())
    handler.set_name(_HANDLER_NAME)
    root = logging.getLogger()
    for old in list(root.handlers):  # a second call replaces the first's handler only
        if old.get_name() == _HANDLER_NAME:
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    for name in _NOISY_LIBRARIES:
        logging.getLogger(name).setLevel(logging.CRITICAL)
