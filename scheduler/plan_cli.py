"""`fedpilot-scheduler plan`: placement and routing matrix of a job, without training."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from proto.job import PLACEMENT_STRATEGIES
from proto.rounds import clients_per_round
from scheduler.jobfile import load_job
from scheduler.planning.clusters import ClusterSlot, parse_clusters
from scheduler.planning.placement.histograms import synthetic_histograms
from scheduler.planning.plan import Plan, plan_job
from scheduler.planning.topology import topology_warnings
from scheduler.rundir.placement import results_routing, routing_json

COMPARE = ("random", "round_robin")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan", help="compute placement and routing matrix only (no training)",
        description="Profile the job's clients (label histograms of the job's own "
                    "deterministic partition), find data communities (Affinity Propagation), "
                    "place them on the clusters within capacity and build the routing "
                    "matrix. Prints communities, clients per cluster, intra/inter-cluster "
                    "edge counts and seconds per stage.")
    p.add_argument("job", metavar="JOB_TOML", help="the job file (see docs/job.md)")
    p.add_argument("--clusters", metavar="ID:CAP,...",
                   help="the physical clusters and how many clients each can host, e.g. "
                        "a:100,b:100,c:100 (default: three clusters a,b,c sharing "
                        "data.number_of_clients evenly)")
    p.add_argument("--strategy", choices=PLACEMENT_STRATEGIES,
                   help="override placement.strategy from the job file")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of text; it includes a 'compare' "
                        "field with the inter-cluster edge counts of random and round_robin")
    p.add_argument("--out", metavar="DIR",
                   help="write placement.json (client -> cluster, client -> community), "
                        "routing.msgpack (wire form), routing.json (readable) and plan.json "
                        "into DIR (created if missing)")
    p.add_argument("--synthetic-histograms", action="store_true",
                   help="profile with synthetic Dirichlet(data.dirichlet_beta) histograms "
                        "instead of partitioning the dataset (plans any number of clients)")
    p.set_defaults(func=run)


def default_clusters(num_clients: int) -> list[ClusterSlot]:
    cap = math.ceil(num_clients / 3)
    return [ClusterSlot(c, cap) for c in ("a", "b", "c")]


def run(args: argparse.Namespace) -> int:
    spec = load_job(args.job)
    n = spec.data.number_of_clients
    slots = parse_clusters(args.clusters) if args.clusters else default_clusters(n)
    histograms, model_bytes, lowered = None, None, ""
    if args.synthetic_histograms:
        histograms = synthetic_histograms(n, beta=spec.data.dirichlet_beta, seed=spec.seed)
    else:
        # Labels 0..C-1 here; the model's output size and bytes in a child (plan never
        # imports torch).
        from fedcore.data.preflight import check_before_start, with_checked_learning_rate

        checked = check_before_start(spec, str(args.job), measure=True)
        model_bytes = checked.model_bytes
        spec, lowered = with_checked_learning_rate(spec, checked)
        if lowered:
            print(lowered, file=sys.stderr)
    scaled = data_scaling(spec) if histograms is None else None
    plan = plan_job(spec, slots, strategy=args.strategy, histograms=histograms,
                    compare=COMPARE if args.json else ())
    if args.out:
        write_plan(plan, Path(args.out))
    summary = plan.summary()
    if model_bytes is not None:
        summary["model_bytes"] = model_bytes
    if lowered:
        summary["learning_rate_check"] = lowered
    if spec.privacy.dp != "none":
        summary["privacy"] = privacy_noise(spec, model_bytes)
    if scaled is not None:
        summary["data_scaling"] = scaled
    if warnings := topology_warnings(spec):
        summary["warnings"] = warnings
    if args.json:
        json.dump(summary, sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_summary(summary))
    return 0


def write_plan(plan: Plan, out: Path) -> None:
    """placement.json, routing.msgpack, routing.json and plan.json in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "placement.json").write_text(json.dumps(plan.placement.to_dict(), indent=1) + "\n")
    (out / "routing.msgpack").write_bytes(plan.routing.to_bytes())
    (out / "routing.json").write_bytes(routing_json(results_routing(plan.routing)))
    (out / "plan.json").write_text(json.dumps(plan.summary(), indent=1) + "\n")


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"job {s['job_id']}: {s['clients']} clients, topology {s['topology']}, "
        f"strategy {s['strategy']}",
        f"communities: {s['communities']}",
        "clients per cluster: " + ", ".join(f"{c}={k}" for c, k in
                                            s["clients_per_cluster"].items()),
        f"edges: intra={s['edges']['intra']} inter={s['edges']['inter']}"
        + (f", mixing steps per round: {s['mixing_steps']}" if s.get("mixing_steps", 1) > 1
           else ""),
        transfers_line(s),
        *([privacy_line(s["privacy"])] if "privacy" in s else []),
        *([scaling_line(s["data_scaling"])] if s.get("data_scaling", {}).get("applied") else []),
        "seconds: " + " ".join(f"{k}={v:.3f}" for k, v in s["stage_seconds"].items()),
        *(f"warning: {w}" for w in s.get("warnings", ())),
    ]
    return "\n".join(lines) + "\n"


def data_scaling(spec: Any) -> dict[str, Any] | None:
    """What data.standardize does to a simulated job's samples (`fedcore.data.scaling`):
    standardize, applied, groups, largest. None for a pinned job, whose statistics come
    from its sites' own samples when it starts (`fedcore.data.shared_scaling`)."""
    if spec.data.placement == "pinned":
        return None
    from fedcore.data import load_dataset, scaling

    found = scaling(load_dataset(spec.data.dataset), spec.data)
    return {k: found[k] for k in ("standardize", "applied", "groups", "largest")}


def scaling_line(d: dict[str, Any]) -> str:
    return (f"data: standardized over {d['groups']} feature(s) or channel(s) by the training "
            f"samples' mean and sd (largest mean or sd {d['largest']:.3g}; data.standardize "
            f"= {d['standardize']!r})")


def privacy_noise(spec: Any, model_bytes: int | None) -> dict[str, Any]:
    """The DP noise the job's rounds will add, before it runs: the noise multiplier (from
    the budget where the job gives one) and, where the model's size is known, the norm of
    the noise on a round's mean update in clip norms (float32 parameters assumed)."""
    from fedcore import dp

    p, t = spec.privacy, spec.training
    z = dp.multiplier(p.noise_multiplier, p.epsilon, p.delta, dp.sampling_rate(p.dp, t.client_fraction),
                      t.federated_learning_rounds)
    clients = clients_per_round(spec.data.number_of_clients, t.client_fraction)
    out: dict[str, Any] = {"dp": p.dp, "noise_multiplier": round(z, 4), "epsilon": p.epsilon,
                           "delta": p.delta, "rounds": t.federated_learning_rounds,
                           "clients_per_round": clients}
    if model_bytes:
        out["parameters"] = model_bytes // 4
        out["noise_over_clip_norm"] = round(
            dp.noise_over_clip(z, model_bytes // 4, clients, local=p.dp == "local"), 3)
    return out


def privacy_line(p: dict[str, Any]) -> str:
    budget = f"epsilon {p['epsilon']:g}, " if p["epsilon"] is not None else ""
    line = (f"privacy: {p['dp']} DP, noise multiplier {p['noise_multiplier']:.3g} "
            f"({budget}delta {p['delta']:g}, {p['rounds']} rounds of "
            f"{p['clients_per_round']} clients)")
    if "noise_over_clip_norm" in p:
        line += (f"; noise on a round's mean update: norm {p['noise_over_clip_norm']:.2f} x "
                 f"clip_norm over ~{p['parameters']:,} parameters, where the clipped updates' "
                 "mean is at most 1 x clip_norm (docs/security.md, Privacy: it grows with "
                 "sqrt(parameters) and falls with the clients a round)")
    return line


def transfers_line(s: dict[str, Any]) -> str:
    """Model transfers between clusters per round against star's on the same placement,
    in bytes where the model's size is known (uncompressed; [transfer] compression cuts it)."""
    ours, star = s["inter_cluster_transfers_per_round"], s["star_inter_cluster_transfers_per_round"]
    size = s.get("model_bytes")
    line = f"between clusters per round: {ours} model transfers (star: {star})"
    if size:
        line += f", {ours * size / 1e6:.2f} MB (star: {star * size / 1e6:.2f} MB) of a {size / 1e6:.2f} MB model"
    return line
