"""``make demo``: a local mesh of three fabricd daemons and a verified probe between them.

Creates a fresh CA in a temporary directory, runs ``fabricd init`` three times (b and
c bootstrap from a), starts the daemons, waits until each lists the other two as
connected, prints their status and a 64 MiB probe result, and shuts them down with
SIGTERM.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FABRICD = [sys.executable, "-m", "fabricd.cli"]
NAMES = ("a", "b", "c")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(*args: str) -> Any:
    proc = subprocess.run([*FABRICD, *args], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"fabricd {' '.join(args)} failed:\n{proc.stderr}")
    return json.loads(proc.stdout) if proc.stdout.strip() else None


def _connected(config: Path) -> set[str]:
    proc = subprocess.run([*FABRICD, "status", "--config", str(config)], capture_output=True,
                          text=True, timeout=60)
    if proc.returncode != 0:
        return set()
    return {c["cluster_id"] for c in json.loads(proc.stdout)["clusters"] if c["connected"]}


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="fabricd-demo-") as tmp:
        root = Path(tmp)
        _run("certs", "init-ca", "--out", str(root / "ca"))
        configs: dict[str, Path] = {}
        bootstrap: list[str] = []
        for name in NAMES:
            args = ["init", "--cluster-id", name, "--listen", f"/ip4/127.0.0.1/tcp/{_free_port()}",
                    "--ca", str(root / "ca"), "--out", str(root / name), "--capacity", "2"]
            for b in bootstrap:
                args += ["--bootstrap", b]
            out = _run(*args)
            configs[name] = root / name / "cluster.toml"
            if name == "a":
                bootstrap = [out["addrs"][0]]
            print(f"init {name}: peer {out['peer_id']}")
        procs = []
        try:
            start = time.monotonic()
            for name in NAMES:
                log = open(root / f"{name}.log", "wb")  # noqa: SIM115 - owned by the child
                procs.append(subprocess.Popen([*FABRICD, "--config", str(configs[name])],
                                              stdout=log, stderr=log))
                log.close()
            deadline = time.monotonic() + 120
            pending = set(NAMES)
            while pending and time.monotonic() < deadline:
                for name in sorted(pending):
                    if set(NAMES) - {name} <= _connected(configs[name]):
                        pending.discard(name)
                time.sleep(0.2)
            if pending:
                raise SystemExit(f"daemons {sorted(pending)} did not see the others; logs in {root}")
            print(f"all three daemons see each other {time.monotonic() - start:.1f} s after start")
            for name in NAMES:
                status = _run("status", "--config", str(configs[name]))
                peers = ", ".join(f"{c['cluster_id']}={'up' if c['connected'] else 'down'}"
                                  for c in status["clusters"])
                print(f"status {name}: peer {status['peer_id'][:16]}... sees {peers}")
            probe = _run("probe", "--config", str(configs["a"]), "--cluster", "c",
                         "--bytes", str(64 * 1024 * 1024))
            print("probe a -> c:", json.dumps(probe))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        print("daemons stopped cleanly" if all(p.returncode == 0 for p in procs)
              else f"daemon exit codes: {[p.returncode for p in procs]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
