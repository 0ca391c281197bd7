"""An embedded testbed on this machine: a fresh CA, N cluster daemons and the scheduler's.

Used by `fedpilot-scheduler submit --local N` and by the end-to-end tests. Every daemon
is a real `fabricd` subprocess on 127.0.0.1; each starts its own executor (embedded Ray or
in-process) when a job reaches it. `close()` stops everything it started, in reverse
order, also after Ctrl-C.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from scheduler.cpuquota import CpuQuota, slow_down
from scheduler.run.driver import ClusterInfo, JobFailed
from scheduler.run.mesh import wait_for_clusters

if TYPE_CHECKING:
    from proto.job import JobSpec

log = logging.getLogger("fedpilot.scheduler")


def fabricd_command() -> list[str]:
    """`fabricd` next to this interpreter (the venv's), else the module."""
    script = Path(sys.executable).with_name("fabricd")
    return [str(script)] if script.exists() else [sys.executable, "-m", "fabricd.cli"]


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now and not handed out before by this process (a testbed
    picks several before any is bound; the kernel may offer a released one again)."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    return port


def _run(args: list[str], what: str) -> dict[str, Any]:
    """`fabricd ARGS` (a one-shot subcommand) in this process: a testbed's five `init`s
    as subprocesses spent 3-5 s importing libp2p five times before any daemon started."""
    from fabricd.cli import call
    from fabricd.errors import FabricdError

    try:
        return call(args)
    except (FabricdError, OSError) as exc:  # CliError, ConfigError, IdentityError; a full disk
        raise JobFailed(f"testbed: {what} failed: {exc}") from None


def config_socket(config: Path | str) -> str:
    """The bridge socket a daemon with this config listens on (fabricd's own reading of it,
    including its short-path fallback for long directories)."""
    from fabricd.config import ConfigError, load_config  # TOML + multiaddr only, no libp2p

    try:
        return str(load_config(config).bridge_socket)
    except ConfigError as exc:
        raise JobFailed(str(exc)) from None


def set_toml_value(path: Path, section: str, key: str, value: str | Sequence[str]) -> None:
    """Set `key = "value"` (or a list of strings) in `[section]` of a generated config
    (adds it if absent)."""
    text = path.read_text()
    # the section's lines up to the key (none of them a section header)
    pattern = re.compile(rf"(^\[{re.escape(section)}\]\n(?:(?!\[)[^\n]*\n)*?){re.escape(key)}\s*=.*$",
                         re.MULTILINE)
    # JSON strings and lists of them are TOML basic strings and arrays
    line = f"{key} = {json.dumps(value if isinstance(value, str) else list(value))}"
    if pattern.search(text):
        text = pattern.sub(lambda m: m.group(1) + line, text, count=1)
    elif re.search(rf"^\[{re.escape(section)}\]\s*$", text, re.MULTILINE):
        text = re.sub(rf"^\[{re.escape(section)}\]\s*$", f"[{section}]\n{line}", text, count=1,
                      flags=re.MULTILINE)
    else:
        text = text.rstrip("\n") + f"\n\n[{section}]\n{line}\n"
    path.write_text(text)


@dataclass(frozen=True)
class Allowances:
    """What every testbed cluster allows beyond its defaults (built-in classes, its own
    data/ directory): the person who starts `--local` is every cluster's operator."""

    modules: tuple[str, ...] = ()      # [allow] models: modules job classes may come from
    data_roots: tuple[str, ...] = ()   # [allow] data_roots: absolute directories
    #: sys.path entries the modules were found under here, so the clusters' executors
    #: import what this process imports
    import_paths: tuple[str, ...] = field(default=(), compare=False)

    def describe(self) -> str:
        """One line for the start of a run."""
        modules = ", ".join(self.modules) or "built-in only"
        roots = ", ".join(self.data_roots) or "each cluster's own data/"
        return (f"testbed clusters allow: classes from {modules}; data under {roots} "
                "(--allow-module / --data-root add more)")


def _import_root(module: str) -> str | None:
    """The sys.path entry `module`'s top-level package is found under, if importable."""
    import importlib.util

    top = module.partition(".")[0]
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if found is None:
        return None
    if found.submodule_search_locations:
        locations = list(found.submodule_search_locations)
        return str(Path(locations[0]).parent) if locations else None
    if found.origin and found.has_location:
        return str(Path(found.origin).parent)
    return None


def job_allowances(spec: JobSpec, *, modules: Iterable[str] = (),
                   data_roots: Iterable[str | os.PathLike[str]] = ()) -> Allowances:
    """The job's own model and aggregator modules and its dataset file's directory (an
    image folder: the folder), plus `modules` and `data_roots` from the flags."""
    from proto.job import AGGREGATORS, DATASET_PREFIXES, MODELS

    wanted = list(modules)
    for name, builtin in ((spec.model.name, MODELS), (spec.aggregation.name, AGGREGATORS)):
        if name not in builtin and ":" in name:
            wanted.append(name.partition(":")[0])
    roots = [os.path.realpath(r) for r in data_roots]
    dataset = spec.data.dataset
    prefix = next((p for p in DATASET_PREFIXES if dataset.startswith(p)), None)
    if prefix is not None and spec.data.placement != "pinned":
        path = Path(os.path.realpath(dataset[len(prefix):].partition("#")[0]))
        roots.append(str(path if prefix == "imagefolder:" else path.parent))
    unique_modules = tuple(dict.fromkeys(m.strip() for m in wanted if m.strip()))
    # an installed package is found by the daemons' interpreter anyway (it is this one)
    installed = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}
    paths = [p for p in (_import_root(m) for m in unique_modules)
             if p and not any(os.path.realpath(p).startswith(i + os.sep) for i in installed)]
    return Allowances(modules=unique_modules, data_roots=tuple(dict.fromkeys(roots)),
                      import_paths=tuple(dict.fromkeys(paths)))


class LocalTestbed:
    def __init__(self, clusters: int, *, backend: str = "local", workdir: str | None = None,
                 capacity: int = 0, cluster_prefix: str = "cluster-", metrics: bool = False,
                 datasets: Mapping[str, Mapping[str, str]] | None = None,
                 allow: Allowances | None = None, slow: Mapping[str, float] | None = None
                 ) -> None:
        if clusters < 1:
            raise JobFailed("--local needs at least one cluster")
        if backend not in ("local", "inprocess"):
            raise JobFailed(f"unknown testbed backend {backend!r}; allowed: local, inprocess")
        self.backend = backend
        self.capacity = capacity
        self.metrics = metrics  # every daemon serves /metrics on a free port (status says where)
        self.executor_endpoints: dict[str, str] = {}  # with metrics: each cluster's executor's
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="fedpilot-")
        self.root = Path(workdir or self._tmp.name)  # type: ignore[union-attr]
        self.cluster_ids = [f"{cluster_prefix}{i + 1}" for i in range(clusters)]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.allow = allow or Allowances()
        self._logs: list[IO[bytes]] = []
        self.configs: dict[str, Path] = {}
        # cluster id -> its cluster.toml [datasets] (NAME -> KIND:PATH; relative paths start
        # in the cluster's own directory, ROOT/<cluster id>/, whose data/ is its data root)
        self.datasets = {cid: dict(table) for cid, table in (datasets or {}).items()}
        unknown = sorted(set(self.datasets) - set(self.cluster_ids))
        if unknown:
            raise JobFailed(f"testbed: datasets for unknown cluster(s) {', '.join(unknown)} "
                            f"(clusters: {', '.join(self.cluster_ids)})")
        #: cluster id -> slow-down factor: its daemon, executor and Ray get 1/factor of a
        #: fair share of this machine's CPUs
        self.slow = dict(slow or {})
        unknown = sorted(set(self.slow) - set(self.cluster_ids))
        if unknown:
            raise JobFailed(f"testbed: --slow names unknown cluster(s) {', '.join(unknown)} "
                            f"(clusters: {', '.join(self.cluster_ids)})")
        self.quotas: dict[str, CpuQuota] = {}
        #: how each slowed cluster is slowed, or why it is not (this machine's cgroups)
        self.slow_notes: dict[str, str] = {}

    # -- set-up ------------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> list[ClusterInfo]:
        """Write every daemon's config (`prepare`, unless called already: a caller may change
        them in between), start them, and wait for the clusters."""
        if not self.configs:
            self.prepare()
        for name, config in self.configs.items():
            self._spawn(name, config)
        return wait_for_clusters(self.bridge_socket("scheduler"), expected=self.cluster_ids,
                                 timeout=timeout)

    def prepare(self) -> dict[str, Path]:
        """A fresh CA and every daemon's identity and cluster.toml under `root`; nothing runs."""
        ca = self.root / "ca"
        _run(["certs", "init-ca", "--out", str(ca)], "creating the testbed CA")
        first_addr: str | None = None
        for name in [*self.cluster_ids, "scheduler"]:
            out = self.root / name
            args = ["init", "--cluster-id", name, "--listen", f"/ip4/127.0.0.1/tcp/{free_port()}",
                    "--ca", str(ca), "--out", str(out)]
            if name == "scheduler":
                args += ["--role", "scheduler"]
            elif self.capacity:
                args += ["--capacity", str(self.capacity)]
            if first_addr:
                args += ["--bootstrap", first_addr]
            made = _run(args, f"initialising daemon {name}")
            config = out / "cluster.toml"
            if name != "scheduler":
                set_toml_value(config, "ray", "address", self.backend)
            if self.metrics:
                set_toml_value(config, "metrics", "endpoint", "127.0.0.1:0")
                if name != "scheduler":  # a job's executor serves its own, on a known port
                    self.executor_endpoints[name] = f"127.0.0.1:{free_port()}"
                    set_toml_value(config, "metrics", "executor_endpoint",
                                   self.executor_endpoints[name])
            if name != "scheduler":
                if self.allow.modules:
                    set_toml_value(config, "allow", "models", self.allow.modules)
                # "data" (the cluster's own directory) stays: pinned datasets live there
                set_toml_value(config, "allow", "data_roots", ["data", *self.allow.data_roots])
            for dataset, where in self.datasets.get(name, {}).items():
                set_toml_value(config, "datasets", dataset, where)
            self.configs[name] = config
            if first_addr is None:
                first_addr = str(made["addrs"][0])  # `fabricd init` answers {config, peer_id, addrs, ...}
        return self.configs

    #: starts a daemon (the tests fork theirs from a warm process: tests/_zygote.py)
    popen: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen

    def _spawn(self, name: str, config: Path) -> None:
        log_file = (self.root / f"{name}.log").open("ab")
        self._logs.append(log_file)
        env = None
        if self.allow.import_paths:  # executors import the job's classes as this process does
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(
                [*self.allow.import_paths, *filter(None, [env.get("PYTHONPATH")])])
        self.procs[name] = self.popen(
            [*fabricd_command(), "--config", str(config)], stdout=log_file,
            stderr=subprocess.STDOUT, start_new_session=True, env=env)
        if name in self.slow:  # before a job starts its executor, which inherits the cgroup
            quota, self.slow_notes[name] = slow_down(
                self.procs[name].pid, self.slow[name], len(self.cluster_ids),
                f"fedpilot-{name}-{os.getpid()}")
            if quota is not None:
                self.quotas[name] = quota
            log.warning("event=testbed_slow cluster=%s factor=%g how=%s", name,
                        self.slow[name], self.slow_notes[name])

    def bridge_socket(self, name: str) -> str:
        return config_socket(self.configs[name])

    def kill(self, name: str) -> None:
        """SIGKILL one daemon and its executor (for failure tests)."""
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)

    def restart(self, name: str) -> None:
        """Start a killed daemon again with the same config (identity, listen address)."""
        if self.procs[name].poll() is None:
            raise JobFailed(f"daemon {name} is still running: kill it first")
        self._spawn(name, self.configs[name])

    # -- tear-down ---------------------------------------------------------------------------
    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:  # the executor shares the daemon's process group
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if proc.poll() is None:
                proc.wait(timeout=10)
        for quota in self.quotas.values():
            quota.remove()
        for f in self._logs:
            f.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> LocalTestbed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
