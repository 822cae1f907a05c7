#!/usr/bin/env bash
# Local object stores on 127.0.0.1: fake-gcs-server for gs:// and moto's S3 server for s3://.
#
#   infra/objectstores.sh start    build fake-gcs-server with the machine's Go (once), start both, wait until
#                                  each answers a bucket listing
#   infra/objectstores.sh stop     SIGTERM, SIGKILL after a timeout (only processes this script started)
#   infra/objectstores.sh restart
#   infra/objectstores.sh status   one line per store: gcs|s3<TAB>running|stopped<TAB><endpoint><TAB><log>
#   infra/objectstores.sh env      the standard client settings, as `export` lines: eval "$(infra/objectstores.sh env)"
#
# Clients find the stores through the standard settings only: STORAGE_EMULATOR_HOST (google-cloud-storage, so
# Beam's GCSFileSystem) and AWS_ENDPOINT_URL with dummy AWS credentials and region (boto3, so Beam's S3FileSystem).
# Both stores keep objects in memory: stop forgets every bucket.
#
# Env: EMBER_HOME, EMBER_GCS_PORT (4443), EMBER_S3_PORT (9010), EMBER_OBJECTSTORES_START_TIMEOUT (60 seconds),
#      EMBER_FAKE_GCS_VERSION (v1.56.1).
set -euo pipefail

# shellcheck source=infra/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
EMBER_LOG_TAG=objectstores

HOST=127.0.0.1
GCS_PORT="${EMBER_GCS_PORT:-4443}"
S3_PORT="${EMBER_S3_PORT:-9010}"
GCS_ENDPOINT="http://$HOST:$GCS_PORT"
S3_ENDPOINT="http://$HOST:$S3_PORT"
START_TIMEOUT="${EMBER_OBJECTSTORES_START_TIMEOUT:-60}"
FAKE_GCS_VERSION="${EMBER_FAKE_GCS_VERSION:-v1.56.1}"
FAKE_GCS_MODULE="github.com/fsouza/fake-gcs-server"
FAKE_GCS_BIN_DIR="$EMBER_HOME/cache/fake-gcs-server/$FAKE_GCS_VERSION/bin"
FAKE_GCS_BIN="$FAKE_GCS_BIN_DIR/fake-gcs-server"
MOTO_BIN="$(dirname "$EMBER_PY")/moto_server"
LOG_DIR="$EMBER_HOME/objectstores/logs"
GCS_LOG="$LOG_DIR/fake-gcs-server.log"
S3_LOG="$LOG_DIR/moto-s3.log"
GCS_PID="$EMBER_RUN_DIR/fake-gcs-server.pid"
S3_PID="$EMBER_RUN_DIR/moto-s3.pid"

usage() {
  sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# Build fake-gcs-server from its Go module into the cache (once per version).
ensure_fake_gcs() {
  [[ -x "$FAKE_GCS_BIN" ]] && return 0
  need_cmd go "install Go (https://go.dev/dl/) to build $FAKE_GCS_MODULE"
  ensure_dir "$FAKE_GCS_BIN_DIR" "$LOG_DIR"
  log_info "building $FAKE_GCS_MODULE@$FAKE_GCS_VERSION with $(go version | awk '{print $3}') into $FAKE_GCS_BIN_DIR"
  if ! GOBIN="$FAKE_GCS_BIN_DIR" GOFLAGS=-buildvcs=false go install "$FAKE_GCS_MODULE@$FAKE_GCS_VERSION" \
      >>"$LOG_DIR/go-install.log" 2>&1; then
    tail_log "$LOG_DIR/go-install.log"
    die "go install $FAKE_GCS_MODULE@$FAKE_GCS_VERSION failed (log above: $LOG_DIR/go-install.log)"
  fi
}

# probe_http URL -- true when URL answers HTTP 200 (a bucket listing: the store serves requests, not just TCP).
probe_http() {
  local code
  code="$(curl -s -o /dev/null -m 5 -w '%{http_code}' "$1" 2>/dev/null || true)"
  [[ "$code" == 200 ]]
}

gcs_probe() { probe_http "$GCS_ENDPOINT/storage/v1/b"; }
s3_probe() { probe_http "$S3_ENDPOINT/"; }

# start_store NAME PIDFILE LOG PORT PROBE PATTERN CMD... -- idempotent start with a bounded readiness wait.
start_store() {
  local name="$1" pidfile="$2" logfile="$3" port="$4" probe="$5" pattern="$6" pid deadline
  shift 6
  if pid="$(pid_read "$pidfile" "$pattern" 2>/dev/null)"; then
    if "$probe"; then
      log_info "$name already running (pid $pid) on $HOST:$port"
      return 0
    fi
  elif port_open "$HOST" "$port"; then
    die "port $HOST:$port is taken by a process this script did not start; stop it or set the port variable (see infra/objectstores.sh usage)"
  else
    ensure_dir "$LOG_DIR"
    pid="$(start_bg "$pidfile" "$logfile" "$@")"
    log_info "started $name (pid $pid), waiting up to ${START_TIMEOUT}s for $HOST:$port"
  fi
  deadline=$((SECONDS + START_TIMEOUT))
  while ((SECONDS < deadline)); do
    if "$probe"; then
      log_info "$name ready on $HOST:$port"
      return 0
    fi
    if ! pid_alive "$pid"; then
      tail_log "$logfile"
      rm -f "$pidfile"
      die "$name (pid $pid) exited before serving on $HOST:$port (log: $logfile)"
    fi
    sleep 0.5
  done
  tail_log "$logfile"
  die "$name (pid $pid) did not answer on $HOST:$port within ${START_TIMEOUT}s (EMBER_OBJECTSTORES_START_TIMEOUT; log: $logfile)"
}

cmd_start() {
  need_cmd curl "it probes the stores' readiness"
  [[ -x "$MOTO_BIN" ]] || die "$MOTO_BIN not found: run 'uv sync' (moto[server] is in the dev group)"
  ensure_fake_gcs
  start_store fake-gcs-server "$GCS_PID" "$GCS_LOG" "$GCS_PORT" gcs_probe "$FAKE_GCS_BIN" \
    "$FAKE_GCS_BIN" -scheme http -host "$HOST" -port "$GCS_PORT" -public-host "$HOST:$GCS_PORT" \
    -external-url "$GCS_ENDPOINT" -backend memory -log-level warn
  start_store moto-s3 "$S3_PID" "$S3_LOG" "$S3_PORT" s3_probe "moto_server" \
    "$MOTO_BIN" -H "$HOST" -p "$S3_PORT"
}

cmd_stop() {
  stop_pid fake-gcs-server "$GCS_PID" 20 "$FAKE_GCS_BIN"
  stop_pid moto-s3 "$S3_PID" 20 "moto_server"
}

store_status() {
  local name="$1" pidfile="$2" pattern="$3" endpoint="$4" logfile="$5" probe="$6"
  if pid_running "$pidfile" "$pattern" && "$probe"; then
    status_line "$name" running "$endpoint" "$logfile"
  else
    status_line "$name" stopped "$endpoint" "$logfile"
  fi
}

cmd_status() {
  store_status gcs "$GCS_PID" "$FAKE_GCS_BIN" "$GCS_ENDPOINT" "$GCS_LOG" gcs_probe
  store_status s3 "$S3_PID" "moto_server" "$S3_ENDPOINT" "$S3_LOG" s3_probe
}

cmd_env() {
  cat <<ENV
export STORAGE_EMULATOR_HOST=$GCS_ENDPOINT
export AWS_ENDPOINT_URL=$S3_ENDPOINT
export AWS_ACCESS_KEY_ID=${AWS_ACCESS_KEY_ID:-ember-dev}
export AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY:-ember-dev}
export AWS_DEFAULT_REGION=${AWS_DEFAULT_REGION:-us-east-1}
ENV
}

case "${1:-}" in
  start) acquire_lock objectstores; cmd_start ;;
  stop) acquire_lock objectstores; cmd_stop ;;
  restart) acquire_lock objectstores; cmd_stop; cmd_start ;;
  status) cmd_status ;;
  env) cmd_env ;;
  *) usage ;;
esac
