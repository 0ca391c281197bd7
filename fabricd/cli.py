"""The ``fabricd`` command line (console script ``fabricd`` -> ``fabricd.cli:main``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from fabricd.config import ConfigError, load_config, render_config
from fabricd.errors import FabricdError
from fedcore.logs import LOG_FORMATS
from proto.errors import ProtocolError

EXIT_USAGE = 2
EXIT_FAILED = 1


class CliError(FabricdError):
    """A problem the user can act on; printed without a traceback."""


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False))


# ---- run -------------------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> int:
    import trio

    from fabricd.daemon import Daemon, StartupError, load_credentials
    from fedcore.logs import setup_logging

    setup_logging(args.log_format, args.log_level)
    config = load_config(args.config)
    try:
        creds = load_credentials(config)
    except StartupError as exc:
        raise CliError(str(exc)) from None
    trio.run(Daemon(config, creds).run)  # until SIGTERM/SIGINT
    return 0


# ---- certs -----------------------------------------------------------------------------

def cmd_init_ca(args: argparse.Namespace) -> dict[str, Any]:
    from proto.certs import save_ca

    out = Path(args.out)
    try:
        save_ca(out)
    except (FileExistsError, ValueError) as exc:
        raise CliError(str(exc)) from None
    return {"ca_key": str(out / "ca.key"), "ca_pub": str(out / "ca.pub")}


def _issue(ca_dir: Path, peer_id: str, cluster_id: str, role: str, days: float,
           allow_readable: bool = False) -> bytes:
    from proto.certs import ed25519_public_from_peer_id, issue_certificate, load_ca_private

    try:
        ca_key = load_ca_private(ca_dir, allow_readable=allow_readable)
    except (ValueError, OSError) as exc:
        raise CliError(f"cannot load the CA key from {ca_dir}: {exc}") from None
    try:
        public = ed25519_public_from_peer_id(peer_id)
    except ValueError as exc:  # bad base58, or not an ed25519 peer id
        raise CliError(f"--peer-id {peer_id!r} is not an ed25519 libp2p peer id: {exc}") from None
    now = int(time.time()) - 60
    try:
        return issue_certificate(ca_key, public, cluster_id, role, not_before=now,
                                 not_after=now + int(days * 86400))
    except (ProtocolError, ValueError) as exc:  # InvalidMessage / ValueError with a reason
        raise CliError(f"cannot issue certificate: {exc}") from None


SIGNING_REQUEST = "signing-request.json"


def _read_request(path: Path) -> dict[str, str]:
    """A signing request written by `fabricd init` on a head node without ca.key."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CliError(f"--request {path}: cannot read the signing request: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("peer_id", "cluster_id", "role")):
        raise CliError(f"--request {path}: expected JSON with string fields peer_id, cluster_id and role "
                       "(as written by `fabricd init` without ca.key)")
    return {k: data[k] for k in ("peer_id", "cluster_id", "role")}


def cmd_issue(args: argparse.Namespace) -> dict[str, Any]:
    from proto.certs import parse_certificate

    if args.request:
        request = _read_request(Path(args.request))
        for key in ("peer_id", "cluster_id"):
            given = getattr(args, key)
            if given and given != request[key]:
                raise CliError(f"--{key.replace('_', '-')} {given!r} differs from the request's {request[key]!r}")
        args.peer_id, args.cluster_id = request["peer_id"], request["cluster_id"]
        args.role = request["role"] if args.role is None else args.role
    if not args.peer_id or not args.cluster_id:
        raise CliError("give --request FILE, or both --peer-id and --cluster-id")
    data = _issue(Path(args.ca), args.peer_id, args.cluster_id, args.role or "cluster", args.days,
                  allow_readable=args.allow_readable_ca_key)
    Path(args.out).write_bytes(data)
    cert = parse_certificate(data)
    return {"certificate": args.out, "peer_id": cert.peer_id, "cluster_id": cert.cluster_id,
            "role": cert.role, "serial": cert.serial, "not_after": cert.not_after}


def cmd_revoke(args: argparse.Namespace) -> dict[str, Any]:
    from proto.certs import RevocationList, parse_certificate

    try:
        cert = parse_certificate(Path(args.cert).read_bytes())
    except (OSError, ProtocolError) as exc:
        raise CliError(f"cannot read certificate {args.cert}: {exc}") from None
    if args.ca:
        return _revoke_signed(args, cert.serial, cert.cluster_id, cert.peer_id)
    if not args.config:
        raise CliError("give --config (revoke on this daemon only) or --ca and --out (a CA-signed list "
                       "for the whole federation)")
    config = load_config(args.config)
    RevocationList.append(config.revocation_list, cert.serial,
                          comment=f"{cert.cluster_id} {cert.peer_id} revoked {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
    return {"revoked_serial": cert.serial, "cluster_id": cert.cluster_id,
            "peer_id": cert.peer_id, "revocation_list": str(config.revocation_list)}


def _revoke_signed(args: argparse.Namespace, serial: int, cluster_id: str, peer_id: str) -> dict[str, Any]:
    """Add ``serial`` to the CA-signed revocation list at --out (created if missing)."""
    from proto.certs import load_ca_private, sign_revocations, verify_revocations

    try:
        ca_key = load_ca_private(Path(args.ca), allow_readable=args.allow_readable_ca_key)
    except (ValueError, OSError) as exc:
        raise CliError(f"cannot load the CA key from {args.ca}: {exc}") from None
    if not args.out:
        raise CliError("--ca needs --out FILE: the signed revocation list to create or extend")
    out = Path(args.out)
    serials: set[int] = set()
    previous = 0
    if out.exists():
        try:
            current = verify_revocations(out.read_bytes(), ca_key.public_key())
        except (OSError, ProtocolError) as exc:
            raise CliError(f"{out}: not a revocation list signed by this CA: {exc}") from None
        serials, previous = set(current.serials), current.issued_at
    serials.add(serial)
    issued_at = max(int(time.time()), previous + 1)  # strictly newer, or members ignore it
    out.write_bytes(sign_revocations(ca_key, serials, issued_at))
    return {"revoked_serial": serial, "cluster_id": cluster_id, "peer_id": peer_id,
            "signed_revocations": str(out), "serials": len(serials), "issued_at": issued_at,
            "next": "copy it to any member as <config dir>/revocations.signed; every member "
                    "applies it within seconds"}


# ---- init / id -------------------------------------------------------------------------

def cmd_init(args: argparse.Namespace) -> dict[str, Any]:
    import shutil

    from fabricd.config import _addr_list  # validation shared with load_config
    from fabricd.identity import create_identity, peer_id_of

    out = Path(args.out)
    cfg_path = out / "cluster.toml"
    if cfg_path.exists():
        raise CliError(f"{cfg_path} already exists; choose another --out or remove it")
    pseudo = Path("<command line>")
    _addr_list(pseudo, {"listen": args.listen}, "--listen", "listen", need_p2p=False)
    _addr_list(pseudo, {"bootstrap": args.bootstrap}, "--bootstrap", "bootstrap", need_p2p=True)
    ca_dir = Path(args.ca)
    if not (ca_dir / "ca.pub").is_file():
        raise CliError(f"--ca {ca_dir}: no ca.pub there (create a CA with `fabricd certs init-ca --out DIR`)")
    out.mkdir(parents=True, exist_ok=True)
    key_pair = create_identity(out / "identity.key")
    peer_id = str(peer_id_of(key_pair))
    request_path: Path | None = None
    if (ca_dir / "ca.key").is_file():
        cert = _issue(ca_dir, peer_id, args.cluster_id, args.role, args.days,
                      allow_readable=args.allow_readable_ca_key)
        (out / "membership.cert").write_bytes(cert)
    else:
        # A head node without the CA key: write what the CA operator needs to sign.
        request_path = out / SIGNING_REQUEST
        request_path.write_text(json.dumps({"peer_id": peer_id, "cluster_id": args.cluster_id,
                                            "role": args.role}, indent=2) + "\n")
    shutil.copyfile(ca_dir / "ca.pub", out / "ca.pub")
    (out / "revoked.txt").touch()
    cfg_path.write_text(render_config(
        cluster_id=args.cluster_id, role=args.role, capacity=args.capacity, listen=args.listen,
        bootstrap=args.bootstrap, announce=args.announce,
    ))
    config = load_config(cfg_path)  # what we wrote must load
    return {"config": str(cfg_path), "cluster_id": config.cluster_id, "peer_id": peer_id,
            "addrs": _full_addrs(config.announce or config.listen, peer_id),
            "bridge_socket": str(config.bridge_socket),
            **({"signing_request": str(request_path),
                "next": f"on the CA machine: fabricd certs issue --ca CA_DIR --request {request_path.name} "
                        f"--out membership.cert; then copy membership.cert to {out}/"}
               if request_path is not None else {})}


def _full_addrs(addrs: tuple[str, ...] | list[str], peer_id: str) -> list[str]:
    return [a if "/p2p/" in a else f"{a}/p2p/{peer_id}" for a in addrs]


def cmd_id(args: argparse.Namespace) -> dict[str, Any]:
    from fabricd.identity import IdentityError, peer_id_of, read_identity

    config = load_config(args.config)
    try:
        peer_id = str(peer_id_of(read_identity(config.identity_key)))
    except IdentityError as exc:
        raise CliError(str(exc)) from None
    return {"cluster_id": config.cluster_id, "peer_id": peer_id,
            "addrs": _full_addrs(config.announce or config.listen, peer_id)}


# ---- talking to the running daemon -----------------------------------------------------

def _bridge_request(config_path: str, msg: Any, reply_type: type, timeout: float) -> Any:
    """The daemon's reply to `msg`, which must be a `reply_type`; CliError otherwise."""
    from proto.bridge import BridgeClient, Error

    config = load_config(config_path)
    try:
        with BridgeClient(str(config.bridge_socket), role="cli", cluster_id=config.cluster_id,
                          timeout=timeout) as client:
            reply, _ = client.request(msg)
    except ConnectionError as exc:
        raise CliError(str(exc)) from None
    except (TimeoutError, OSError) as exc:
        raise CliError(f"no reply from fabricd at {config.bridge_socket}: {exc}") from None
    except (ProtocolError, EOFError) as exc:
        raise CliError(f"bad reply from fabricd at {config.bridge_socket}: {exc}") from None
    if isinstance(reply, Error):
        raise CliError(reply.reason)
    if not isinstance(reply, reply_type):
        raise CliError(f"unexpected reply {reply.TYPE} to {msg.TYPE}")
    return reply


def cmd_status(args: argparse.Namespace) -> dict[str, Any]:
    from proto.bridge import StatusReply, StatusRequest

    return _bridge_request(args.config, StatusRequest(), StatusReply, args.timeout).status


def cmd_probe(args: argparse.Namespace) -> dict[str, Any]:
    from proto.bridge import ProbeReply, ProbeRequest

    reply = _bridge_request(args.config, ProbeRequest(cluster_id=args.cluster, bytes=args.bytes),
                            ProbeReply, args.timeout)
    return {"cluster_id": reply.cluster_id, "rtt_ms": round(reply.rtt_ms, 3), "bytes": reply.bytes,
            "seconds": round(reply.seconds, 6), "throughput_mb_s": round(reply.throughput_mb_s, 2),
            "path": reply.path}


# ---- parser ----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fabricd",
        description="fedpilot-fabric cluster daemon. Without a subcommand, runs the daemon "
                    "described by --config until SIGTERM/SIGINT.",
        epilog="Quick start: fabricd certs init-ca --out ca; fabricd init --cluster-id a "
               "--listen /ip4/127.0.0.1/tcp/4001 --ca ca --out a; fabricd --config a/cluster.toml",
    )
    p.add_argument("--config", help="cluster.toml of the daemon to run")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="kv",
                   help="one line per event: key=value (kv or text, the default) or JSON")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    certs = sub.add_parser("certs", help="federation CA and membership certificates")
    csub = certs.add_subparsers(dest="certs_command", metavar="CERTS_COMMAND", required=True)
    c = csub.add_parser("init-ca", help="create a federation CA: DIR/ca.key (0600) and DIR/ca.pub")
    c.add_argument("--out", required=True, metavar="DIR")
    c.set_defaults(func=cmd_init_ca)
    c = csub.add_parser("issue", help="sign a membership certificate for a peer id or a signing request")
    c.add_argument("--ca", required=True, metavar="DIR", help="directory holding ca.key")
    c.add_argument("--request", metavar="FILE",
                   help=f"a {SIGNING_REQUEST} written by `fabricd init` on a node without ca.key")
    c.add_argument("--peer-id", help="the daemon's peer id (see `fabricd id`)")
    c.add_argument("--cluster-id")
    c.add_argument("--role", choices=("cluster", "scheduler"), default=None,
                   help="default: the request's, else cluster")
    c.add_argument("--allow-readable-ca-key", action="store_true",
                   help="use a ca.key that other users can read (refused otherwise)")
    c.add_argument("--days", type=float, default=365.0, help="validity in days (default 365)")
    c.add_argument("--out", required=True, metavar="CERTFILE")
    c.set_defaults(func=cmd_issue)
    c = csub.add_parser("revoke", help="revoke a certificate: on one daemon (--config: appended to its "
                                       "revoked.txt) or federation-wide (--ca --out: a CA-signed list "
                                       "that spreads over gossip); applied within seconds, no restart")
    c.add_argument("--config", dest="config")
    c.add_argument("--ca", metavar="DIR", help="directory holding ca.key (federation-wide revocation)")
    c.add_argument("--out", metavar="FILE", help="the signed revocation list to create or extend")
    c.add_argument("--allow-readable-ca-key", action="store_true",
                   help="use a ca.key that other users can read (refused otherwise)")
    c.add_argument("--cert", required=True, metavar="CERTFILE")
    c.set_defaults(func=cmd_revoke)

    c = sub.add_parser("init", help="create DIR/cluster.toml, an identity key and a CA-signed certificate")
    c.add_argument("--cluster-id", required=True)
    c.add_argument("--listen", action="append", required=True, metavar="MULTIADDR",
                   help="e.g. /ip4/0.0.0.0/tcp/4001 (repeatable)")
    c.add_argument("--announce", action="append", default=[], metavar="MULTIADDR",
                   help="address others should dial, if not the listen address (repeatable)")
    c.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                   help="a peer to join through, ending in /p2p/<peer id> (repeatable)")
    c.add_argument("--ca", required=True, metavar="DIR",
                   help="directory holding ca.pub, and ca.key to sign here; without ca.key a "
                        f"{SIGNING_REQUEST} is written for the CA operator (`certs issue --request`)")
    c.add_argument("--out", required=True, metavar="DIR")
    c.add_argument("--allow-readable-ca-key", action="store_true",
                   help="use a ca.key that other users can read (refused otherwise)")
    c.add_argument("--role", choices=("cluster", "scheduler"), default="cluster")
    c.add_argument("--capacity", type=int, default=1, help="how many virtual nodes this cluster hosts")
    c.add_argument("--days", type=float, default=365.0, help="certificate validity in days")
    c.set_defaults(func=cmd_init)

    c = sub.add_parser("id", help="print this daemon's peer id and full multiaddrs (JSON)")
    c.add_argument("--config", dest="config", required=True)
    c.set_defaults(func=cmd_id)
    c = sub.add_parser("status", help="ask the running daemon for its status (JSON)")
    c.add_argument("--config", dest="config", required=True)
    c.add_argument("--timeout", type=float, default=10.0)
    c.set_defaults(func=cmd_status)
    c = sub.add_parser("probe", help="send N bytes as one verified update stream to a cluster (JSON)")
    c.add_argument("--config", dest="config", required=True)
    c.add_argument("--cluster", required=True, help="target cluster id")
    c.add_argument("--bytes", type=int, default=16 * 1024 * 1024, help="bytes to send (default 16 MiB)")
    c.add_argument("--timeout", type=float, default=300.0)
    c.set_defaults(func=cmd_probe)
    return p


def call(argv: list[str]) -> dict[str, Any]:
    """A one-shot subcommand (``certs init-ca``, ``init``, ``id``, ...) run in this process:
    the JSON it would print. Raises CliError or ConfigError where the command line would
    print them (a testbed initialises its daemons this way: one import of libp2p, not one
    per daemon)."""
    args = build_parser().parse_args(argv)
    if args.command is None:
        raise CliError("call() runs one-shot subcommands; start a daemon with `fabricd --config`")
    result: dict[str, Any] = args.func(args)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None and not args.config:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        if args.command is None:
            return cmd_run(args)
        _print_json(args.func(args))  # every subcommand answers in JSON
        return 0
    except ConfigError as exc:
        print(f"fabricd: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CliError as exc:
        print(f"fabricd: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
