#!/usr/bin/env bash
# `make wan-demo`: the digits job across the WAN testbed (`netns-testbed.sh up --wan`):
# three sites, each behind a NAT router of its own, that reach each other only through the
# gateway's relay (docs/deploy.md). Brings the testbed up from nothing (root; iproute2 and
# iptables installed best effort), trains the job from the gateway's namespace, writes
# runs/wan-demo/ (summary.json, wan-bytes.json), prints where the update bytes went and
# tears everything down, also on Ctrl-C or a failure.
#
#   deploy/wan-demo.sh [--job FILE] [--out DIR] [--flat] [--slow ID=FACTOR ...]
#
# --flat runs the same job on the flat testbed (every site dials every other), to compare.
# --slow b=4: site b trains under 1/4 of a fair CPU share (the testbed's FP_SLOW), as
# `submit --local --slow`; with `[aggregation] mode = "buffered"` the others do not wait.
# Environment: the testbed's (FP_WAN_RTT_MS, FP_WAN_LOSS, FP_WAN_RATE, FP_RAY, FP_SLOW, ...), and
# FP_NETNS_PREFIX (fpwan), FP_STATE_DIR (/tmp/$FP_NETNS_PREFIX-testbed), FP_CAPACITY (10).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
job=$repo/deploy/examples/digits.toml
out=$repo/runs/wan-demo
mode=--wan
while [ $# -gt 0 ]; do
    case "$1" in
        --job) job=$(realpath "${2:?--job needs a file}"); shift 2 ;;
        --out) out=$(realpath -m "${2:?--out needs a directory}"); shift 2 ;;
        --flat) mode=""; shift ;;
        --slow) FP_SLOW="${FP_SLOW:-} ${2:?--slow needs ID=FACTOR}"; export FP_SLOW; shift 2 ;;
        *) sed -n '2,15s/^# \{0,1\}//p' "$0" >&2; exit 2 ;;
    esac
done

log() { echo "wan-demo: $*" >&2; }
[ "$(id -u)" -eq 0 ] || { log "needs root (network namespaces, NAT routers)"; exit 1; }
for pair in ip:iproute2 tc:iproute2 iptables:iptables; do
    command -v "${pair%%:*}" >/dev/null 2>&1 && continue
    log "installing ${pair#*:} (apt-get, best effort)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pair#*:}" >/dev/null 2>&1 \
        || log "could not install ${pair#*:}; the testbed will say what is missing"
done

export FP_NETNS_PREFIX=${FP_NETNS_PREFIX:-fpwan}
export FP_STATE_DIR=${FP_STATE_DIR:-/tmp/$FP_NETNS_PREFIX-testbed}
export FP_SCHEDULER=1 FP_CLUSTERS="a b c"
# 10 clients a site: the job's 30 spread over the three (at the testbed's 32 the locality
# placement put them all on one site, and no model crossed the WAN)
export FP_CAPACITY=${FP_CAPACITY:-10}
bin=$(dirname "${FABRICD:-$repo/.venv/bin/fabricd}")  # FABRICD: as for the testbed
testbed=$here/netns-testbed.sh
trap '"$testbed" down >/dev/null 2>&1 || true' EXIT
trap 'log interrupted; exit 130' INT TERM

# shellcheck disable=SC2086  # $mode is one flag or none
"$testbed" up $mode
status() { "$bin/fabricd" status --config "$FP_STATE_DIR/$1/cluster.toml"; }
log "waiting for the mesh"
for _ in $(seq 240); do
    if status scheduler | "$bin/python" -c '
import json, sys
s = json.load(sys.stdin)
sys.exit(0 if sum(c["connected"] for c in s["clusters"]) == 3 else 1)'; then break; fi
    sleep 0.5
done
rm -rf -- "$out"
mkdir -p "$out"
"$testbed" exec scheduler "$bin/fedpilot-scheduler" submit "$job" --mesh "$FP_STATE_DIR/scheduler/cluster.toml" \
    --clusters a,b,c --out "$out" --wait 120 --quiet | tail -n 1

# Where the bytes went: each daemon's acknowledged update bytes by path, the gateway's relay.
for c in a b c scheduler; do echo "$c $(status "$c" | tr -d '\n')"; done | "$bin/python" -c '
import json, sys
report = {}
for line in sys.stdin:
    cid, _, text = line.partition(" ")
    s = json.loads(text)
    report[cid] = {"bytes_by_path": s["transfer"]["bytes_by_path"],
                   "links": {c["cluster_id"]: c["link"] for c in s["clusters"]}}
    if "service" in s["relay"]:
        report[cid]["relay"] = s["relay"]["service"]
for cid, r in report.items():
    paths = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(r["bytes_by_path"].items()) if v) or "none"
    print("%9s: sent %s; links %s" % (cid, paths, r["links"]))
    if "relay" in r:
        rel = r["relay"]
        print("%9s  relayed for the sites: %.1f MB over %d circuits, %.1f MB over %d data-plane splices"
              % ("", rel["bytes_relayed"] / 1e6, rel["circuits_opened"], rel.get("bytes_spliced", 0) / 1e6,
                 rel.get("splices_joined", 0)))
summary = json.load(open(sys.argv[2]))
seconds = sorted(r["seconds"] for r in summary["rounds"])
report["job"] = {"final_accuracy": summary["final_accuracy"], "rounds": len(seconds),
                 "round_seconds_median": seconds[len(seconds) // 2] if seconds else None,
                 "seconds_total": summary["seconds_total"], "uplink": sys.argv[3]}
json.dump(report, open(sys.argv[1], "w"), indent=1)
print("job: final accuracy %(final_accuracy).4f, %(rounds)d rounds, median round %(round_seconds_median).2f s,"
      " %(seconds_total).1f s in all; uplinks %(uplink)s" % {**report["job"], "uplink": sys.argv[3] or "flat"})
' "$out/wan-bytes.json" "$out/summary.json" \
    "${mode:+RTT ${FP_WAN_RTT_MS:-40} ms, loss ${FP_WAN_LOSS:-0.1} %, ${FP_WAN_RATE:-100mbit}}"
log "results in $out"
