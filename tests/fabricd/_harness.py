"""Real fabricd subprocesses on 127.0.0.1 for integration tests (always killed in teardown)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scheduler.testbed import free_port
from tests import _zygote

FABRICD = [sys.executable, "-m", "fabricd.cli"]


def cli(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([*FABRICD, *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"fabricd {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def cli_json(*args: str, timeout: float = 120) -> Any:
    return json.loads(cli(*args, timeout=timeout).stdout)


def cli_inprocess(*args: str) -> Any:
    """Run a one-shot fabricd subcommand in this process (no daemon): its JSON answer."""
    from fabricd.cli import call

    return call(list(args))


@dataclass
class Node:
    name: str
    dir: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path = field(init=False)
    started_at: float = 0.0

    def __post_init__(self) -> None:
        self.log_path = self.dir.parent / f"{self.name}.log"

    @property
    def config(self) -> str:
        return str(self.dir / "cluster.toml")

    @property
    def bridge_socket(self) -> str:
        """The path of its bridge socket (as its cluster.toml says)."""
        from fabricd.config import load_config

        return str(load_config(self.config).bridge_socket)

    def addr(self) -> str:
        return str(cli_inprocess("id", "--config", self.config)["addrs"][0])

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the subprocess
        self.started_at = time.monotonic()
        self.proc = _zygote.popen([*FABRICD, "--config", self.config], stdout=log, stderr=log,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"fabricd {self.name} exited {self.proc.returncode}:\n{self.log()}")
            if "event=daemon.ready" in self.log():
                return
            time.sleep(0.05)
        raise AssertionError(f"fabricd {self.name} not ready in {timeout} s:\n{self.log()}")

    def status(self) -> dict[str, Any]:
        return dict(cli_json("status", "--config", self.config))

    def connected(self) -> set[str]:
        return {c["cluster_id"] for c in self.status()["clusters"] if c["connected"]}

    def probe(self, cluster: str, nbytes: int, check: bool = True) -> subprocess.CompletedProcess[str]:
        return cli("probe", "--config", self.config, "--cluster", cluster, "--bytes", str(nbytes),
                   check=check, timeout=300)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def init_ca(root: Path, name: str = "ca") -> Path:
    ca = root / name
    cli_inprocess("certs", "init-ca", "--out", str(ca))
    return ca


def init_node(root: Path, name: str, ca: Path, bootstrap: list[str] = (), role: str = "cluster",  # type: ignore[assignment]
              ) -> Node:
    port = free_port()
    args = ["init", "--cluster-id", name, "--listen", f"/ip4/127.0.0.1/tcp/{port}",
            "--ca", str(ca), "--out", str(root / name), "--role", role]
    for b in bootstrap:
        args += ["--bootstrap", b]
    cli_inprocess(*args)
    return Node(name, root / name, port)


def configure(node: Node, network: str = "", limits: str = "") -> None:
    """Add lines to the [network] and [limits] sections of ``node``'s cluster.toml."""
    path = Path(node.config)
    text = path.read_text()
    for section, lines in (("[network]\n", network), ("[limits]\n", limits)):
        assert not lines or section in text, "the generated config changed shape"
        text = text.replace(section, f"{section}{lines}\n", 1)
    path.write_text(text)


def wait_until(predicate: Any, timeout: float, interval: float = 0.1) -> float:
    """Seconds until predicate() is truthy; AssertionError after ``timeout``."""
    start = time.monotonic()
    last_exc: Exception | None = None
    while time.monotonic() - start < timeout:
        try:
            if predicate():
                return time.monotonic() - start
        except (AssertionError, json.JSONDecodeError, subprocess.SubprocessError) as exc:
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s (last error: {last_exc})")


def bridge_status(node: Node) -> dict[str, Any]:
    """Status straight over the bridge socket (fast enough to poll)."""
    from proto.bridge import BridgeClient, StatusReply, StatusRequest

    with BridgeClient(node.bridge_socket, role="cli", timeout=10) as client:
        reply, _ = client.request(StatusRequest())
    assert isinstance(reply, StatusReply), reply
    return dict(reply.status)


def connected_fast(node: Node) -> set[str]:
    return {c["cluster_id"] for c in bridge_status(node)["clusters"] if c["connected"]}


def transfer(node: Node) -> dict[str, Any]:
    """The daemon's transfer counters (its status over the bridge)."""
    return dict(bridge_status(node)["transfer"])


def wait_linked(a: Node, b: Node) -> None:
    """Until a and b each see the other connected."""
    wait_until(lambda: b.name in connected_fast(a) and a.name in connected_fast(b), timeout=60)


def start_pair(root: Path, limits: str = "", prepare: Callable[[Node], None] | None = None) -> tuple[Node, Node]:
    """Daemons a and b (b bootstraps from a) under a fresh CA in ``root``, with ``limits``
    lines in both configs (then ``prepare`` run on each), started and linked. The caller
    stops them; should this fail, it stops both itself."""
    ca = init_ca(root)
    a = init_node(root, "a", ca)
    b = init_node(root, "b", ca, [a.addr()])
    try:
        for node in (a, b):
            configure(node, limits=limits)
            if prepare is not None:
                prepare(node)
            node.start()
        for node in (a, b):
            node.wait_ready()
        wait_linked(a, b)
    except BaseException:
        for node in (a, b):
            node.stop()
        raise
    return a, b


def start_relayed(root: Path, ca: Path, members: tuple[str, ...], relay: str, gateway_limits: str = "",
                  member_limits: str = "", gateways: tuple[str, ...] = ("g",), member_network: str = "",
                  ) -> list[Node]:
    """Gateways (``relay``: lines for their [network], relay_service = true among them) and
    ``members`` that bootstrap from all of them and announce only relayed addresses
    (reachability = "private", and ``member_network``'s lines; hole_punching = false
    unless they set it: on loopback no NAT stops a punch, and the links would not stay
    relayed), all started and ready:
    [*gateways, *members]. The caller stops them; should this fail, it stops those it
    started itself."""
    nodes: list[Node] = []
    try:
        for name in gateways:
            g = init_node(root, name, ca)
            configure(g, relay, gateway_limits)
            nodes.append(g)
            g.start()
            g.wait_ready()
        addrs = [g.addr() for g in nodes]
        for name in members:
            node = init_node(root, name, ca, addrs)
            punch = "" if "hole_punching" in member_network else "hole_punching = false"
            configure(node, '\n'.join(filter(None, ['reachability = "private"', punch, member_network])),
                      member_limits)
            nodes.append(node)
            node.start()
        for node in nodes:
            node.wait_ready()
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes


def join_and_probe(via: Node, new: Node, nbytes: int = 65536) -> tuple[float, subprocess.CompletedProcess[str]]:
    """Seconds from now (``new`` is ready) until ``via`` sees ``new`` connected and a probe
    from ``via`` to it ended, and that probe (not checked)."""
    started = time.monotonic()
    wait_until(lambda: new.name in connected_fast(via), timeout=120)
    probe = via.probe(new.name, nbytes, check=False)
    return time.monotonic() - started, probe


def revocation_seconds(members: list[Node], revoked: str, since: float, timeout: float = 180) -> dict[str, float]:
    """Seconds from ``since`` until each member applied a revocation list and no longer
    sees cluster ``revoked`` connected (AssertionError after ``timeout``)."""
    took: dict[str, float] = {}

    def everywhere() -> bool:
        for node in members:
            if node.name in took:
                continue
            status = bridge_status(node)
            connected = {c["cluster_id"] for c in status["clusters"] if c["connected"]}
            if status["revoked_serials"] >= 1 and revoked not in connected:
                took[node.name] = time.monotonic() - since
        return len(took) == len(members)

    wait_until(everywhere, timeout=timeout, interval=0.05)
    return took
