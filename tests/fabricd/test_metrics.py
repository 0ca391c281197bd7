"""fabricd's Prometheus endpoint: real daemons, a real probe, a real scrape, parsed."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fabricd.config import ConfigError, load_config
from fabricd.metrics import membership_reason, parse_endpoint, update_reason
from tests.fabricd._harness import (
    Node,
    bridge_status,
    connected_fast,
    init_ca,
    init_node,
    wait_until,
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "observability.md"


def scrape(node: Node) -> Samples:
    endpoint = bridge_status(node)["metrics_endpoint"]
    assert endpoint, "the daemon reports no metrics endpoint"
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def metrics_on(text: str, endpoint: str = "127.0.0.1:0") -> str:
    """A cluster.toml's text with its metrics endpoint set."""
    return re.sub(r'\[metrics\]\nendpoint = "[^"]*"', f'[metrics]\nendpoint = "{endpoint}"', text)


def with_metrics(node: Node, endpoint: str = "127.0.0.1:0") -> Node:
    cfg = Path(node.config)
    cfg.write_text(metrics_on(cfg.read_text(), endpoint))
    assert load_config(cfg).metrics_endpoint == endpoint
    return node


@pytest.mark.slow
def test_daemon_pair_metrics_match_status_and_count_a_foreign_peer(tmp_path: Path) -> None:
    ca = init_ca(tmp_path)
    x = with_metrics(init_node(tmp_path, "x", ca))
    nodes = [x]
    try:
        x.start()
        x.wait_ready()
        y = with_metrics(init_node(tmp_path, "y", ca, [x.addr()]))
        nodes.append(y)
        y.start()
        y.wait_ready()
        wait_until(lambda: "y" in connected_fast(x) and "x" in connected_fast(y), timeout=60)

        x.probe("y", 300_000)
        x.probe("y", 1000)
        sx, sy = scrape(x), scrape(y)
        jobs_x = bridge_status(x)["jobs"]["_probe"]
        jobs_y = bridge_status(y)["jobs"]["_probe"]
        # Every probe is two updates (an empty one for the round trip, then the body).
        assert jobs_x["sent_updates"] == 4 and jobs_x["sent_bytes"] == 301_000
        assert value(sx, "fabricd_update_sent_bytes_total", cluster="y") == jobs_x["sent_bytes"]
        assert value(sx, "fabricd_update_sent_total", cluster="y") == jobs_x["sent_updates"]
        assert value(sx, "fabricd_update_seconds_count", direction="sent") == jobs_x["sent_updates"]
        assert value(sy, "fabricd_update_received_bytes_total", cluster="x") == jobs_y["received_bytes"] == 301_000
        assert value(sy, "fabricd_update_received_total", cluster="x") == jobs_y["received_updates"] == 4
        assert value(sy, "fabricd_update_seconds_count", direction="received") == 4
        assert value(sy, "fabricd_update_sent_bytes_total", cluster="x") == 0
        for s, other in ((sx, "y"), (sy, "x")):
            assert value(s, "fabricd_connected_clusters") == 1
            assert value(s, "fabricd_cluster_connected", cluster=other) == 1
            assert value(s, "fabricd_updates_in_flight", direction="sent") == 0
            assert value(s, "fabricd_updates_in_flight", direction="received") == 0
            assert value(s, "fabricd_membership_events_total", event="accepted") >= 1
        documented = DOCS.read_text()
        for name, _ in sx:
            family = re.sub(r"_(bucket|sum|count|created)$", "", name)
            assert f"`{family}`" in documented or f"`{family.removesuffix('_total')}`" in documented \
                or f"`{family}_total`" in documented, f"{name} is not in docs/observability.md"
        assert value(sx, "fabricd_info", cluster="x", peer_id=bridge_status(x)["peer_id"], role="cluster") == 1

        # A daemon of another federation: x refuses it and counts why.
        before = value(sx, "fabricd_refusals_total", stage="membership", reason="foreign_certificate")
        foreign = init_node(tmp_path, "f", init_ca(tmp_path, "foreign-ca"), [x.addr()])
        nodes.append(foreign)
        foreign.start()
        foreign.wait_ready()
        wait_until(lambda: value(scrape(x), "fabricd_refusals_total", stage="membership",
                                 reason="foreign_certificate") > before, timeout=60)
        sx = scrape(x)
        assert value(sx, "fabricd_membership_events_total", event="rejected") >= 1
        assert value(sx, "fabricd_connected_clusters") == 1
        assert "f" in {r["cluster_id"] for r in bridge_status(x)["refused"]}

        # Ordered shutdown: the endpoint is the last service to stop, then the port is closed.
        endpoint = bridge_status(y)["metrics_endpoint"]
        assert y.stop() == 0
        log = y.log()
        assert log.rindex("service.stopped service=metrics") > log.rindex("service.stopped service=membership")
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5)
    finally:
        for node in nodes:
            node.stop()


def test_endpoint_off_by_default_and_bad_endpoints_name_the_key(tmp_path: Path) -> None:
    ca = init_ca(tmp_path)
    node = init_node(tmp_path, "n", ca)
    assert load_config(node.config).metrics_endpoint == ""
    for bad in ("9100", "localhost", "127.0.0.1:99999", "http://127.0.0.1:9100", ":9100"):
        Path(node.config).write_text(re.sub(r'endpoint = "[^"]*"', f'endpoint = "{bad}"',
                                            Path(node.config).read_text()))
        with pytest.raises(ConfigError, match=r"cluster.toml: key 'metrics.endpoint' has invalid value"):
            load_config(node.config)
    assert parse_endpoint("[::1]:9100") == ("::1", 9100)
    assert parse_endpoint("0.0.0.0:0") == ("0.0.0.0", 0)


def test_reason_labels_come_from_a_fixed_table() -> None:
    assert membership_reason("ForeignCertificate: certificate for peer Qm is not signed") == "foreign_certificate"
    assert membership_reason("CertificateRevoked: serial 3 revoked") == "certificate_revoked"
    assert membership_reason("certificate serial 3 for peer Qm has been revoked") == "certificate_revoked"
    assert membership_reason("bad membership reply: EOFError: eof") == "bad_reply"
    # a lying peer's text cannot mint a label value
    assert membership_reason("totally_new_label: x") == "other"
    assert update_reason("busy: 10 bytes of updates in flight, limit 5; retry later") == "busy"
    assert update_reason("update 'm' announces 9 bytes, over the limit of 5 bytes") == "too_large"
    assert update_reason("no executor attached for job 'j' on cluster 'b'") == "no_consumer"
    assert update_reason("DigestMismatch: update 'm': sha256 ...") == "digest_mismatch"
    assert update_reason("whatever a peer says") == "other"
