#!/usr/bin/env bash
# Container entrypoint of the fedpilot-fabric image.
#
#   entrypoint.sh cluster [CONFIG]   Ray head on this container's IP ($RAY_NODE_IP if set),
#                                    then fabricd in the foreground (CONFIG defaults to
#                                    $FABRICD_CONFIG or /cfg/cluster.toml; its [ray]
#                                    address should be "auto").
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

run_cluster() {
    local config=${1:-${FABRICD_CONFIG:-/cfg/cluster.toml}}
    local deadline=$((SECONDS + ${FABRICD_CONFIG_WAIT:-120}))
    while [ ! -f "$config" ]; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "entrypoint: $config did not appear (did the certs service run?)" >&2
            exit 1
        fi
        sleep 1
    done

    local ip=${RAY_NODE_IP:-}
    [ -n "$ip" ] || ip=$(hostname -i | awk '{print $1}')
    ray start --head --node-ip-address="$ip" --disable-usage-stats \
        --include-dashboard=false ${RAY_NUM_CPUS:+--num-cpus="$RAY_NUM_CPUS"}

    fabricd --config "$config" ${FABRICD_LOG_FORMAT:+--log-format "$FABRICD_LOG_FORMAT"} &
    fabricd_pid=$!
    trap stop_cluster TERM INT
    local rc=0
    wait "$fabricd_pid" || rc=$?
    # wait also returns when a trapped signal arrives; stop() exits in that case.
    ray stop --force >/dev/null 2>&1 || true
    exit "$rc"
}

case "${1:-}" in
    cluster) shift; run_cluster "$@" ;;
    gen-configs) shift; exec /opt/fedpilot/deploy/gen-configs.sh "$@" ;;
    "") echo "usage: entrypoint.sh cluster [CONFIG] | gen-configs ARGS | CMD ARGS..." >&2; exit 2 ;;
    *) exec "$@" ;;
esac
