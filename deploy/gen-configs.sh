#!/usr/bin/env bash
# Generate a federation: one CA, one cluster.toml (+ identity + membership certificate)
# per cluster, and optionally a scheduler config. The first --cluster is the bootstrap
# peer of all the others; its full multiaddr (ending in /p2p/<peer id>) is written to
# OUT/bootstrap.addr.
#
# Used by the docker-compose `certs` one-shot service and by netns-testbed.sh. Re-running
# it keeps every config (and so every peer id) that already exists: identities are stable
# across restarts.
#
#   gen-configs.sh --out DIR [--ca DIR] [--port N] [--ray ADDRESS] [--capacity N]
#                  --cluster ID=IP [--cluster ID=IP]... [--scheduler IP]
#
# --capacity is how many virtual clients each cluster may host (default 32): a job's
# number_of_clients must fit into the clusters' total.
#
# Environment: FABRICD (the fabricd executable, default: `fabricd` on PATH),
#              PYTHON (a python3 to read fabricd's JSON, default: python3).
set -euo pipefail

FABRICD=${FABRICD:-fabricd}
PYTHON=${PYTHON:-python3}

usage() {
    sed -n '2,18s/^# \{0,1\}//p' "$0" >&2
    exit 2
}

die() {
    echo "gen-configs: $*" >&2
    exit 1
}

out=""
ca=""
port=4001
ray="auto"
capacity=32
scheduler_ip=""
clusters=()

while [ $# -gt 0 ]; do
    case "$1" in
        --out) out=${2:?--out needs a directory}; shift 2 ;;
        --ca) ca=${2:?--ca needs a directory}; shift 2 ;;
        --port) port=${2:?--port needs a number}; shift 2 ;;
        --ray) ray=${2:?--ray needs local, auto, inprocess or HOST:PORT}; shift 2 ;;
        --capacity) capacity=${2:?--capacity needs a number}; shift 2 ;;
        --cluster) clusters+=("${2:?--cluster needs ID=IP}"); shift 2 ;;
        --scheduler) scheduler_ip=${2:?--scheduler needs an IP}; shift 2 ;;
        -h|--help) usage ;;
        *) echo "gen-configs: unknown argument '$1'" >&2; usage ;;
    esac
done

[ -n "$out" ] || die "--out DIR is required"
[ ${#clusters[@]} -gt 0 ] || die "at least one --cluster ID=IP is required"
[ -n "$ca" ] || ca="$out/ca"
case "$port" in ''|*[!0-9]*) die "--port '$port' is not a number" ;; esac
case "$capacity" in ''|*[!0-9]*) die "--capacity '$capacity' is not a number" ;; esac
command -v "$FABRICD" >/dev/null 2>&1 || die "fabricd executable '$FABRICD' not found (set FABRICD=/path/to/fabricd)"

mkdir -p "$out"

# fabricd's JSON output -> the first multiaddr that ends in /p2p/<peer id>.
first_p2p_addr() {
    "$PYTHON" -c '
import json, sys

def walk(v):
    if isinstance(v, str):
        if v.startswith("/") and "/p2p/" in v:
            yield v
    elif isinstance(v, dict):
        for x in v.values():
            yield from walk(x)
    elif isinstance(v, list):
        for x in v:
            yield from walk(x)

want = sys.argv[1]
addrs = list(walk(json.load(sys.stdin)))
match = [a for a in addrs if want in a] or addrs
if not match:
    sys.exit("fabricd id printed no multiaddr ending in /p2p/<peer id>")
print(match[0])
' "$1"
}

# Set [ray] address in a freshly written cluster.toml (fabricd init writes "inprocess").
set_ray_address() {
    local cfg=$1 address=$2
    "$PYTHON" - "$cfg" "$address" <<'EOF'
import re, sys
path, address = sys.argv[1], sys.argv[2]
text = open(path).read()
new, n = re.subn(r'(?ms)^(\[ray\][^\[]*?^address\s*=\s*)"[^"]*"', lambda m: m.group(1) + '"' + address + '"', text)
if n != 1:
    sys.exit(f"{path}: could not find the [ray] address key to set it to {address!r}")
open(path, "w").write(new)
EOF
}

if [ -f "$ca/ca.pub" ]; then
    echo "gen-configs: keeping the CA in $ca"
else
    "$FABRICD" certs init-ca --out "$ca" >/dev/null
    echo "gen-configs: created the CA in $ca"
fi

# init_one ID IP ROLE [BOOTSTRAP]
init_one() {
    local id=$1 ip=$2 role=$3 bootstrap=${4:-}
    local dir="$out/$id"
    if [ -f "$dir/cluster.toml" ]; then
        echo "gen-configs: keeping $dir/cluster.toml"
        return
    fi
    local args=(init --cluster-id "$id" --listen "/ip4/$ip/tcp/$port" --ca "$ca" --out "$dir")
    if [ "$role" = cluster ]; then
        args+=(--capacity "$capacity")
    else
        args+=(--role "$role")
    fi
    [ -z "$bootstrap" ] || args+=(--bootstrap "$bootstrap")
    "$FABRICD" "${args[@]}" >/dev/null
    set_ray_address "$dir/cluster.toml" "$ray"
    echo "gen-configs: wrote $dir/cluster.toml (role $role, listen /ip4/$ip/tcp/$port, ray $ray)"
}

bootstrap=""
for spec in "${clusters[@]}"; do
    id=${spec%%=*}
    ip=${spec#*=}
    if [ -z "$id" ] || [ -z "$ip" ] || [ "$id" = "$spec" ]; then
        die "--cluster '$spec' is not ID=IP"
    fi
    init_one "$id" "$ip" cluster "$bootstrap"
    if [ -z "$bootstrap" ]; then
        bootstrap=$("$FABRICD" id --config "$out/$id/cluster.toml" | first_p2p_addr "/ip4/$ip/")
        printf '%s\n' "$bootstrap" >"$out/bootstrap.addr"
        echo "gen-configs: bootstrap peer is $bootstrap"
    fi
done

if [ -n "$scheduler_ip" ]; then
    init_one scheduler "$scheduler_ip" scheduler "$bootstrap"
fi
