#!/usr/bin/env bash
# Three fabricd clusters on one Linux machine, each in its own network namespace with
# its own IP, joined by veth links to a bridge that lives in a fourth namespace. Nothing
# touches the host's own network: every link and address exists only inside namespaces
# this script creates (and `down` deletes).
#
#   netns-testbed.sh up            create namespaces + links, CA + configs, start daemons
#   netns-testbed.sh up --wan      each site behind a NAT router of its own (below)
#   netns-testbed.sh status [-v]   namespaces, daemon pids, peers seen by each daemon
#                                  (-v: each daemon's full `fabricd status` JSON)
#   netns-testbed.sh exec ID CMD   run CMD inside cluster ID's namespace
#   netns-testbed.sh down          stop the daemons, delete namespaces and the state dir
#                                  (safe to repeat, also after a crash or a failed `up`)
#
#   layout (defaults):  ns fp-a  eth0 10.77.0.1 --veth-- v-a \
#                       ns fp-b  eth0 10.77.0.2 --veth-- v-b -- br0 (ns fp-br)
#                       ns fp-c  eth0 10.77.0.3 --veth-- v-c /
#   b and c bootstrap from a; each daemon listens on /ip4/<its IP>/tcp/4001.
#
#   --wan: no site can dial another. Each site (ns fp-a: eth0 10.77.1.2) sits behind a
#   router namespace of its own (ns fp-r-a: lan0 10.77.1.1, up0 198.18.0.1 on the "internet"
#   bridge in ns fp-wan) that masquerades its traffic (iptables MASQUERADE, no port
#   forward; unsolicited inbound dropped). The gateway - the scheduler's fabricd with
#   [network] relay_service = true - sits on the internet bridge (198.18.0.200); every
#   site bootstraps from it with reachability = "private" and is reached through it.
#   tc shapes both directions of every site uplink: netem delay FP_WAN_RTT_MS/2 each way,
#   loss FP_WAN_LOSS % each way, rate FP_WAN_RATE; on a kernel without sch_netem the uplink
#   is a pair of TAP devices joined by deploy/wanlink.py (delay and loss in user space) and
#   tbf gives the rate.
#
# Environment:
#   FP_NETNS_PREFIX  namespace name prefix (fp)
#   FP_STATE_DIR     configs, CA, logs and pids (/tmp/$FP_NETNS_PREFIX-netns-testbed)
#   FABRICD          fabricd executable (the repository's .venv/bin/fabricd, else PATH)
#   PYTHON           python3 used to read fabricd's JSON (next to FABRICD, else python3)
#   FP_CLUSTERS      cluster ids, the first is the bootstrap peer ("a b c")
#   FP_SUBNET        first three octets of the /24 (10.77.0); cluster i gets .i
#   FP_PORT          fabricd TCP port (4001)
#   FP_RAY           [ray] address written into each cluster.toml (inprocess)
#   FP_CAPACITY      virtual clients each cluster may host (32)
#   FP_SCHEDULER     1: also namespace $FP_NETNS_PREFIX-scheduler (.200) running the
#                    scheduler's own fabricd (role scheduler), for
#                    `exec scheduler fedpilot-scheduler submit JOB --mesh CONFIG` (0)
#   FP_START_TIMEOUT seconds `up` waits for every daemon to answer `fabricd status` (60)
#   FP_KEEP_ON_FAIL  1: a failed `up` leaves everything in place for inspection (0)
#   FP_WAN_SUBNET    --wan: first three octets of the internet /24 (198.18.0)
#   FP_WAN_RTT_MS    --wan: round-trip time added per site uplink (40)
#   FP_WAN_LOSS      --wan: loss in % each way on a site uplink (0.1)
#   FP_WAN_RATE      --wan: rate of a site uplink, tc units (100mbit)
#   FP_WAN_REACHABILITY --wan: the sites' [network] reachability: private, or auto (each
#                    finds itself private by the gateway's dial-back) (private)
#   FP_WAN_HOLE_PUNCHING --wan: 1: sites upgrade their relayed links by DCUtR hole punching
#                    (fabricd's default); 0: links stay relayed ([network] hole_punching) (1)
#   FP_WAN_SITE_LIMITS --wan: lines added to each site's [limits], e.g.
#                    "dataplane_min_bytes = 0" (every body over libp2p) ("")
#   FP_WAN_NAT       --wan: the routers' NAT: cone (MASQUERADE keeps a connection's source
#                    port: hole punching works) or symmetric (--random-fully: a new port
#                    per connection, so a peer cannot predict it and punching fails) (cone)
#   FP_SLOW          slow sites, "ID=FACTOR ..." (FACTOR > 1): the site's daemon, and the
#                    executor and Ray it starts, get 1/FACTOR of a fair share of the CPUs
#                    (CPUs / sites, at most one) in a cgroup of their own (cgroup v2
#                    cpu.max, else v1; python -m scheduler.cpuquota), as `submit --local
#                    --slow`; `up` logs how, or why this machine cannot ("")
# Needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2; --wan also iptables.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")

PREFIX=${FP_NETNS_PREFIX:-fp}
STATE=${FP_STATE_DIR:-/tmp/$PREFIX-netns-testbed}
if [ -z "${FABRICD:-}" ]; then
    if [ -x "$repo/.venv/bin/fabricd" ]; then FABRICD=$repo/.venv/bin/fabricd; else FABRICD=fabricd; fi
fi
if [ -z "${PYTHON:-}" ]; then
    fabricd_path=$(command -v "$FABRICD" || true)
    if [ -n "$fabricd_path" ] && [ -x "$(dirname "$fabricd_path")/python" ]; then
        PYTHON=$(dirname "$fabricd_path")/python
    else
        PYTHON=python3
    fi
fi
export FABRICD PYTHON
read -r -a CLUSTERS <<<"${FP_CLUSTERS:-a b c}"
SUBNET=${FP_SUBNET:-10.77.0}
PORT=${FP_PORT:-4001}
RAY=${FP_RAY:-inprocess}
CAPACITY=${FP_CAPACITY:-32}
WITH_SCHEDULER=${FP_SCHEDULER:-0}
START_TIMEOUT=${FP_START_TIMEOUT:-60}
BRIDGE_NS=$PREFIX-br
WAN_NS=$PREFIX-wan
WAN_SUBNET=${FP_WAN_SUBNET:-198.18.0}
WAN_RTT_MS=${FP_WAN_RTT_MS:-40}
WAN_LOSS=${FP_WAN_LOSS:-0.1}
WAN_RATE=${FP_WAN_RATE:-100mbit}
WAN_REACHABILITY=${FP_WAN_REACHABILITY:-private}
WAN_HOLE_PUNCHING=${FP_WAN_HOLE_PUNCHING:-1}
case ${FP_WAN_NAT:-cone} in
    cone) WAN_MASQUERADE=(-j MASQUERADE) ;;
    symmetric) WAN_MASQUERADE=(-j MASQUERADE --random-fully) ;;
    *) echo "netns-testbed: FP_WAN_NAT=$FP_WAN_NAT: cone or symmetric" >&2; exit 2 ;;
esac
case $WAN_HOLE_PUNCHING in
    0) WAN_HOLE_PUNCHING=false ;;
    1) WAN_HOLE_PUNCHING=true ;;
    *) echo "netns-testbed: FP_WAN_HOLE_PUNCHING=$WAN_HOLE_PUNCHING: 0 or 1" >&2; exit 2 ;;
esac
case $WAN_REACHABILITY in
    private | auto) ;;
    *) echo "netns-testbed: FP_WAN_REACHABILITY=$WAN_REACHABILITY: private or auto" >&2; exit 2 ;;
esac
MARKER=$STATE/.netns-testbed
# WAN mode: asked for (`up --wan`) or recorded by the `up` that made the testbed
WAN=0
if [ "${1:-}" = up ] && [ "${2:-}" = --wan ]; then WAN=1; fi
if [ -f "$MARKER" ] && grep -qx 'mode=wan' "$MARKER"; then WAN=1; fi
[ "$WAN" != 1 ] || WITH_SCHEDULER=1  # the gateway
# Every namespace that runs a daemon: the clusters, plus the scheduler's own fabricd.
DAEMONS=("${CLUSTERS[@]}")
[ "$WITH_SCHEDULER" != 1 ] || DAEMONS+=(scheduler)

log() { echo "netns-testbed: $*" >&2; }
die() { log "$*"; exit 1; }

# FP_SLOW's factor for site ID ("" when it is not slowed).
slow_factor() {
    local entry
    for entry in ${FP_SLOW:-}; do
        [ "${entry%%=*}" != "$1" ] || { echo "${entry#*=}"; return; }
    done
}

check_slow() {
    local entry
    for entry in ${FP_SLOW:-}; do
        [[ " ${CLUSTERS[*]} " == *" ${entry%%=*} "* ]] \
            || die "FP_SLOW: $entry names no site (sites: ${CLUSTERS[*]})"
        awk -v f="${entry#*=}" 'BEGIN { exit !(f ~ /^[0-9]+([.][0-9]+)?$/ && f > 1) }' \
            || die "FP_SLOW: $entry: expected ID=FACTOR with FACTOR > 1, e.g. b=4"
    done
}

# slow_site ID PID: put the daemon PID of site ID under its FP_SLOW quota (before it starts
# an executor, which inherits the cgroup); the cgroup's path goes to its state dir for `down`.
slow_site() {
    local factor out path
    factor=$(slow_factor "$1")
    [ -n "$factor" ] || return 0
    # its errors go to stderr as they come; stdout is the cgroup's path, then how
    out=$("$PYTHON" -m scheduler.cpuquota apply "$2" "$factor" "${#CLUSTERS[@]}" \
          "$PREFIX-$1") || out=$'\n'"not slowed: python -m scheduler.cpuquota failed (above)"
    path=$(head -n 1 <<<"$out")
    [ -z "$path" ] || echo "$path" >"$STATE/$1/cpuquota"
    log "site $1 slowed by $factor: $(tail -n 1 <<<"$out")"
}

ns_of() { echo "$PREFIX-$1"; }

# The 1-based index of cluster ID.
index_of() {
    local i=1 c
    for c in "${CLUSTERS[@]}"; do
        if [ "$c" = "$1" ]; then echo "$i"; return; fi
        i=$((i + 1))
    done
    die "unknown cluster '$1' (clusters: ${CLUSTERS[*]})"
}

# The IP of the i-th cluster (1-based), or of the scheduler (--wan: a site's LAN IP, the
# gateway's internet IP).
ip_of() {
    if [ "$WAN" = 1 ]; then
        if [ "$1" = scheduler ]; then echo "$WAN_SUBNET.200"; else echo "10.77.$(index_of "$1").2"; fi
        return
    fi
    if [ "$1" = scheduler ]; then echo "$SUBNET.200"; return; fi
    echo "$SUBNET.$(index_of "$1")"
}

ns_exists() { ip netns list | awk '{print $1}' | grep -qxF "$1"; }

# Every namespace this testbed owns: from the marker of a previous `up` if there is one,
# else from the current settings.
owned_namespaces() {
    if [ -f "$MARKER" ]; then
        sed -n 's/^namespace=//p' "$MARKER"
    else
        local c
        for c in "${CLUSTERS[@]}"; do ns_of "$c"; ns_of "r-$c"; done
        ns_of scheduler
        echo "$BRIDGE_NS"
        echo "$WAN_NS"
    fi
}

check_prerequisites() {
    [ "$(id -u)" -eq 0 ] || die "must run as root (creates network namespaces)"
    command -v ip >/dev/null || die "iproute2's 'ip' not found (apt-get install iproute2)"
    command -v "$FABRICD" >/dev/null || die "fabricd '$FABRICD' not found; set FABRICD=/path/to/fabricd"
    if [ "$WAN" = 1 ]; then
        command -v iptables >/dev/null || die "--wan needs iptables (apt-get install iptables)"
        command -v tc >/dev/null || die "--wan needs tc (iproute2)"
    fi
    if [ ${#CLUSTERS[@]} -lt 1 ] || [ ${#CLUSTERS[@]} -gt 99 ]; then
        die "FP_CLUSTERS must name 1 to 99 clusters"
    fi
    local c
    for c in "${CLUSTERS[@]}"; do
        case "$c" in
            br|wan|scheduler|r-*) die "cluster id '$c' is reserved by this script" ;;
            *[!A-Za-z0-9_.-]*) die "cluster id '$c' may hold only letters, digits, '-', '_', '.'" ;;
        esac
        [ ${#c} -le 12 ] || die "cluster id '$c' is too long for an interface name (max 12)"
    done
}

make_network() {
    local c ns
    ip netns add "$BRIDGE_NS"
    echo "namespace=$BRIDGE_NS" >>"$MARKER"
    ip -n "$BRIDGE_NS" link set lo up
    ip -n "$BRIDGE_NS" link add br0 type bridge
    ip -n "$BRIDGE_NS" link set br0 up
    for c in "${DAEMONS[@]}"; do
        ns=$(ns_of "$c")
        ip netns add "$ns"
        echo "namespace=$ns" >>"$MARKER"
        ip -n "$ns" link set lo up
        # Both ends are created inside namespaces: the pair never exists in the host's.
        ip -n "$ns" link add eth0 type veth peer name "v-$c" netns "$BRIDGE_NS"
        ip -n "$BRIDGE_NS" link set "v-$c" master br0
        ip -n "$BRIDGE_NS" link set "v-$c" up
        ip -n "$ns" addr add "$(ip_of "$c")/24" dev eth0
        ip -n "$ns" link set eth0 up
        log "namespace $ns: eth0 $(ip_of "$c")/24"
    done
}

add_ns() {
    ip netns add "$1"
    echo "namespace=$1" >>"$MARKER"
    ip -n "$1" link set lo up
}

# shape NS DEV: the emulated WAN on DEV's egress (half the RTT each way), or only its rate
# where wanlink.py delays and drops
shape() {
    if [ "$NETEM" = 1 ]; then
        ip netns exec "$1" tc qdisc add dev "$2" root netem delay "${HALF_RTT}ms" loss "${WAN_LOSS}%" \
            rate "$WAN_RATE"
    else
        ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$WAN_RATE" burst 256kb latency 100ms
    fi
}

# uplink C R: router R's up0 and the internet bridge's w-C, joined by a veth pair, or (no
# sch_netem) by wanlink.py between two TAP devices
uplink() {
    if [ "$NETEM" = 1 ]; then
        ip -n "$2" link add up0 type veth peer name "w-$1" netns "$WAN_NS"
        return
    fi
    local log=$STATE/wanlink-$1.log _
    setsid "$PYTHON" "$here/wanlink.py" "$2" up0 "$WAN_NS" "w-$1" "$HALF_RTT" "$WAN_LOSS" \
        </dev/null >"$log" 2>&1 &
    echo "$!" >"$STATE/wanlink-$1.pid"
    for _ in $(seq 100); do
        ! grep -qx ready "$log" || return 0
        pid_alive "$STATE/wanlink-$1.pid" wanlink || break
        sleep 0.1
    done
    cat "$log" >&2
    die "wanlink.py for $1 did not start"
}

make_wan_network() {
    local c i r ns gw
    echo "mode=wan" >>"$MARKER"
    add_ns "$WAN_NS"
    HALF_RTT=$(awk "BEGIN { print $WAN_RTT_MS / 2 }")
    NETEM=0
    if ip netns exec "$WAN_NS" tc qdisc add dev lo root netem delay 1ms 2>/dev/null; then
        ip netns exec "$WAN_NS" tc qdisc del dev lo root
        NETEM=1
    else
        log "this kernel has no sch_netem: delay and loss by deploy/wanlink.py, the rate by tbf"
    fi
    ip -n "$WAN_NS" link add br0 type bridge
    ip -n "$WAN_NS" link set br0 up
    gw=$(ns_of scheduler)
    add_ns "$gw"
    ip -n "$gw" link add eth0 type veth peer name v-gw netns "$WAN_NS"
    ip -n "$WAN_NS" link set v-gw master br0 up
    ip -n "$gw" addr add "$(ip_of scheduler)/24" dev eth0
    ip -n "$gw" link set eth0 up
    log "namespace $gw (gateway): eth0 $(ip_of scheduler)/24 on the internet bridge"
    for c in "${CLUSTERS[@]}"; do
        i=$(index_of "$c")
        r=$(ns_of "r-$c")
        ns=$(ns_of "$c")
        add_ns "$r"
        add_ns "$ns"
        uplink "$c" "$r"
        ip -n "$WAN_NS" link set "w-$c" master br0 up
        ip -n "$r" addr add "$WAN_SUBNET.$i/24" dev up0
        ip -n "$r" link set up0 up
        ip -n "$ns" link add eth0 type veth peer name lan0 netns "$r"
        ip -n "$r" addr add "10.77.$i.1/24" dev lan0
        ip -n "$r" link set lan0 up
        ip -n "$ns" addr add "$(ip_of "$c")/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" route add default via "10.77.$i.1"
        ip netns exec "$r" sysctl -qw net.ipv4.ip_forward=1
        ip netns exec "$r" iptables -t nat -A POSTROUTING -o up0 "${WAN_MASQUERADE[@]}"
        ip netns exec "$r" iptables -A FORWARD -i up0 -o lan0 -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
        ip netns exec "$r" iptables -A FORWARD -i up0 -j DROP
        shape "$r" up0
        shape "$r" lan0
        log "site $ns: eth0 $(ip_of "$c")/24 behind ${FP_WAN_NAT:-cone} NAT router $r ($WAN_SUBNET.$i)"
    done
}

# WAN configs: every site bootstraps from the gateway, reachability private; the gateway relays.
wan_configs() {
    local c gw_addr
    gw_addr=$("$FABRICD" id --config "$STATE/scheduler/cluster.toml" | "$PYTHON" -c '
import json, sys
print([a for a in json.load(sys.stdin)["addrs"] if a.startswith("/ip4/'"$(ip_of scheduler)"'/")][0])')
    sed -i -e 's|^bootstrap = .*|bootstrap = []|' \
        -e 's|^\[network\]$|[network]\nrelay_service = true|' "$STATE/scheduler/cluster.toml"
    for c in "${CLUSTERS[@]}"; do
        sed -i -e "s|^bootstrap = .*|bootstrap = [\"$gw_addr\"]|" \
            -e 's|^\[network\]$|[network]\nreachability = "'"$WAN_REACHABILITY"'"\nhole_punching = '"$WAN_HOLE_PUNCHING"'|' \
            "$STATE/$c/cluster.toml"
        if [ -n "${FP_WAN_SITE_LIMITS:-}" ]; then
            "$PYTHON" - "$STATE/$c/cluster.toml" "$FP_WAN_SITE_LIMITS" <<'PY'
import sys
path, extra = sys.argv[1], sys.argv[2]
text = open(path).read()
open(path, "w").write(text.replace("[limits]\n", "[limits]\n" + extra.strip() + "\n", 1))
PY
        fi
    done
    log "gateway $gw_addr relays for ${CLUSTERS[*]}"
}

make_configs() {
    local args=(--out "$STATE" --ca "$STATE/ca" --port "$PORT" --ray "$RAY" --capacity "$CAPACITY") c
    for c in "${CLUSTERS[@]}"; do args+=(--cluster "$c=$(ip_of "$c")"); done
    [ "$WITH_SCHEDULER" != 1 ] || args+=(--scheduler "$(ip_of scheduler)")
    "$here/gen-configs.sh" "${args[@]}" >&2
    [ "$WAN" != 1 ] || wan_configs
}

start_daemons() {
    local c ns dir pid
    for c in "${DAEMONS[@]}"; do
        ns=$(ns_of "$c")
        dir=$STATE/$c
        # setsid: the daemon outlives this script and the caller's terminal; `ip netns
        # exec` execs in place, so $! is the daemon's own pid.
        setsid ip netns exec "$ns" "$FABRICD" --config "$dir/cluster.toml" \
            </dev/null >"$dir/fabricd.log" 2>&1 &
        pid=$!
        echo "$pid" >"$dir/fabricd.pid"
        echo "daemon=$c" >>"$MARKER"
        slow_site "$c" "$pid"
        log "started fabricd for $c in $ns (pid $pid, log $dir/fabricd.log)"
    done
}

wait_ready() {
    local deadline=$((SECONDS + START_TIMEOUT)) c pending
    while :; do
        pending=()
        for c in "${DAEMONS[@]}"; do
            pid_alive "$STATE/$c/fabricd.pid" || {
                log "fabricd of $c exited; last lines of $STATE/$c/fabricd.log:"
                tail -n 20 "$STATE/$c/fabricd.log" >&2 || true
                return 1
            }
            "$FABRICD" status --config "$STATE/$c/cluster.toml" >/dev/null 2>&1 || pending+=("$c")
        done
        [ ${#pending[@]} -gt 0 ] || return 0
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "no answer to 'fabricd status' after ${START_TIMEOUT}s from: ${pending[*]}"
            return 1
        fi
        sleep 0.5
    done
}

# pid_alive PIDFILE [NAME]: the pid in PIDFILE is a running fabricd (or NAME).
pid_alive() {
    local pid cmd state
    pid=$(cat "$1" 2>/dev/null) || return 1
    [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
    [ -n "$state" ] && [ "$state" != Z ] || return 1
    cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)
    # a process in the middle of an exec (setsid -> ip netns exec -> fabricd) reads an
    # empty cmdline for a moment: a clean-clone CI run at load 20 took it for "exited"
    [ -z "$cmd" ] || grep -q "${2:-fabricd}" <<<"$cmd"
}

cmd_up() {
    check_prerequisites
    check_slow
    local ns
    while read -r ns; do
        ! ns_exists "$ns" || die "namespace $ns already exists: run '$0 down' first"
    done < <(owned_namespaces)
    [ ! -e "$STATE" ] || [ -f "$MARKER" ] || die "$STATE exists and was not made by this script; set FP_STATE_DIR"
    [ ! -e "$STATE" ] || die "$STATE is left from an earlier run: run '$0 down' first"
    mkdir -p "$STATE"
    : >"$MARKER"
    trap 'on_up_failure' EXIT
    if [ "$WAN" = 1 ]; then make_wan_network; else make_network; fi
    make_configs
    start_daemons
    wait_ready
    trap - EXIT
    local c
    for c in "${DAEMONS[@]}"; do
        echo "$c $(ns_of "$c") $(ip_of "$c") $STATE/$c/cluster.toml"
    done
    log "up: ${#DAEMONS[@]} daemons answering; state in $STATE"
}

on_up_failure() {
    local rc=$?
    [ "$rc" -ne 0 ] || return 0
    if [ "${FP_KEEP_ON_FAIL:-0}" = 1 ]; then
        log "up failed; everything left in place (FP_KEEP_ON_FAIL=1); clean up with '$0 down'"
    else
        log "up failed; cleaning up (set FP_KEEP_ON_FAIL=1 to keep the state for inspection)"
        cmd_down || true
    fi
    exit "$rc"
}

cmd_down() {
    [ "$(id -u)" -eq 0 ] || die "must run as root (deletes network namespaces)"
    local pidfile pid ns namespaces
    mapfile -t namespaces < <(owned_namespaces)
    # 1. Ask our daemons to stop (by the pids we recorded) and give them time.
    for pidfile in "$STATE"/*/fabricd.pid; do
        [ -f "$pidfile" ] || continue
        if pid_alive "$pidfile"; then
            pid=$(cat "$pidfile")
            kill -TERM "$pid" 2>/dev/null || true
            log "sent SIGTERM to fabricd pid $pid"
        fi
    done
    local deadline=$((SECONDS + 10))
    for pidfile in "$STATE"/*/fabricd.pid; do
        [ -f "$pidfile" ] || continue
        while pid_alive "$pidfile" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
    done
    for pidfile in "$STATE"/wanlink-*.pid; do
        if pid_alive "$pidfile" wanlink; then kill -TERM "$(cat "$pidfile")" 2>/dev/null || true; fi
    done
    # 2. Whatever still runs inside our namespaces (a daemon stuck in shutdown, or one
    #    whose pid file a crash lost) is ours: kill it by pid.
    for ns in "${namespaces[@]}"; do
        ns_exists "$ns" || continue
        for pid in $(ip netns pids "$ns" 2>/dev/null); do
            if kill -KILL "$pid" 2>/dev/null; then log "killed pid $pid left in $ns"; fi
        done
    done
    #    A slow site's cgroup goes once its processes have (best effort).
    local quota path
    for quota in "$STATE"/*/cpuquota; do
        [ -f "$quota" ] || continue
        path=$(cat "$quota")
        for _ in $(seq 25); do  # a killed process leaves its cgroup once it is reaped
            [ -d "$path" ] || break
            if rmdir "$path" 2>/dev/null; then log "removed cgroup $path"; break; fi
            sleep 0.2
        done
    done
    # 3. Deleting a namespace deletes its veth end, and with it the pair, and the bridge.
    for ns in "${namespaces[@]}"; do
        if ns_exists "$ns"; then
            ip netns del "$ns"
            log "deleted namespace $ns"
        fi
    done
    # 4. Only a state dir this script made is removed.
    if [ -f "$MARKER" ]; then
        rm -rf -- "$STATE"
        log "removed $STATE"
    elif [ -e "$STATE" ]; then
        log "left $STATE in place: it has no $MARKER, so this script did not make it"
    fi
}

# `fabricd status` JSON on stdin -> two lines: listen addresses, other clusters' state.
summarize_status() {
    "$PYTHON" -c '
import json, sys
text = sys.stdin.read()
try:
    s = json.loads(text)
except ValueError:
    sys.stdout.write(text)
    sys.exit(0)
print("listen:", " ".join(s.get("listen_addrs", [])))
peers = ["%s %s%s" % (c["cluster_id"], "connected" if c.get("connected") else "DISCONNECTED",
                      " (relayed)" if c.get("link") == "relayed" else "")
         for c in s.get("clusters", [])]
print("clusters:", ", ".join(peers) or "none known")
'
}

cmd_status() {
    local verbose=0 c ns rc=0 pid state summary daemons
    [ "${1:-}" != -v ] || verbose=1
    # The daemons `up` started (whatever FP_SCHEDULER says now), else the settings'.
    if [ -f "$MARKER" ] && grep -q '^daemon=' "$MARKER"; then
        mapfile -t daemons < <(sed -n 's/^daemon=//p' "$MARKER")
    else
        daemons=("${DAEMONS[@]}")
    fi
    for c in "${daemons[@]}"; do
        ns=$(ns_of "$c")
        if ! ns_exists "$ns"; then
            echo "$c: namespace $ns missing"
            rc=1
            continue
        fi
        if pid_alive "$STATE/$c/fabricd.pid"; then
            pid=$(cat "$STATE/$c/fabricd.pid")
            state="fabricd pid $pid running"
        else
            state="fabricd not running"
            rc=1
        fi
        echo "$c: namespace $ns, $(ip_of "$c"), $state"
        if [ "$verbose" = 1 ]; then
            summary="cat"
        else
            summary=summarize_status
        fi
        if ! ip netns exec "$ns" "$FABRICD" status --config "$STATE/$c/cluster.toml" 2>&1 \
                | "$summary" | sed 's/^/    /'; then
            rc=1
        fi
    done
    return "$rc"
}

cmd_exec() {
    [ $# -ge 2 ] || die "usage: $0 exec CLUSTER_ID CMD [ARGS...]"
    local c=$1
    shift
    ip_of "$c" >/dev/null
    exec ip netns exec "$(ns_of "$c")" "$@"
}

case "${1:-}" in
    up) [ $# -le 1 ] || [ "$2" = --wan ] || die "usage: $0 up [--wan]"; cmd_up ;;
    down) cmd_down ;;
    status) shift; cmd_status "$@" ;;
    exec) shift; cmd_exec "$@" ;;
    *) sed -n '2,50s/^# \{0,1\}//p' "$0" >&2; exit 2 ;;
esac
