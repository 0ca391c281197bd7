"""`fedpilot-scheduler`: one argparse program, one subcommand per module.

Each module in SUBCOMMANDS exposes `add_parser(subparsers)`, which adds its subcommand and
sets `func(args) -> int`. Adding a subcommand is adding a module name here.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from fedcore.logs import LOG_FORMATS, setup_logging
from proto.errors import ProtocolError
from scheduler.errors import JobSpecError, SchedulerError

SUBCOMMANDS = ("scheduler.plan_cli", "scheduler.submit", "scheduler.rundir.status")
PROG = "fedpilot-scheduler"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Plan and run federated-learning jobs across Ray clusters joined by "
                    "fabricd. `plan` computes the placement and routing matrix without "
                    "training; `submit` runs the job.")
    parser.add_argument("--log-level", default="WARNING",
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="logging threshold (default WARNING); logs go to stderr")
    parser.add_argument("--log-format", default="kv", choices=LOG_FORMATS,
                        help="one line per event as key=value (kv, or text: the default) or "
                             "JSON, as fabricd logs")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code. Input a user can
    fix (bad job file, clusters, capacity, files) is one line on stderr and exit code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_format, args.log_level)
    try:
        return int(args.func(args))
    except (JobSpecError, SchedulerError, ProtocolError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:  # e.g. the partitioner refusing an impossible split
        print(f"{PROG}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
