#!/usr/bin/env bash
# `make compose-demo`: the docker-compose testbed in real containers, from nothing.
#
#   deploy/compose-demo.sh [--job FILE] [--out DIR] [--kill CLUSTER --kill-at-round N]
#                          [--keep-dockerd] [--no-install]
#
# 1. installs Debian's docker.io and docker-compose where missing (best effort, as root);
# 2. starts dockerd if none answers (and stops it at the end unless --keep-dockerd);
# 3. base image: $BASE if set; else fedpilot-base:bookworm if it exists; else
#    python:3.11-slim if a registry gives it; else builds fedpilot-base:bookworm from
#    Debian's packages (debootstrap --variant=minbase, the mirror apt uses, docker import);
# 4. builds fedpilot-fabric:dev (deploy/Dockerfile; the project and the CPU build of torch
#    installed inside the build, in cached layers: a code change rebuilds one layer);
# 5. runs certs + clusters a, b, c (each a Ray head + fabricd) + the scheduler on their own
#    network, the scheduler training FILE (default deploy/examples/digits.toml); its live
#    page is at http://172.28.7.20:9100/ while it runs;
# 6. with --kill CLUSTER: kills that cluster's container once round N has finished (the
#    job goes on under the job file's [faults] on_cluster_loss, "continue" by default);
# 7. copies summary.json, metrics.csv, placement.json, the model and the PNGs to DIR
#    (default runs/compose-demo/) and tears everything down, also on Ctrl-C.
#
# Prints one JSON line at the end: {"build_seconds": ..., "run_seconds": ..., ...}, with
# each fault's detect_seconds and recover_seconds (summary.json's faults).
# Environment: BASE (base image), DEBIAN_MIRROR (for debootstrap), PROJECT (compose
# project name, default fedpilot-demo).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
job="$here/examples/digits.toml"
out="$repo/runs/compose-demo"
kill_cluster=""
kill_round=2
keep_dockerd=0
install=1
project=${PROJECT:-fedpilot-demo}
image=fedpilot-fabric:dev
base_image=fedpilot-base:bookworm

say() { echo "compose-demo: $*" >&2; }
die() { say "$*"; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --job) job=$(realpath "${2:?--job needs a file}"); shift 2 ;;
        --out) out=$(realpath -m "${2:?--out needs a directory}"); shift 2 ;;
        --kill) kill_cluster=${2:?--kill needs a cluster id (a, b or c)}; shift 2 ;;
        --kill-at-round) kill_round=${2:?--kill-at-round needs a round}; shift 2 ;;
        --keep-dockerd) keep_dockerd=1; shift ;;
        --no-install) install=0; shift ;;
        -h|--help) sed -n '2,24s/^# \{0,1\}//p' "$0" >&2; exit 2 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done
[ -f "$job" ] || die "job file $job not found"
case "$kill_cluster" in ""|a|b|c) ;; *) die "--kill $kill_cluster: the clusters are a, b and c" ;; esac

# ---- 1. docker and docker-compose ------------------------------------------------------
if [ "$install" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    missing=()
    command -v dockerd >/dev/null || missing+=(docker.io)
    command -v docker-compose >/dev/null || missing+=(docker-compose)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    if [ ${#missing[@]} -gt 0 ]; then
        say "installing ${missing[*]} (apt-get; log in /tmp/compose-demo-apt.log)"
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") \
            >/tmp/compose-demo-apt.log 2>&1 || say "could not install ${missing[*]} (see /tmp/compose-demo-apt.log)"
    fi
fi
command -v docker >/dev/null || die "no docker client: install Debian's docker.io (apt-get install docker.io)"
if command -v docker-compose >/dev/null; then
    compose=(docker-compose)
elif docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
else
    die "no docker-compose: install Debian's docker-compose (apt-get install docker-compose)"
fi

# ---- 2. the engine -------------------------------------------------------------------------
dockerd_pid=""
if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || die "no Docker engine answers and dockerd is not installed (apt-get install docker.io)"
    [ "$(id -u)" = 0 ] || die "no Docker engine answers; starting dockerd needs root (or start it: systemctl start docker)"
    say "starting dockerd (log in /tmp/compose-demo-dockerd.log)"
    dockerd >/tmp/compose-demo-dockerd.log 2>&1 &
    dockerd_pid=$!
    for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
    docker info >/dev/null 2>&1 || die "dockerd did not come up: $(tail -3 /tmp/compose-demo-dockerd.log)"
fi

export COMPOSE_PROJECT_NAME=$project
jobs_dir=$(mktemp -d /tmp/compose-demo-jobs.XXXXXX)
cp "$job" "$jobs_dir/job.toml"
chmod -R a+rX "$jobs_dir"
# the scheduler trains FILE (mounted at /jobs-demo), writes to /work/demo-out inside its
# container (copied out at the end) and serves its live page on :9100
cat >"$jobs_dir/override.yml" <<EOF
services:
  scheduler:
    command: [with-fabricd, /cfg/scheduler/cluster.toml, fedpilot-scheduler, submit,
              /jobs-demo/job.toml, --mesh, /cfg/scheduler/cluster.toml, --clusters, "a,b,c",
              --wait, "120", --out, /work/demo-out, --metrics, "0.0.0.0:9100", --quiet]
    volumes:
      - $jobs_dir:/jobs-demo:ro
EOF
dc() { "${compose[@]}" -f "$here/docker-compose.yml" -f "$jobs_dir/override.yml" "$@"; }

teardown() {
    local rc=$?
    trap - EXIT INT TERM
    say "tearing down (docker-compose down -v)"
    dc down -v --remove-orphans >/dev/null 2>&1 || true
    rm -rf "$jobs_dir"
    if [ -n "$dockerd_pid" ] && [ "$keep_dockerd" = 0 ]; then
        kill -TERM "$dockerd_pid" 2>/dev/null || true
        wait "$dockerd_pid" 2>/dev/null || true
    fi
    exit "$rc"
}
trap teardown EXIT
trap 'say "interrupted"; exit 130' INT TERM

# ---- 3. the base image ---------------------------------------------------------------------
debian_mirror() {
    [ -n "${DEBIAN_MIRROR:-}" ] && { echo "$DEBIAN_MIRROR"; return; }
    local uri
    uri=$(grep -rhoE '(URIs:|^deb)\s+[a-z]+://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
          | grep -oE '[a-z]+://[^ ]+' | grep -v security | head -1 || true)
    echo "${uri:-http://deb.debian.org/debian}"
}

started=$(date +%s.%N)
if [ -n "${BASE:-}" ]; then
    base=$BASE
elif docker image inspect "$base_image" >/dev/null 2>&1; then
    base=$base_image
elif timeout 60 docker pull -q python:3.11-slim >/dev/null 2>&1; then
    base=python:3.11-slim
else
    command -v debootstrap >/dev/null || die "no base image: the registry gave no python:3.11-slim and debootstrap is not installed (apt-get install debootstrap, or set BASE=IMAGE)"
    [ "$(id -u)" = 0 ] || die "building the base image with debootstrap needs root (or set BASE=IMAGE)"
    mirror=$(debian_mirror)
    rootfs=$(mktemp -d /var/tmp/fedpilot-base.XXXXXX)
    say "no registry image: building $base_image from Debian's packages ($mirror, log in /tmp/compose-demo-debootstrap.log)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$mirror" \
        >/tmp/compose-demo-debootstrap.log 2>&1 || { rm -rf "$rootfs"; die "debootstrap failed: $(tail -3 /tmp/compose-demo-debootstrap.log)"; }
    tar -C "$rootfs" -c . | docker import - "$base_image" >/dev/null
    rm -rf "$rootfs"
    base=$base_image
fi
say "base image: $base"

# ---- 4. the image --------------------------------------------------------------------------
extra="$here/build-extra"
mkdir -p "$extra/wheels"
# a TLS-inspecting proxy the host trusts must be trusted by pip in the build too
[ -f /etc/ssl/certs/ca-certificates.crt ] && cp /etc/ssl/certs/ca-certificates.crt "$extra/"
# the CPU build of torch, where the host has it (PyPI's Linux torch pulls CUDA packages)
for dir in ${PIP_FIND_LINKS:-} /opt/wheels; do
    for wheel in "$dir"/torch-2.13.0+cpu-cp311-*.whl; do
        [ -f "$wheel" ] && [ ! -f "$extra/wheels/$(basename "$wheel")" ] && \
            { ln "$wheel" "$extra/wheels/" 2>/dev/null || cp "$wheel" "$extra/wheels/"; }
    done
done
say "building $image (log in /tmp/compose-demo-build.log)"
DOCKER_BUILDKIT=0 docker build --build-arg "BASE=$base" -f "$here/Dockerfile" -t "$image" "$repo" \
    >/tmp/compose-demo-build.log 2>&1 || die "docker build failed: $(tail -5 /tmp/compose-demo-build.log)"
built=$(date +%s.%N)

# ---- 5. the testbed and the job ----------------------------------------------------------------
dc down -v --remove-orphans >/dev/null 2>&1 || true  # a previous run's volumes: a fresh CA
say "starting certs, a, b, c and the scheduler"
dc up -d --no-build >/tmp/compose-demo-up.log 2>&1 || die "docker-compose up failed: $(tail -5 /tmp/compose-demo-up.log)"
sched=$(dc ps -q scheduler)
[ -n "$sched" ] || die "no scheduler container (see /tmp/compose-demo-up.log)"
say "live page: http://172.28.7.20:9100/  (logs: docker-compose -p $project -f deploy/docker-compose.yml logs -f)"

killed_at=""
while [ "$(docker inspect -f '{{.State.Running}}' "$sched")" = true ]; do
    if [ -n "$kill_cluster" ] && [ -z "$killed_at" ]; then
        # the live page answers in milliseconds (a round can take less than a second)
        round=$(curl -s --max-time 2 http://172.28.7.20:9100/api/state 2>/dev/null \
                | python3 -c 'import json, sys; print(json.load(sys.stdin)["round"])' 2>/dev/null || echo 0)
        if [ "${round:-0}" -ge "$kill_round" ]; then
            say "round $round finished: killing cluster $kill_cluster's container"
            victim=$(dc ps -q "$kill_cluster")
            [ -n "$victim" ] || die "no container for cluster $kill_cluster"
            # it stays down (restart: on-failure would bring a killed container back)
            docker update --restart=no "$victim" >/dev/null
            docker kill "$victim" >/dev/null
            say "cluster $kill_cluster's container $(docker inspect -f '{{.Name}} is {{.State.Status}}' "$victim")"
            killed_at=$round
        fi
    fi
    sleep 0.2
done
rc=$(docker inspect -f '{{.State.ExitCode}}' "$sched")
finished=$(date +%s.%N)
dc logs --no-color >"/tmp/compose-demo-logs.txt" 2>&1 || true

# ---- 7. results to the host ------------------------------------------------------------------
rm -rf "$out"
mkdir -p "$out"
if ! docker cp "$sched:/work/demo-out/." "$out/" 2>/dev/null; then
    die "the scheduler left no /work/demo-out (exit $rc); logs in /tmp/compose-demo-logs.txt"
fi
[ "$rc" = 0 ] || die "the job failed (scheduler exit $rc); results so far in $out, logs in /tmp/compose-demo-logs.txt"
say "results in $out: $(cd "$out" && ls | tr '\n' ' ')"
python3 - "$out" "$base" "$started" "$built" "$finished" "$kill_cluster" "$killed_at" <<'EOF'
import json, sys
out, base, started, built, finished, killed, at = sys.argv[1:]
s = json.load(open(f"{out}/summary.json"))
print(json.dumps({"build_seconds": round(float(built) - float(started), 1),
                  "run_seconds": round(float(finished) - float(built), 1), "base": base,
                  "job_id": s["job_id"], "rounds": len(s["rounds"]), "status": s["status"],
                  "final_accuracy": s["final_accuracy"], "bytes_inter_total": s["bytes_inter_total"],
                  "killed": killed or None, "killed_after_round": int(at) if at else None,
                  "faults": [{k: f.get(k) for k in ("round", "cluster", "event", "detect_seconds",
                                                     "recover_seconds")}
                             for f in s.get("faults", [])],
                  "out": out}))
EOF
