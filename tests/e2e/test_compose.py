"""The docker-compose testbed: what can be checked without a container engine.

`docker-compose config` validates the file the way Compose reads it; the structural
checks make sure the one-shot `certs` service generates configs for exactly the
addresses the services are given, and running deploy/gen-configs.sh with that very
command line (into a temp dir, with this venv's fabricd) shows the configs it makes load,
carry the right roles and bootstrap from a's real peer id.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
CLUSTERS = ("a", "b", "c")
SCRIPTS = ("gen-configs.sh", "netns-testbed.sh", "entrypoint.sh", "compose-demo.sh")


def _fabricd() -> str:
    return str(Path(sys.executable).with_name("fabricd"))


def _compose_config() -> dict[str, Any]:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip(
            "docker-compose is not installed (Debian: apt-get install docker-compose); "
            "the structural checks of the raw file still ran"
        )
    proc = subprocess.run(
        [exe, "-f", str(COMPOSE), "config"], cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"docker-compose config rejected {COMPOSE}:\n{proc.stderr}"
    return yaml.safe_load(proc.stdout)


def _raw_config() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _option(command: list[str], flag: str) -> list[str]:
    return [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == flag]


def _condition(service: dict[str, Any], dep: str) -> str:
    deps = service.get("depends_on", {})
    assert isinstance(deps, dict), f"depends_on must use conditions, got {deps!r}"
    assert dep in deps, f"missing depends_on {dep}"
    return str(deps[dep]["condition"])


@pytest.mark.parametrize("source", ["raw", "docker-compose config"])
def test_compose_file_describes_three_clusters_and_a_scheduler(source: str) -> None:
    config = _raw_config() if source == "raw" else _compose_config()
    services = config["services"]
    assert set(services) == {"certs", *CLUSTERS, "scheduler"}

    certs_cmd = [str(x) for x in services["certs"]["command"]]
    assert certs_cmd[0] == "gen-configs"
    assert _option(certs_cmd, "--ray") == ["auto"]
    generated = dict(spec.split("=", 1) for spec in _option(certs_cmd, "--cluster"))
    assert list(generated) == list(CLUSTERS), "a must come first: it is the bootstrap peer"
    assert _option(certs_cmd, "--out") == ["/cfg"]

    addresses = set()
    for cid in CLUSTERS:
        svc = services[cid]
        assert svc["command"] == ["cluster", f"/cfg/{cid}/cluster.toml"]
        ip = svc["networks"]["fabric"]["ipv4_address"]
        assert generated[cid] == ip, f"certs makes {cid} listen on {generated[cid]}, service has {ip}"
        addresses.add(ip)
        assert _condition(svc, "certs") == "service_completed_successfully"
        assert "fabricd" in svc["healthcheck"]["test"]
        assert f"/cfg/{cid}/cluster.toml" in svc["healthcheck"]["test"]
        assert any(str(v).startswith("fabric-cfg:/cfg") for v in svc["volumes"])
        assert not any("fabric-ca" in str(v) for v in svc["volumes"]), "CA key must stay in certs"
    for cid in ("b", "c"):
        assert _condition(services[cid], "a") == "service_healthy"

    sched = services["scheduler"]
    sched_ip = sched["networks"]["fabric"]["ipv4_address"]
    assert _option(certs_cmd, "--scheduler") == [sched_ip]
    assert sched_ip not in addresses
    cmd = [str(x) for x in sched["command"]]
    # The scheduler's own daemon runs beside `submit --mesh`, with the same config.
    assert cmd[:2] == ["with-fabricd", "/cfg/scheduler/cluster.toml"]
    assert cmd[2:5] == ["fedpilot-scheduler", "submit", "/jobs/digits.toml"]
    assert _option(cmd, "--mesh") == ["/cfg/scheduler/cluster.toml"]
    assert _option(cmd, "--clusters") == [",".join(CLUSTERS)]
    for cid in CLUSTERS:
        assert _condition(sched, cid) == "service_healthy"
    assert not any("fabric-ca" in str(v) for v in sched["volumes"])


def test_scheduler_service_runs_a_valid_submit_of_a_valid_job() -> None:
    from scheduler.cli import build_parser
    from scheduler.jobfile import load_job

    sched = _raw_config()["services"]["scheduler"]
    cmd = [str(x) for x in sched["command"]]
    assert cmd[2] == "fedpilot-scheduler"
    args = build_parser().parse_args(cmd[3:])
    assert args.command == "submit" and args.local is None
    assert args.mesh == "/cfg/scheduler/cluster.toml"
    # /jobs is deploy/examples, mounted read-only: the job it names must load.
    mounts = {v.split(":")[1]: v.split(":")[0] for v in sched["volumes"]}
    assert mounts["/jobs"] == "./examples"
    job = DEPLOY / "examples" / Path(args.job).relative_to("/jobs")
    spec = load_job(str(job))
    assert spec.job_id
    # ... and fit into the capacity the certs service gives the three clusters.
    certs_cmd = [str(x) for x in _raw_config()["services"]["certs"]["command"]]
    capacity = int(_option(certs_cmd, "--capacity")[0])
    assert capacity * len(CLUSTERS) >= spec.data.number_of_clients


def test_dockerfile_builds_from_repo_root_and_runs_the_entrypoint() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    # the base is an argument; its default is made offline by deploy/compose-demo.sh
    assert "ARG BASE=fedpilot-base:bookworm" in text and text.count("FROM ${BASE}") == 2
    assert "torch==2.13.0" in text
    assert 'ENTRYPOINT ["/opt/fedpilot/deploy/entrypoint.sh"]' in text
    for copied in ("proto", "fabricd", "worker", "scheduler", "fedpilot", "fedcore", "deploy/entrypoint.sh"):
        assert copied in text
    ignored = (REPO / ".dockerignore").read_text().split()
    for path in (".venv", ".git"):
        assert path in ignored
    for needed in ("proto", "fabricd", "worker", "scheduler", "deploy", "pyproject.toml", "README.md"):
        assert needed not in ignored
    entry = (DEPLOY / "entrypoint.sh").read_text()
    assert "ray start --head" in entry and "fabricd --config" in entry


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_is_valid_bash(script: str) -> None:
    path = DEPLOY / script
    assert os.access(path, os.X_OK), f"{path} is not executable"
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    shellcheck = shutil.which("shellcheck")
    if shellcheck is not None:
        proc = subprocess.run([shellcheck, str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout


def _run_certs_command(out: Path, ca: Path) -> subprocess.CompletedProcess[str]:
    """Run the compose `certs` service's own command line, with its paths moved to tmp."""
    cmd = [str(x) for x in _raw_config()["services"]["certs"]["command"]][1:]
    cmd[cmd.index("--out") + 1] = str(out)
    cmd[cmd.index("--ca") + 1] = str(ca)
    env = {**os.environ, "FABRICD": _fabricd(), "PYTHON": sys.executable}
    return subprocess.run(
        [str(DEPLOY / "gen-configs.sh"), *cmd], env=env, capture_output=True, text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_certs_command_generates_a_federation_that_bootstraps_from_a(tmp_path: Path) -> None:
    from fabricd.config import load_config
    from proto.certs import load_ca_public, verify_certificate

    out, ca = tmp_path / "cfg", tmp_path / "ca"
    proc = _run_certs_command(out, ca)
    assert proc.returncode == 0, proc.stderr
    assert (ca / "ca.key").is_file() and (ca / "ca.pub").is_file()
    assert not (out / "ca").exists(), "the CA key must not land in the shared config volume"

    services = _raw_config()["services"]
    configs = {cid: load_config(out / cid / "cluster.toml") for cid in (*CLUSTERS, "scheduler")}
    certs = {}
    for cid, cfg in configs.items():
        assert cfg.cluster_id == cid
        assert cfg.role == ("scheduler" if cid == "scheduler" else "cluster")
        # Signed by this CA for this cluster id and role; each config carries the CA's key.
        certs[cid] = verify_certificate(cfg.certificate.read_bytes(), load_ca_public(ca),
                                        now=time.time(), required_role=cfg.role)
        assert certs[cid].cluster_id == cid
        assert cfg.ca_public_key.read_bytes() == (ca / "ca.pub").read_bytes()
        ip = services[cid]["networks"]["fabric"]["ipv4_address"]
        assert cfg.listen == (f"/ip4/{ip}/tcp/4001",)
        assert not list((out / cid).glob("ca.key")), f"{cid} must not hold the CA key"
    capacity = int(_option([str(x) for x in services["certs"]["command"]], "--capacity")[0])
    for cid in CLUSTERS:
        assert configs[cid].ray_address == "auto"
        assert configs[cid].capacity == capacity

    assert len({c.peer_id for c in certs.values()}) == len(certs)
    bootstrap = (out / "bootstrap.addr").read_text().strip()
    a_ip = services["a"]["networks"]["fabric"]["ipv4_address"]
    assert bootstrap == f"/ip4/{a_ip}/tcp/4001/p2p/{certs['a'].peer_id}"
    assert configs["a"].bootstrap == ()
    for cid in ("b", "c", "scheduler"):
        assert configs[cid].bootstrap == (bootstrap,)

    # A restart of the one-shot keeps every identity (so the bootstrap address stays true).
    identities = {cid: cfg.identity_key.read_bytes() for cid, cfg in configs.items()}
    proc = _run_certs_command(out, ca)
    assert proc.returncode == 0, proc.stderr
    assert (out / "bootstrap.addr").read_text().strip() == bootstrap
    assert {cid: cfg.identity_key.read_bytes() for cid, cfg in configs.items()} == identities


# ---- the image's entrypoint, run without an image ---------------------------------------

def _venv_env(**extra: str) -> dict[str, str]:
    bindir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '')}",
            "FABRICD": _fabricd(), "PYTHON": sys.executable, **extra}


def _init_one(tmp_path: Path, cluster_id: str, role: str, ray: str) -> Path:
    """A one-daemon federation on 127.0.0.1 (ephemeral port); returns its cluster.toml."""
    for args in (["certs", "init-ca", "--out", str(tmp_path / "ca")],
                 ["init", "--cluster-id", cluster_id, "--role", role, "--listen",
                  "/ip4/127.0.0.1/tcp/0", "--ca", str(tmp_path / "ca"),
                  "--out", str(tmp_path / cluster_id)]):
        proc = subprocess.run([_fabricd(), *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    config = tmp_path / cluster_id / "cluster.toml"
    text = config.read_text()
    assert 'address = "inprocess"' in text
    config.write_text(text.replace('address = "inprocess"', f'address = "{ray}"'))
    return config


@pytest.mark.slow
def test_with_fabricd_runs_the_command_beside_a_live_daemon_then_stops_it(tmp_path: Path) -> None:
    """The scheduler container's mode: CMD runs once the daemon answers; CMD's exit
    status is the container's; the daemon does not outlive it."""
    config = str(_init_one(tmp_path, "scheduler", "scheduler", "inprocess"))
    probe = f'fabricd status --config {config} > {tmp_path / "status.json"} && exit 7'
    proc = subprocess.run(
        [str(DEPLOY / "entrypoint.sh"), "with-fabricd", config, "sh", "-c", probe],
        env=_venv_env(), capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 7, proc.stderr
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["cluster_id"] == "scheduler" and status["role"] == "scheduler"
    assert "daemon.stopped" in proc.stderr, proc.stderr
    again = subprocess.run([_fabricd(), "status", "--config", config, "--timeout", "2"],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode != 0, "fabricd still answers after the command ended"


def _sandbox_unavailable() -> str | None:
    """Why a container-like sandbox (network + PID + mount namespaces) cannot be made."""
    if not sys.platform.startswith("linux"):
        return "namespaces exist only on Linux"
    if os.geteuid() != 0:
        return "making network/PID/mount namespaces needs root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed"
    probe = f"fpeprobe{os.getpid()}"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"'ip netns add' is not permitted here: {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(600)
def test_cluster_entrypoint_runs_ray_head_and_fabricd_then_stops_both(tmp_path: Path) -> None:
    """The cluster containers' mode, in a sandbox standing in for a container: its own
    network, PID and mount namespaces and a private /tmp/ray, so the entrypoint's
    `ray stop` can only see this sandbox's Ray."""
    reason = _sandbox_unavailable()
    if reason is not None:
        pytest.skip(reason)
    config = _init_one(tmp_path, "a", "cluster", "auto")
    ns = f"fpe{os.getpid() % 100000}"
    log = tmp_path / "entrypoint.log"
    sandbox = 'mkdir -p /tmp/ray && mount -t tmpfs tmpfs /tmp/ray && exec "$0" cluster "$1"'
    subprocess.run(["ip", "netns", "add", ns], check=True)
    proc: subprocess.Popen[bytes] | None = None
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        with log.open("wb") as fh:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "--pid", "--fork", "--mount-proc",
                 "--mount", "bash", "-c", sandbox, str(DEPLOY / "entrypoint.sh"), str(config)],
                env=_venv_env(RAY_NODE_IP="127.0.0.1", RAY_NUM_CPUS="1",
                              RAY_USAGE_STATS_ENABLED="0"),
                stdout=fh, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 300   # bounds a hung start only
        while subprocess.run([_fabricd(), "status", "--config", str(config), "--timeout", "5"],
                             capture_output=True).returncode != 0:
            assert proc.poll() is None, f"entrypoint exited early:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"fabricd never answered:\n{log.read_text()[-4000:]}"
            time.sleep(1)
        assert "Ray runtime started" in log.read_text()
        running = {_comm(pid) for pid in _ns_pids(ns)}
        assert {"gcs_server", "raylet", "fabricd"} <= running, running

        # `ip netns exec` execs unshare, whose one child is the entrypoint (PID 1 inside).
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 1
        os.kill(int(children[0]), signal.SIGTERM)
        assert proc.wait(timeout=180) == 0, log.read_text()[-4000:]
        text = log.read_text()
        assert "daemon.stopped" in text, text[-4000:]
        assert _ns_pids(ns) == [], "processes outlived the entrypoint"
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        for pid in _ns_pids(ns):
            os.kill(pid, signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _docker_skip_reason() -> str | None:
    """Why the real-container run cannot happen here, or None."""
    if shutil.which("docker") is None:
        return "no docker client (Debian: apt-get install docker.io; `make compose-demo` does)"
    if shutil.which("docker-compose") is None:
        return "no docker-compose (Debian: apt-get install docker-compose)"
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "docker info did not answer in 30 s"
    if info.returncode != 0:
        return ("no Docker engine answers (docker info failed; this test does not start one: "
                "`make compose-demo` starts dockerd as root)")
    return None


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_compose_demo_in_real_containers(tmp_path: Path) -> None:
    """`deploy/compose-demo.sh` end to end: image, 3 clusters + scheduler in containers, the
    demo job whose rounds take seconds with cluster c's container killed after round 2; the
    job goes on (on_cluster_loss = "continue"), results reach the host, nothing is left
    running."""
    reason = _docker_skip_reason()
    if reason:
        pytest.skip(reason)
    # digits.toml's rounds take 0.1-0.3 s: the job could end before c's loss is noticed
    job = DEPLOY / "examples" / "digits-faults.toml"
    rounds = int(tomllib.loads(job.read_text())["training"]["federated_learning_rounds"])
    out = tmp_path / "out"
    project = "fedpilot-test"
    proc = subprocess.run(
        [str(DEPLOY / "compose-demo.sh"), "--job", str(job), "--out", str(out), "--kill", "c",
         "--kill-at-round", "2", "--keep-dockerd", "--no-install"],
        cwd=REPO, capture_output=True, text=True, timeout=3500, env={**os.environ, "PROJECT": project})
    assert proc.returncode == 0, f"compose-demo failed:\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(report))  # build and run seconds, for the record
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and len(summary["rounds"]) == rounds
    assert report["killed"] == "c" and 2 <= report["killed_after_round"] < rounds
    lost = [f for f in summary["faults"] if f["event"] == "lost"]
    assert [f["cluster"] for f in lost] == ["c"], (summary["faults"], proc.stderr[-2000:])
    # the report line carries the loss's timings as summary.json has them
    def timings(faults: list[dict[str, Any]]) -> list[tuple[float, float]]:
        return [(f["detect_seconds"], f["recover_seconds"]) for f in faults if f["event"] == "lost"]
    assert timings(report["faults"]) == timings(lost)
    for name in ("metrics.csv", "placement.json", "model.safetensors", "accuracy.png", "traffic.png"):
        assert (out / name).stat().st_size > 0, name
    left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}"],
                          capture_output=True, text=True, timeout=60).stdout.split()
    assert left == [], f"containers left behind: {left}"
