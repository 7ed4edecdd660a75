#!/usr/bin/env bash
# Stops the stack infra/local/start.sh started: Prometheus and the stats exporter, then the
# workers and the vLLMs (SIGTERM, so they flush every session and store the last answers'
# chunks while the store is still up), then SeaweedFS and redis-server.
# Idempotent: stopping a stopped stack does nothing and succeeds.
#
# Settings (environment):
#   KVCLOUD_LOCAL_STATE         state directory        (default: <repo>/.kvcloud-local)
#   KVCLOUD_LOCAL_STOP_TIMEOUT  seconds to wait for each process before SIGKILL (default: 60)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
STATE="${KVCLOUD_LOCAL_STATE:-$ROOT/.kvcloud-local}"
STOP_TIMEOUT="${KVCLOUD_LOCAL_STOP_TIMEOUT:-60}"

# what each pid file's process must be running, so a recycled pid is never signalled
expected_command() {
    case "$1" in
        worker1 | worker2) echo "kvcloud-worker" ;;
        exporter) echo "kvcloud stats" ;;
        prometheus) echo "prometheus" ;;
        vllm1 | vllm2) echo "vllm.entrypoints.openai.api_server" ;;
        s3) echo "weed server" ;;
        redis) echo "redis-server" ;;
        *) echo "" ;;
    esac
}

# alive PID: the process exists and is not a zombie waiting to be reaped
alive() {
    kill -0 "$1" 2>/dev/null || return 1
    local state
    state="$(awk '/^State:/ {print $2}' "/proc/$1/status" 2>/dev/null || true)"
    [[ "$state" != "Z" ]]
}

stop_one() {
    local name="$1" pidfile="$STATE/pids/$1.pid" pid expected deadline
    [[ -e "$pidfile" ]] || return 0
    pid="$(cat "$pidfile")"
    expected="$(expected_command "$name")"
    if [[ ! "$pid" =~ ^[0-9]+$ ]] || ! alive "$pid"; then
        rm -f "$pidfile"
        return 0
    fi
    if [[ -n "$expected" ]] && ! tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "$expected"; then
        echo "stop.sh: pid $pid is no longer $name; leaving it alone" >&2
        rm -f "$pidfile"
        return 0
    fi
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + STOP_TIMEOUT))
    while alive "$pid"; do
        if ((SECONDS >= deadline)); then
            echo "stop.sh: $name (pid $pid) still running after ${STOP_TIMEOUT}s; SIGKILL" >&2
            kill -KILL "$pid" 2>/dev/null || true
            break
        fi
        sleep 0.1
    done
    rm -f "$pidfile"
    echo "stopped $name (pid $pid)"
}

if [[ ! -d "$STATE/pids" ]]; then
    echo "nothing to stop (no $STATE/pids)"
    exit 0
fi

# the readers first (they would only log the others going away), then the workers together
# (each flushes its sessions), then the servers they flush to
stop_one prometheus
stop_one exporter
worker_pids=()
for name in worker1 worker2 vllm1 vllm2; do
    stop_one "$name" &
    worker_pids+=("$!")
done
for p in "${worker_pids[@]}"; do
    wait "$p" || true
done
stop_one s3
stop_one redis
