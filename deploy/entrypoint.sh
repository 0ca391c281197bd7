#!/usr/bin/env bash
# Container entrypoint of the fedpilot-fabric image.
#
#   entrypoint.sh cluster [CONFIG]   Ray head on this container's IP ($RAY_NODE_IP if set),
#                                    then fabricd in the foreground (CONFIG defaults to
#                                    $FABRICD_CONFIG or /cfg/cluster.toml; its [ray]
#                                    address should be "auto").
#   entrypoint.sh with-fabricd CONFIG CMD ARGS...
#                                    fabricd for CONFIG in the background (no Ray), then
#                                    CMD once that daemon answers; stops fabricd when CMD
#                                    ends and exits with CMD's status. The scheduler's
#                                    container: `fedpilot-scheduler submit --mesh CONFIG`
#                                    talks to the mesh through its own daemon.
#   entrypoint.sh gen-configs ARGS   run deploy/gen-configs.sh (the compose `certs` service)
#   entrypoint.sh CMD ARGS...        run anything else (e.g. fedpilot-scheduler submit ...)
#
# On SIGTERM/SIGINT (docker stop) fabricd is stopped first, then the Ray head.
set -euo pipefail

fabricd_pid=""

# Trap handler: fabricd first (it shuts its services down in order), then Ray.
stop_cluster() {
    kill -TERM "$fabricd_pid" 2>/dev/null || true
    wait "$fabricd_pid" 2>/dev/null || true
    ray stop --force >/dev/null 2>&1 || true
    exit 0
}

wait_for_file() {
    local config=$1
    local deadline=$((SECONDS + ${FABRICD_CONFIG_WAIT:-120}))
    while [ ! -f "$config" ]; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "entrypoint: $config did not appear (did the certs service run?)" >&2
            exit 1
        fi
        sleep 1
    done
}

start_fabricd() {
    fabricd --config "$1" ${FABRICD_LOG_FORMAT:+--log-format "$FABRICD_LOG_FORMAT"} &
    fabricd_pid=$!
}

run_cluster() {
    local config=${1:-${FABRICD_CONFIG:-/cfg/cluster.toml}}
    wait_for_file "$config"

    local ip=${RAY_NODE_IP:-}
    [ -n "$ip" ] || ip=$(hostname -i | awk '{print $1}')
    ray start --head --node-ip-address="$ip" --disable-usage-stats \
        --include-dashboard=false ${RAY_NUM_CPUS:+--num-cpus="$RAY_NUM_CPUS"}

    start_fabricd "$config"
    trap stop_cluster TERM INT
    local rc=0
    wait "$fabricd_pid" || rc=$?
    # `wait` also returns when a trapped signal arrives; stop_cluster exits then.
    ray stop --force >/dev/null 2>&1 || true
    exit "$rc"
}

stop_fabricd() {
    kill -TERM "$fabricd_pid" 2>/dev/null || true
    wait "$fabricd_pid" 2>/dev/null || true
}

run_with_fabricd() {
    [ $# -ge 2 ] || { echo "usage: entrypoint.sh with-fabricd CONFIG CMD [ARGS...]" >&2; exit 2; }
    local config=$1
    shift
    wait_for_file "$config"
    start_fabricd "$config"
    trap 'stop_fabricd; exit 143' TERM INT
    local deadline=$((SECONDS + ${FABRICD_START_WAIT:-60}))
    until fabricd status --config "$config" >/dev/null 2>&1; do
        if ! kill -0 "$fabricd_pid" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then
            echo "entrypoint: fabricd for $config did not come up" >&2
            stop_fabricd
            exit 1
        fi
        sleep 0.5
    done
    # CMD runs in the background so a SIGTERM (docker stop) reaches it at once.
    "$@" &
    local cmd_pid=$! rc=0
    trap 'kill -TERM "$cmd_pid" 2>/dev/null || true' TERM INT
    while :; do
        if wait "$cmd_pid"; then rc=0; else rc=$?; fi
        # A trapped signal also ends `wait`; go on waiting while CMD still runs.
        kill -0 "$cmd_pid" 2>/dev/null || break
    done
    stop_fabricd
    exit "$rc"
}

case "${1:-}" in
    cluster) shift; run_cluster "$@" ;;
    with-fabricd) shift; run_with_fabricd "$@" ;;
    gen-configs) shift; exec /opt/fedpilot/deploy/gen-configs.sh "$@" ;;
    "") echo "usage: entrypoint.sh cluster [CONFIG] | with-fabricd CONFIG CMD... | gen-configs ARGS | CMD..." >&2; exit 2 ;;
    *) exec "$@" ;;
esac
