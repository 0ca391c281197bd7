"""``cluster.toml``: loaded and validated once, before any socket is opened.

Every error names the file, the key, the bad value and what is allowed. Relative
paths in the file are resolved against the directory that holds it.
"""

from __future__ import annotations

import os
import re
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import multiaddr

from fabricd.errors import FabricdError
from proto.job import DATASET_PREFIXES

ROLES = ("cluster", "scheduler")
RAY_ADDRESS_KINDS = ("local", "auto", "inprocess")
REACHABILITY = ("public", "private", "auto")
# AF_UNIX sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH = 100
MAX_FRAME_LIMIT = 16 * 1024 * 1024
_DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class ConfigError(FabricdError):
    """A cluster.toml problem the user has to fix; the message says where and how."""


@dataclass(frozen=True)
class Limits:
    max_update_bytes: int = 1 << 30
    max_inflight_bytes: int = 2 << 30
    max_frame_bytes: int = 4 * 1024 * 1024
    chunk_bytes: int = 4 * 1024 * 1024
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    stream_timeout: float = 30.0
    # a connected peer that has not proved membership by then is disconnected
    auth_timeout: float = 10.0
    # an update transfer slower than this (bytes/s, after a 5 s grace) is cut off
    min_transfer_rate: float = 256 * 1024
    # a control request (e.g. a training round on a big cluster) may take this long
    control_timeout: float = 900.0
    # delivered update ids kept per (sending cluster, job); older rounds close first
    dedup_ids_per_member: int = 65_536
    # rounds behind a sender's newest delivered round that stay open (older: refused)
    dedup_round_window: int = 64
    # update bodies at least this large go over the TLS-keyed data plane (fabricd/_dataplane.py),
    # smaller ones over libp2p (but see dataplane_small_bytes); 0 = off, everything over libp2p. 1 MiB: from there up the
    # plane takes about half the time per update of libp2p on loopback (bench_transfer).
    # A peer whose data-plane port cannot be reached gets its large updates over libp2p.
    dataplane_min_bytes: int = 1024 * 1024
    # the digest of a body on the data plane: "blake3" (the sending daemon hashes the body
    # while it sends it and writes the digest after it; this daemon hashes it while it reads
    # it and verifies before delivery) or "sha256" (the header's digest, recomputed here:
    # ~3x the receiver's CPU)
    dataplane_digest: str = "blake3"
    # update bodies of at most this many bytes (<= 65536) go over the data plane too, each in
    # one record with its header and one ack back (no go): ~1/3 of libp2p's daemon CPU per
    # 1 KiB update (bench_transfer fixed_cost); 0 = they use libp2p. Ignored when
    # dataplane_min_bytes = 0 (no data plane). A peer whose plane is unreachable gets them
    # over libp2p.
    dataplane_small_bytes: int = 64 * 1024
    # memfds allocated ahead (in idle time, after a large data-plane body) for the next one,
    # at most this many bytes and two memfds: a fresh memfd's pages cost more to fault in
    # than the copy into them (proto/_bridge_fds.py SpareMemfds); unused ones are freed
    # after 60 s. 0 = none, here and in the executors this daemon starts (--spare-bytes 0).
    dataplane_spare_bytes: int = 128 * 1024 * 1024


@dataclass(frozen=True)
class Relay:
    """``[network]`` relay settings (fabricd/_relay.py, docs/deploy.md "Sites behind NAT")."""

    #: public: dialable as announced; private: keeps reservations at the bootstrap relays
    #: and announces only /p2p-circuit addresses; auto: both (direct addresses first)
    reachability: str = "public"
    #: serve circuit relay v2 to members (a gateway with a public address)
    service: bool = False
    #: reservations held at once (one per member)
    max_reservations: int = 64
    #: circuits at once per member (as source, and as destination)
    max_circuits: int = 16
    #: bytes and seconds per circuit (0 = unlimited)
    circuit_bytes: int = 0
    circuit_seconds: int = 0
    #: bytes per second a gateway passes on in all, circuits and splices (0 = unlimited)
    max_bytes_per_second: int = 0
    #: a member pings its gateways every half of this; one silent this long (frozen, its
    #: machine gone) has its connection closed, so links redial through another relay
    silent_after: float = 10.0
    #: reachability private or auto: upgrade a relayed link to a direct one by DCUtR hole
    #: punching where both NATs allow it (fabricd/_holepunch.py)
    hole_punching: bool = True


@dataclass(frozen=True)
class Config:
    path: Path
    cluster_id: str
    role: str
    capacity: int
    listen: tuple[str, ...]
    announce: tuple[str, ...]
    bootstrap: tuple[str, ...]
    identity_key: Path
    certificate: Path
    ca_public_key: Path
    revocation_list: Path
    bridge_socket: Path
    ray_address: str
    metrics_endpoint: str
    limits: Limits = field(default_factory=Limits)
    #: [metrics] executor_endpoint: where this cluster's executor serves its job metrics
    metrics_executor_endpoint: str = ""
    # bounds of an embedded Ray (ray.address = "local"); 0 = Ray's own default (all CPUs,
    # ~30% of memory for the object store)
    ray_num_cpus: float = 0.0
    ray_object_store_memory: int = 0
    #: [allow] models: modules job classes may come from (built-in classes are always allowed)
    allow_models: tuple[str, ...] = ()
    #: [allow] data_roots: directories job datasets may be read from
    data_roots: tuple[Path, ...] = ()
    #: [datasets] NAME = "KIND:PATH[#options]": the data this cluster holds, for jobs with
    #: data.placement = "pinned" (paths absolute, inside data_roots)
    datasets: tuple[tuple[str, str], ...] = ()
    relay: Relay = field(default_factory=Relay)


def _err(path: Path, key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{path}: key '{key}' has invalid value {value!r}; allowed: {allowed}")


def _section(path: Path, data: dict[str, Any], name: str) -> dict[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise _err(path, name, value, "a [" + name + "] table")
    return value


def _str(path: Path, sect: dict[str, Any], sname: str, key: str, default: str | None = None) -> str:
    value = sect.get(key, default)
    if value is None:
        raise ConfigError(f"{path}: missing key '{sname}.{key}' (a string)")
    if not isinstance(value, str):
        raise _err(path, f"{sname}.{key}", value, "a string")
    return value


def _num(
    path: Path, sect: dict[str, Any], sname: str, key: str, default: float, lo: float, hi: float,
    integer: bool,
) -> Any:
    value = sect.get(key, default)
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not (lo <= value <= hi):
        kind = "an integer" if integer else "a number"
        raise _err(path, f"{sname}.{key}", value, f"{kind} from {lo} to {hi}")
    return value


def _addr_list(path: Path, sect: dict[str, Any], sname: str, key: str, need_p2p: bool) -> tuple[str, ...]:
    value = sect.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _err(path, f"{sname}.{key}", value, "a list of multiaddr strings")
    for item in value:
        try:
            ma = multiaddr.Multiaddr(item)
        except (multiaddr.exceptions.Error, ValueError) as exc:
            raise _err(path, f"{sname}.{key}", item, f"a valid multiaddr ({exc})") from None
        protos = [p.name for p in ma.protocols()]
        if "tcp" not in protos:
            raise _err(path, f"{sname}.{key}", item, "a TCP multiaddr like /ip4/127.0.0.1/tcp/4001")
        if need_p2p and "p2p" not in protos:
            raise _err(path, f"{sname}.{key}", item, "a multiaddr ending in /p2p/<peer id>")
    return tuple(value)


def _path(base: Path, raw: str) -> Path:
    p = Path(os.path.expanduser(raw))
    return p if p.is_absolute() else (base / p)


def short_socket_path(preferred: Path, cluster_id: str) -> Path:
    """Return ``preferred`` if it fits AF_UNIX, else a short stable path under the temp dir."""
    if len(str(preferred)) < MAX_SOCKET_PATH:
        return preferred
    import hashlib

    digest = hashlib.sha256(str(preferred).encode()).hexdigest()[:12]
    # Never a guessable name in a shared directory: the socket goes into a directory of
    # this user's own (created 0700 and checked by fabricd.bridge before binding).
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    base = Path(runtime) if runtime and len(runtime) < MAX_SOCKET_PATH - 40 else Path(tempfile.gettempdir())
    return base / f"fabricd-{os.getuid()}-{digest}" / "bridge.sock"


def ensure_private_dir(directory: Path) -> None:
    """Create ``directory`` (mode 0700) or check an existing one is ours and private.

    Raises OSError naming the directory if another user owns it or may write to it, so
    nobody else can replace or intercept the bridge socket inside it."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = directory.stat()
    if st.st_uid != os.getuid():
        raise OSError(f"{directory} belongs to uid {st.st_uid}, not to this user; the bridge socket "
                      "must live in a directory of our own (set bridge.socket to a private path)")
    if st.st_mode & 0o022:
        raise OSError(f"{directory} (mode {st.st_mode & 0o777:o}) is writable by other users; the "
                      "bridge socket must live in a private directory (chmod 700 it or set bridge.socket)")


def load_config(path: str | os.PathLike[str]) -> Config:
    """Parse and validate ``path``; raise ConfigError naming file, key and allowed values."""
    cfg_path = Path(path).resolve()
    try:
        data = tomllib.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{cfg_path}: file not found (create one with `fabricd init`)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{cfg_path}: not valid TOML: {exc}") from None
    base = cfg_path.parent
    known = {"cluster", "network", "identity", "bridge", "ray", "limits", "metrics", "allow",
             "datasets"}
    for key in data:
        if key not in known:
            raise _err(cfg_path, key, data[key], "sections " + ", ".join(sorted(known)))

    cluster = _section(cfg_path, data, "cluster")
    cluster_id = _str(cfg_path, cluster, "cluster", "id")
    if not cluster_id or len(cluster_id) > 64 or not all(c.isalnum() or c in "-_." for c in cluster_id):
        raise _err(cfg_path, "cluster.id", cluster_id, "1-64 characters of letters, digits, '-', '_', '.'")
    role = _str(cfg_path, cluster, "cluster", "role", "cluster")
    if role not in ROLES:
        raise _err(cfg_path, "cluster.role", role, " or ".join(ROLES))
    capacity = _num(cfg_path, cluster, "cluster", "capacity", 1, 0, 1_000_000, True)

    net = _section(cfg_path, data, "network")
    listen = _addr_list(cfg_path, net, "network", "listen", need_p2p=False)
    if not listen:
        raise ConfigError(f"{cfg_path}: missing key 'network.listen' (e.g. [\"/ip4/0.0.0.0/tcp/4001\"])")
    announce = _addr_list(cfg_path, net, "network", "announce", need_p2p=False)
    bootstrap = _addr_list(cfg_path, net, "network", "bootstrap", need_p2p=True)
    relay = _relay(cfg_path, net, bool(bootstrap))

    ident = _section(cfg_path, data, "identity")
    identity_key = _path(base, _str(cfg_path, ident, "identity", "key", "identity.key"))
    certificate = _path(base, _str(cfg_path, ident, "identity", "certificate", "membership.cert"))
    ca_pub = _path(base, _str(cfg_path, ident, "identity", "ca_public_key", "ca.pub"))
    revocations = _path(base, _str(cfg_path, ident, "identity", "revocation_list", "revoked.txt"))
    # The certificate may still be missing (a signing request at the CA): the daemon says
    # so at start-up, with what to do.
    for key, p in (("identity.key", identity_key), ("identity.ca_public_key", ca_pub)):
        if not p.is_file():
            raise _err(cfg_path, key, str(p), "the path of an existing file (run `fabricd init`)")

    bridge = _section(cfg_path, data, "bridge")
    sock = _path(base, _str(cfg_path, bridge, "bridge", "socket", "bridge.sock"))
    sock = short_socket_path(sock, cluster_id)

    ray = _section(cfg_path, data, "ray")
    ray_address = _str(cfg_path, ray, "ray", "address", "inprocess")
    if ray_address not in RAY_ADDRESS_KINDS and ":" not in ray_address:
        raise _err(cfg_path, "ray.address", ray_address, "local, auto, inprocess or HOST:PORT")
    ray_num_cpus = _num(cfg_path, ray, "ray", "num_cpus", 0, 0, 4096, False)
    ray_object_store_memory = _num(cfg_path, ray, "ray", "object_store_memory", 0, 0, 1 << 44, True)
    if 0 < ray_object_store_memory < 78 * 1024 * 1024:  # Ray refuses less
        raise _err(cfg_path, "ray.object_store_memory", ray_object_store_memory,
                   "0 (Ray's default) or at least 81788928 bytes (78 MiB)")

    metrics = _section(cfg_path, data, "metrics")
    metrics_endpoint = _endpoint(cfg_path, metrics, "endpoint")
    metrics_executor_endpoint = _endpoint(cfg_path, metrics, "executor_endpoint")

    lim = _section(cfg_path, data, "limits")
    defaults = Limits()
    limits = Limits(
        max_update_bytes=_num(cfg_path, lim, "limits", "max_update_bytes", defaults.max_update_bytes, 1, 1 << 40, True),
        max_inflight_bytes=_num(cfg_path, lim, "limits", "max_inflight_bytes", defaults.max_inflight_bytes, 1, 1 << 42, True),
        max_frame_bytes=_num(cfg_path, lim, "limits", "max_frame_bytes", defaults.max_frame_bytes, 1024, MAX_FRAME_LIMIT - 1024, True),
        chunk_bytes=_num(cfg_path, lim, "limits", "chunk_bytes", defaults.chunk_bytes, 1024, 4 * 1024 * 1024, True),
        heartbeat_interval=_num(cfg_path, lim, "limits", "heartbeat_interval", defaults.heartbeat_interval, 0.1, 60, False),
        heartbeat_timeout=_num(cfg_path, lim, "limits", "heartbeat_timeout", defaults.heartbeat_timeout, 0.5, 600, False),
        stream_timeout=_num(cfg_path, lim, "limits", "stream_timeout", defaults.stream_timeout, 1, 3600, False),
        control_timeout=_num(cfg_path, lim, "limits", "control_timeout", defaults.control_timeout, 1, 86400, False),
        auth_timeout=_num(cfg_path, lim, "limits", "auth_timeout", defaults.auth_timeout, 0.5, 600, False),
        min_transfer_rate=_num(cfg_path, lim, "limits", "min_transfer_rate", defaults.min_transfer_rate,
                               1, 1 << 40, False),
        dedup_ids_per_member=_num(cfg_path, lim, "limits", "dedup_ids_per_member",
                                  defaults.dedup_ids_per_member, 16, 1 << 24, True),
        dedup_round_window=_num(cfg_path, lim, "limits", "dedup_round_window", defaults.dedup_round_window,
                                1, 1 << 20, True),
        dataplane_min_bytes=_num(cfg_path, lim, "limits", "dataplane_min_bytes", defaults.dataplane_min_bytes,
                                 0, 1 << 40, True),
        dataplane_digest=_str(cfg_path, lim, "limits", "dataplane_digest", defaults.dataplane_digest),
        dataplane_small_bytes=_num(cfg_path, lim, "limits", "dataplane_small_bytes",
                                   defaults.dataplane_small_bytes, 0, 64 * 1024, True),
        dataplane_spare_bytes=_num(cfg_path, lim, "limits", "dataplane_spare_bytes",
                                   defaults.dataplane_spare_bytes, 0, 1 << 40, True),
    )
    if limits.dataplane_digest not in ("sha256", "blake3"):
        raise _err(cfg_path, "limits.dataplane_digest", limits.dataplane_digest, "'sha256' or 'blake3'")
    if limits.heartbeat_timeout <= limits.heartbeat_interval:
        raise _err(cfg_path, "limits.heartbeat_timeout", limits.heartbeat_timeout,
                   f"a number greater than limits.heartbeat_interval ({limits.heartbeat_interval})")
    if limits.max_update_bytes > limits.max_inflight_bytes:
        raise _err(cfg_path, "limits.max_update_bytes", limits.max_update_bytes,
                   f"at most limits.max_inflight_bytes ({limits.max_inflight_bytes})")

    allow = _section(cfg_path, data, "allow")
    for key in allow:
        if key not in ("models", "data_roots"):
            raise _err(cfg_path, f"allow.{key}", allow[key], "keys allow.models and allow.data_roots")
    allow_models = _str_list(cfg_path, allow, "allow.models", [])
    data_roots = tuple(_path(base, r) for r in _str_list(cfg_path, allow, "allow.data_roots", ["data"]))
    datasets = _datasets(cfg_path, _section(cfg_path, data, "datasets"), base, data_roots)

    return Config(
        path=cfg_path, cluster_id=cluster_id, role=role, capacity=capacity, listen=listen,
        announce=announce, bootstrap=bootstrap, identity_key=identity_key, certificate=certificate,
        ca_public_key=ca_pub, revocation_list=revocations, bridge_socket=sock,
        ray_address=ray_address, metrics_endpoint=metrics_endpoint, limits=limits,
        metrics_executor_endpoint=metrics_executor_endpoint,
        ray_num_cpus=float(ray_num_cpus), ray_object_store_memory=int(ray_object_store_memory),
        allow_models=tuple(allow_models), data_roots=data_roots, datasets=datasets, relay=relay,
    )


def _relay(path: Path, net: dict[str, Any], has_bootstrap: bool) -> Relay:
    d = Relay()
    reach = _str(path, net, "network", "reachability", d.reachability)
    if reach not in REACHABILITY:
        raise _err(path, "network.reachability", reach, " or ".join(REACHABILITY))
    if reach != "public" and not has_bootstrap:
        raise _err(path, "network.reachability", reach, "'public' for a daemon without network.bootstrap "
                   "(a private daemon holds its relay reservations at its bootstrap gateways)")
    service = net.get("relay_service", d.service)
    if not isinstance(service, bool):
        raise _err(path, "network.relay_service", service, "true or false")
    punch = net.get("hole_punching", d.hole_punching)
    if not isinstance(punch, bool):
        raise _err(path, "network.hole_punching", punch, "true or false")

    def num(key: str, default: int, lo: int, hi: int) -> int:
        return int(_num(path, net, "network", key, default, lo, hi, True))

    return Relay(reachability=reach, service=service, hole_punching=punch,
                 max_reservations=num("relay_max_reservations", d.max_reservations, 1, 1 << 16),
                 max_circuits=num("relay_max_circuits", d.max_circuits, 1, 1 << 16),
                 circuit_bytes=num("relay_circuit_bytes", d.circuit_bytes, 0, 1 << 50),
                 circuit_seconds=num("relay_circuit_seconds", d.circuit_seconds, 0, 1 << 30),
                 max_bytes_per_second=num("relay_max_bytes_per_second", d.max_bytes_per_second, 0, 1 << 50),
                 silent_after=float(_num(path, net, "network", "relay_silent_after", d.silent_after, 1.0, 600.0,
                                         False)))


def _datasets(path: Path, sect: dict[str, Any], base: Path,
              roots: tuple[Path, ...]) -> tuple[tuple[str, str], ...]:
    """`[datasets] NAME = "KIND:PATH[#options]"`: each path made absolute (relative to the
    config's directory) and required to lie inside `[allow] data_roots` (symlinks resolved),
    so a pinned job reads only what the operator declared and allowed."""
    out = []
    for name, value in sect.items():
        key = f"datasets.{name}"
        if not _DATASET_NAME.match(name):
            raise _err(path, key, value, "a dataset name of 1-64 letters, digits, '.', '_' or '-'"
                       " (starting with a letter or digit)")
        kind, sep, rest = value.partition(":") if isinstance(value, str) else ("", "", "")
        if not sep or kind + sep not in DATASET_PREFIXES or not rest.partition("#")[0]:
            raise _err(path, key, value, "a string KIND:PATH[#options] with KIND one of "
                       + ", ".join(p.rstrip(":") for p in DATASET_PREFIXES)
                       + ' (e.g. "npz:data/site-a.npz"; relative paths start at this file)')
        raw, hash_, options = rest.partition("#")
        resolved = _path(base, raw)
        real = Path(os.path.realpath(resolved))
        if not any(real == Path(os.path.realpath(r)) or Path(os.path.realpath(r)) in real.parents
                   for r in roots):
            raise _err(path, key, value, f"a path inside [allow] data_roots (it reads {real}; "
                       f"data_roots: {', '.join(str(r) for r in roots) or 'none'}); move the "
                       "file or add its directory to [allow] data_roots")
        out.append((name, f"{kind}:{resolved}{hash_}{options}"))
    return tuple(out)


def _endpoint(path: Path, metrics: dict[str, Any], key: str) -> str:
    """metrics.<key>: empty (off) or HOST:PORT."""
    value = _str(path, metrics, "metrics", key, "")
    if value:
        from fabricd.metrics import parse_endpoint

        try:
            parse_endpoint(value)
        except ValueError as exc:
            raise _err(path, f"metrics.{key}", value, f"empty (off) or {exc}") from None
    return value


def _str_list(path: Path, sect: dict[str, Any], key: str, default: list[str]) -> list[str]:
    value = sect.get(key.rpartition(".")[2], default)
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise _err(path, key, value, "a list of non-empty strings")
    return value


def render_config(
    *, cluster_id: str, role: str, capacity: int, listen: list[str], bootstrap: list[str],
    announce: list[str] | None = None,
) -> str:
    """The text of a fresh cluster.toml whose files live next to it."""

    def arr(items: list[str]) -> str:
        return "[" + ", ".join(f'"{i}"' for i in items) + "]"

    return f"""# fabricd cluster configuration (written by `fabricd init`)
[cluster]
id = "{cluster_id}"
role = "{role}"          # cluster | scheduler (must match the certificate)
capacity = {capacity}

[network]
listen = {arr(listen)}
announce = {arr(announce or [])}
bootstrap = {arr(bootstrap)}

[identity]
key = "identity.key"            # libp2p ed25519 identity, mode 0600
certificate = "membership.cert" # signed by the federation CA
ca_public_key = "ca.pub"
revocation_list = "revoked.txt" # one revoked serial per line; re-read while running

[bridge]
socket = "bridge.sock"          # Unix socket (mode 0600) for executors and the CLI

[ray]
address = "inprocess"           # local | auto | inprocess | HOST:PORT
num_cpus = 0                    # embedded Ray ("local"): CPUs it may use; 0 = all
object_store_memory = 0         # embedded Ray: object store bytes; 0 = Ray's default

[limits]
max_update_bytes = {Limits.max_update_bytes}
max_inflight_bytes = {Limits.max_inflight_bytes}
heartbeat_interval = 1.0
heartbeat_timeout = 5.0

[metrics]
endpoint = ""                   # HOST:PORT serves Prometheus text at /metrics; "" = off

# The data this cluster holds, for jobs with data.placement = "pinned" (docs/job.md):
# NAME = "KIND:PATH" (KIND npz, csv, parquet or imagefolder; PATH inside [allow] data_roots)
# [datasets]
# site = "npz:data/site.npz"
"""
