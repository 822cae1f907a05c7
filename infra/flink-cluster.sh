#!/usr/bin/env bash
# A Flink session cluster on 127.0.0.1 assembled from the Maven artifacts infra/flink.sh resolved
# (flink-runtime, flink-clients, flink-rpc-akka-loader ...; flink-dist is not served), plus the two
# Beam processes that make it usable from the Python SDK:
#   jobmanager   StandaloneSessionClusterEntrypoint          RPC $EMBER_FLINK_RPC_PORT, REST $EMBER_FLINK_REST_PORT
#   tm-1, tm-2   TaskManagerRunner, each under a supervisor that restarts it when it dies (kill -9 included)
#   job-server   Beam FlinkJobServerDriver --flink-master=127.0.0.1:<REST port>   job port $EMBER_FLINK_JOB_PORT
#   worker-pool  python -m apache_beam.runners.worker.worker_pool_main (Beam EXTERNAL environment)
#
#   infra/flink-cluster.sh start    start what is not running (idempotent); waits until REST /overview
#                                   shows every TaskManager registered (EMBER_FLINK_READY_TIMEOUT, 120 s)
#   infra/flink-cluster.sh stop     stop everything this script started
#   infra/flink-cluster.sh status   flink-cluster<TAB>running|stopped|degraded<TAB>REST url<TAB>detail
#   infra/flink-cluster.sh args     the Beam options that target this cluster (one per line)
#   infra/flink-cluster.sh tm-pid N the JVM pid of TaskManager N (for failure tests)
#
# EMBER_FLINK_TASKMANAGERS (2) TaskManagers with EMBER_FLINK_SLOTS (1) slots each.
# EMBER_FLINK_CLUSTER (flink-cluster) names a second cluster's state, logs and lock (with its own ports).
# EMBER_FLINK_ISOLATED=1 runs the worker pool - every Python SDK harness, so every byte the job reads or
# writes - in a mount namespace of its own (bubblewrap): a private /tmp, and each directory of the colon-separated
# EMBER_FLINK_HIDE hidden under an empty tmpfs. Its workers share no disk with a driver working there; the pool
# listens on 127.0.0.2, an address ember does not take for this machine's (runners.runs_locally).
set -euo pipefail

# shellcheck source=infra/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NAME="${EMBER_FLINK_CLUSTER:-flink-cluster}"
[[ "$NAME" =~ ^[a-z][a-z0-9-]*$ ]] || die "EMBER_FLINK_CLUSTER='$NAME': lower-case letters, digits and hyphens"
EMBER_LOG_TAG="$NAME"
ISOLATED="${EMBER_FLINK_ISOLATED:-0}"
POOL_HOST=127.0.0.1
[[ "$ISOLATED" == 1 ]] && POOL_HOST=127.0.0.2

RPC_PORT="${EMBER_FLINK_RPC_PORT:-16123}"
REST_PORT="${EMBER_FLINK_REST_PORT:-18081}"
BLOB_PORT="${EMBER_FLINK_BLOB_PORT:-16124}"
JOB_PORT="${EMBER_FLINK_JOB_PORT:-18099}"
ARTIFACT_PORT="${EMBER_FLINK_ARTIFACT_PORT:-18098}"
EXPANSION_PORT="${EMBER_FLINK_EXPANSION_PORT:-18097}"
POOL_PORT="${EMBER_FLINK_WORKER_POOL_PORT:-18050}"
TASKMANAGERS="${EMBER_FLINK_TASKMANAGERS:-2}"
SLOTS="${EMBER_FLINK_SLOTS:-1}"
READY_TIMEOUT="${EMBER_FLINK_READY_TIMEOUT:-120}"
FLINK_VERSION="${EMBER_FLINK_VERSION:-1.19}"
ROOT="$EMBER_HOME/$NAME"
CONF_DIR="$ROOT/conf"
RUN="$EMBER_RUN_DIR/$NAME"
LOGS="$ROOT/logs"
REST_URL="http://127.0.0.1:$REST_PORT"
# Flink 1.19 on Java 17 needs these (the flink-dist scripts pass the same list via env.java.opts.all).
JAVA_OPENS=(--add-exports=java.base/sun.net.util=ALL-UNNAMED --add-exports=java.rmi/sun.rmi.registry=ALL-UNNAMED
  --add-opens=java.base/java.lang=ALL-UNNAMED --add-opens=java.base/java.net=ALL-UNNAMED
  --add-opens=java.base/java.io=ALL-UNNAMED --add-opens=java.base/java.nio=ALL-UNNAMED
  --add-opens=java.base/sun.nio.ch=ALL-UNNAMED --add-opens=java.base/java.lang.reflect=ALL-UNNAMED
  --add-opens=java.base/java.text=ALL-UNNAMED --add-opens=java.base/java.time=ALL-UNNAMED
  --add-opens=java.base/java.util=ALL-UNNAMED --add-opens=java.base/java.util.concurrent=ALL-UNNAMED
  --add-opens=java.base/java.util.concurrent.atomic=ALL-UNNAMED --add-opens=java.base/java.util.concurrent.locks=ALL-UNNAMED)

usage() {
  sed -n '2,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# The classpath: the resolved runner's libs/ (flink-runtime & co. come with it), or a shaded job-server jar.
classpath() {
  local jar
  jar="$(EMBER_FLINK_VERSION="$FLINK_VERSION" bash "$INFRA_DIR/flink.sh" path)" \
    || die "no Beam Flink job server is staged; run infra/flink.sh fetch first"
  if [[ -d "$(dirname "$jar")/libs" ]]; then
    printf '%s/libs/*\n' "$(dirname "$jar")"
  else
    printf '%s\n' "$jar"
  fi
}

write_conf() {
  ensure_dir "$CONF_DIR" "$ROOT/tmp" "$LOGS"
  # Heartbeats of 1 s / 6 s: a TaskManager killed with -9 is declared lost within seconds, the job
  # restarts (fixed-delay) and picks up the supervisor-restarted TaskManager's slots.
  cat >"$CONF_DIR/flink-conf.yaml.tmp" <<EOF
jobmanager.rpc.address: 127.0.0.1
jobmanager.rpc.port: $RPC_PORT
jobmanager.bind-host: 127.0.0.1
jobmanager.memory.process.size: 1024m
blob.server.port: $BLOB_PORT
rest.address: 127.0.0.1
rest.bind-address: 127.0.0.1
rest.port: $REST_PORT
taskmanager.host: 127.0.0.1
taskmanager.bind-host: 127.0.0.1
taskmanager.numberOfTaskSlots: $SLOTS
# Without flink-dist's BashJavaUtils the TaskManager needs its resource spec spelled out; the JVM flags in
# cmd_start match it (heap = framework + task heap, direct = framework + task off-heap + network).
taskmanager.cpu.cores: $SLOTS
taskmanager.memory.framework.heap.size: 128m
taskmanager.memory.task.heap.size: 384m
taskmanager.memory.framework.off-heap.size: 128m
taskmanager.memory.task.off-heap.size: 64m
taskmanager.memory.network.min: 192m
taskmanager.memory.network.max: 192m
taskmanager.memory.managed.size: 128m
taskmanager.memory.jvm-metaspace.size: 192m
taskmanager.memory.jvm-overhead.min: 192m
taskmanager.memory.jvm-overhead.max: 192m
parallelism.default: $((TASKMANAGERS * SLOTS))
restart-strategy.type: fixed-delay
restart-strategy.fixed-delay.attempts: 4
restart-strategy.fixed-delay.delay: 2 s
jobmanager.execution.failover-strategy: region
heartbeat.interval: 1000
heartbeat.timeout: 6000
slot.request.timeout: 60000
resourcemanager.taskmanager-timeout: 30000
io.tmp.dirs: $ROOT/tmp
web.submit.enable: true
# Classes come from the TaskManagers' own classpath (the same jars the job server stages): only then does
# Beam keep a TaskManager's SDK harness for the job's next stages instead of starting one per stage
# (parent-first for everything: Beam's classes parent-first with their joda-time child-first clash).
classloader.resolve-order: parent-first
EOF
  mv "$CONF_DIR/flink-conf.yaml.tmp" "$CONF_DIR/flink-conf.yaml"
}

jvm() {
  # usage: jvm HEAP MAIN ARGS...
  local heap="$1" cp
  shift
  cp="$(classpath)"
  printf '%s\0' java "-Xmx$heap" "${JAVA_OPENS[@]}" -Dlog.file="$LOGS/unused.log" -cp "$cp" "$@"
}

# The TaskManager supervisor: runs the JVM, records its pid, restarts it 1 s after it exits.
TM_SUPERVISOR='
pidfile="$1"; shift
trap "kill -TERM \"\$child\" 2>/dev/null; wait \"\$child\"; exit 0" TERM INT
while true; do
  "$@" & child=$!
  echo "$child" >"$pidfile"
  wait "$child" || true
  echo "[flink-cluster] taskmanager jvm $child exited; restarting in 1 s" >&2
  sleep 1
done'

# The command prefix that runs the worker pool in its own mount namespace (EMBER_FLINK_ISOLATED=1), else nothing.
isolation() {
  [[ "$ISOLATED" == 1 ]] || return 0
  need_cmd bwrap "EMBER_FLINK_ISOLATED=1 runs the worker pool under bubblewrap (Debian: apt-get install -y bubblewrap)."
  local args=(bwrap --dev-bind / / --tmpfs /tmp) dir hide
  # The code and its venv stay visible where they are, even in a checkout under /tmp (the private /tmp covers it).
  for dir in "$REPO" "$(dirname "$(dirname "$EMBER_PY")")"; do
    [[ "$dir" == /tmp/* ]] && args+=(--bind "$dir" "$dir")
  done
  IFS=: read -r -a hide <<<"${EMBER_FLINK_HIDE:-}"
  for dir in "${hide[@]}"; do
    [[ -d "$dir" ]] && args+=(--tmpfs "$dir")
  done
  printf '%s\0' "${args[@]}" --chdir / --
}

start_component() {
  # start_component NAME CMD...   (runs detached in its own process group)
  local name="$1" pid
  shift
  pid_running "$RUN/$name.pid" || : >"$LOGS/$name.log"  # a fresh log per (re)start of the component
  pid="$(start_bg "$RUN/$name.pid" "$LOGS/$name.log" "$@")"
  log_info "$name running (pid $pid, log $LOGS/$name.log)"
}

registered_taskmanagers() {
  curl -sf --max-time 2 "$REST_URL/overview" 2>/dev/null \
    | "$EMBER_PY" -c 'import json,sys; print(json.load(sys.stdin)["taskmanagers"])' 2>/dev/null || echo 0
}

cmd_start() {
  need_cmd java "Install a JDK >= 11 (Debian: apt-get install -y openjdk-17-jre-headless)."
  need_cmd curl "curl reads the Flink REST API for readiness."
  [[ -x "$EMBER_PY" ]] || die "python not found at $EMBER_PY (the worker pool runs the Beam Python SDK)"
  local cmd=() i
  classpath >/dev/null
  write_conf
  mapfile -d '' cmd < <(jvm 768m org.apache.flink.runtime.entrypoint.StandaloneSessionClusterEntrypoint --configDir "$CONF_DIR")
  start_component jobmanager "${cmd[@]}"
  for ((i = 1; i <= TASKMANAGERS; i++)); do
    mapfile -d '' cmd < <(jvm 512m -XX:MaxDirectMemorySize=384m -XX:MaxMetaspaceSize=192m org.apache.flink.runtime.taskexecutor.TaskManagerRunner \
      --configDir "$CONF_DIR" -Dtaskmanager.resource-id="ember-tm-$i")
    start_component "tm-$i" bash -c "$TM_SUPERVISOR" tm-supervisor "$RUN/tm-$i.jvm.pid" "${cmd[@]}"
  done
  mapfile -d '' cmd < <(jvm 768m org.apache.beam.runners.flink.FlinkJobServerDriver --flink-master="127.0.0.1:$REST_PORT" \
    --flink-conf-dir="$CONF_DIR" --job-host=127.0.0.1 --job-port="$JOB_PORT" --artifact-port="$ARTIFACT_PORT" \
    --expansion-port="$EXPANSION_PORT" --artifacts-dir="$ROOT/artifacts")
  start_component job-server "${cmd[@]}"
  # The pool starts each SDK harness as `python -c ...`: the venv's bin/ comes first on PATH.
  local isolate=()
  mapfile -d '' isolate < <(isolation)
  # Every pool starts each harness as Beam's SDK container does, with the job's pipeline options (s3:// needs them
  # in the workers; ember/dev/flink_boot.py): a bare `python -c` harness has none, and every s3:// call fails.
  local boot=(--container_executable="$INFRA_DIR/flink-worker-boot.sh")
  start_component worker-pool "${isolate[@]}" env PATH="$(dirname "$EMBER_PY"):$PATH" PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" \
    "$EMBER_PY" -m apache_beam.runners.worker.worker_pool_main --service_port="$POOL_PORT" "${boot[@]}"
  local deadline=$((SECONDS + READY_TIMEOUT)) n=0
  while ((SECONDS < deadline)); do
    n="$(registered_taskmanagers)"
    if ((n >= TASKMANAGERS)) && port_open 127.0.0.1 "$JOB_PORT" && port_open "$POOL_HOST" "$POOL_PORT"; then
      log_info "ready: $n TaskManagers registered at $REST_URL, job server 127.0.0.1:$JOB_PORT, worker pool $POOL_HOST:$POOL_PORT"
      return 0
    fi
    sleep 1
  done
  tail_log "$LOGS/jobmanager.log" 20
  die "not ready after ${READY_TIMEOUT}s: $n of $TASKMANAGERS TaskManagers registered at $REST_URL/overview, job server port $JOB_PORT $(port_open 127.0.0.1 "$JOB_PORT" && echo open || echo closed), worker pool port $POOL_PORT $(port_open "$POOL_HOST" "$POOL_PORT" && echo open || echo closed) (logs in $LOGS)"
}

stop_group() {
  # The supervisors and JVMs run in their own sessions (setsid): stop the whole group.
  local name="$1" pid deadline
  pid="$(pid_read "$RUN/$name.pid" 2>/dev/null)" || { rm -f "$RUN/$name.pid"; return 0; }
  log_info "stopping $name (pid $pid)"
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  deadline=$((SECONDS + 20))
  while pid_alive "$pid" && ((SECONDS < deadline)); do sleep 0.5; done
  pid_alive "$pid" && kill -KILL -- "-$pid" 2>/dev/null
  rm -f "$RUN/$name.pid" "$RUN/$name.jvm.pid"
}

cmd_stop() {
  local f name
  for name in worker-pool job-server; do stop_group "$name"; done
  for f in "$RUN"/tm-*.pid; do
    [[ -e "$f" && "$f" != *.jvm.pid ]] || continue
    name="$(basename "$f" .pid)"
    stop_group "$name"
  done
  stop_group jobmanager
}

cmd_status() {
  local name missing=() n i
  for name in jobmanager job-server worker-pool; do pid_running "$RUN/$name.pid" || missing+=("$name"); done
  for ((i = 1; i <= TASKMANAGERS; i++)); do pid_running "$RUN/tm-$i.pid" || missing+=("tm-$i"); done
  if ((${#missing[@]} == TASKMANAGERS + 3)); then
    status_line "$NAME" stopped - "not started (infra/flink-cluster.sh start)"
    return 0
  fi
  n="$(registered_taskmanagers)"
  if ((${#missing[@]} == 0)) && ((n >= TASKMANAGERS)); then
    status_line "$NAME" running "$REST_URL" "$n TaskManagers; job server 127.0.0.1:$JOB_PORT; worker pool $POOL_HOST:$POOL_PORT"
  else
    status_line "$NAME" degraded "$REST_URL" "$n of $TASKMANAGERS TaskManagers registered; not running: ${missing[*]:-none}"
  fi
}

cmd_args() {
  printf '%s\n' --runner=PortableRunner "--job_endpoint=127.0.0.1:$JOB_PORT" \
    "--artifact_endpoint=127.0.0.1:$ARTIFACT_PORT" --environment_type=EXTERNAL \
    "--environment_config=$POOL_HOST:$POOL_PORT" "--parallelism=$((TASKMANAGERS * SLOTS))" \
    "--flink_master=127.0.0.1:$REST_PORT" --environment_cache_millis=600000
}

cmd_tm_pid() {
  [[ "${1:-}" =~ ^[0-9]+$ ]] || die "usage: infra/flink-cluster.sh tm-pid N"
  pid_read "$RUN/tm-$1.jvm.pid" TaskManagerRunner || die "TaskManager $1 is not running"
}

case "${1:-}" in
  start) acquire_lock "$NAME" 300; cmd_start ;;
  stop) acquire_lock "$NAME" 300; cmd_stop ;;
  status) cmd_status ;;
  args) cmd_args ;;
  tm-pid) cmd_tm_pid "${2:-}" ;;
  *) usage ;;
esac
