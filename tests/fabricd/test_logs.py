"""One line per event: key=value by default, JSON with --log-format json; libp2p quieted."""

from __future__ import annotations

import json
import logging

from fabricd.logs import get_logger, setup_logging


def test_key_value_and_json_lines(capsys) -> None:
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
    logging.getLogger().handlers.clear()
