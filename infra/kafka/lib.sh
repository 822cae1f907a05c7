# shellcheck shell=bash
# Shared body of the two local Kafka brokers: infra/kafka.sh (PLAINTEXT quick-start) and
# infra/kafka-secure.sh (SASL_SSL + SCRAM-SHA-512 + StandardAuthorizer). Source it after
# infra/common.sh; do not execute it.
#
# The sourcing script sets, before calling any kafka_* command:
#   KAFKA_NAME           service name (status line, lock, pid file): kafka | kafka-secure
#   KAFKA_PORT           client listener port;   KAFKA_CPORT  controller listener port
#   KAFKA_DIR            per-instance state dir ($EMBER_HOME/<name>)
#   KAFKA_PID_PATTERN    substring of the broker's command line (guards pid reuse)
# and defines these hooks:
#   kafka_write_config   write $KAFKA_CONF (called on every start)
#   kafka_probe          true when the broker answers a metadata request on $KAFKA_BOOTSTRAP
#   kafka_format_args    print extra `kafka-storage format` arguments, one per line (may be
#                        secrets: they go through a mode-0600 java @argfile, never argv)
#   kafka_prepare        before write_config on a cold start (TLS material, credentials)
#   kafka_after_ready    after the broker answers (cold or idempotent start)
# kafka_init_paths derives the remaining KAFKA_* paths from those.

KAFKA_VERSION=4.4.0
KAFKA_HOST=127.0.0.1
KAFKA_HEAP="${EMBER_KAFKA_HEAP:-1G}"
KAFKA_START_TIMEOUT="${EMBER_KAFKA_START_TIMEOUT:-90}"
KAFKA_POM="$INFRA_DIR/kafka/pom.xml"
KAFKA_LOG4J="$INFRA_DIR/kafka/log4j2.properties"
KAFKA_LIBS="$EMBER_HOME/cache/kafka-$KAFKA_VERSION/libs"
KAFKA_LIBS_MARKER="$KAFKA_LIBS/.ember-resolved"

kafka_init_paths() {
  KAFKA_BOOTSTRAP="$KAFKA_HOST:$KAFKA_PORT"
  KAFKA_CONF="$KAFKA_DIR/server.properties"
  KAFKA_DATA="$KAFKA_DIR/data"
  KAFKA_LOGS="$KAFKA_DIR/logs"
  KAFKA_LOG="$KAFKA_LOGS/server.log"
  KAFKA_CLUSTER_ID_FILE="$KAFKA_DIR/cluster.id"
  KAFKA_PID="$EMBER_RUN_DIR/$KAFKA_NAME.pid"
}

# Hook defaults (a script overrides what it needs).
kafka_format_args() { :; }
kafka_prepare() { :; }
kafka_after_ready() { :; }

pom_digest() { sha256sum "$KAFKA_POM" | awk '{print $1}'; }

# Resolve the broker classpath from Maven Central into $KAFKA_LIBS (once; shared by both brokers).
ensure_libs() {
  if [[ -f "$KAFKA_LIBS_MARKER" && "$(cat "$KAFKA_LIBS_MARKER")" == "$(pom_digest)" ]]; then
    return 0
  fi
  need_cmd java "Install a JDK >= 17 (Debian: apt-get install -y openjdk-17-jre-headless)."
  need_cmd mvn "Install Maven (Debian: apt-get install -y maven); it resolves the Kafka jars."
  [[ -f "$KAFKA_POM" ]] || die "missing $KAFKA_POM"
  local tmp="$KAFKA_LIBS.tmp.$$" mvn_log
  mvn_log="$(dirname "$KAFKA_LIBS")/mvn-resolve.log"
  ensure_dir "$(dirname "$KAFKA_LIBS")"
  rm -rf "$tmp"
  log_info "resolving Kafka $KAFKA_VERSION jars with Maven into $KAFKA_LIBS (first run only)"
  if ! mvn -q -B -f "$KAFKA_POM" dependency:copy-dependencies \
      -DoutputDirectory="$tmp" -DincludeScope=runtime >"$mvn_log" 2>&1; then
    tail_log "$mvn_log" 40
    rm -rf "$tmp"
    die "mvn could not resolve the Kafka classpath from $KAFKA_POM (full log: $mvn_log)"
  fi
  compgen -G "$tmp/kafka_2.13-$KAFKA_VERSION.jar" >/dev/null \
    || die "mvn finished but $tmp/kafka_2.13-$KAFKA_VERSION.jar is missing"
  rm -rf "$KAFKA_LIBS"
  mv "$tmp" "$KAFKA_LIBS"
  pom_digest >"$KAFKA_LIBS_MARKER"
}

# Short-lived Kafka tools (StorageTool, ConfigCommand): C1-only JIT and the serial GC cut their start-up
# CPU by about 2/3 on a small machine. The broker itself is started by kafka_cmd_start, not by this.
kafka_java() {
  java -XX:TieredStopAtLevel=1 -XX:+UseSerialGC -cp "$KAFKA_LIBS/*" -Dlog4j2.configurationFile="$KAFKA_LOG4J" -Dkafka.logs.dir="$KAFKA_LOGS" "$@"
}

# kafka_java_argfile ARG... -- run a Kafka tool whose main class and arguments are read from
# stdin lines, through a mode-0600 java @argfile that is deleted afterwards. Arguments that
# carry secrets therefore never appear in /proc/<pid>/cmdline (ps). One argument per line;
# arguments must not contain whitespace, quotes or '#'.
kafka_java_argfile() {
  local argfile rc=0
  ensure_dir "$EMBER_RUN_DIR"
  argfile="$(umask 077 && mktemp "$EMBER_RUN_DIR/$KAFKA_NAME-args.XXXXXX")"
  cat >"$argfile"
  kafka_java "$@" "@$argfile" || rc=$?
  rm -f "$argfile"
  return "$rc"
}

# Format the KRaft storage directory once (skipped when meta.properties exists).
ensure_formatted() {
  if [[ -f "$KAFKA_DATA/meta.properties" ]]; then
    return 0
  fi
  local cluster_id out
  if [[ -s "$KAFKA_CLUSTER_ID_FILE" ]]; then
    cluster_id="$(cat "$KAFKA_CLUSTER_ID_FILE")"
  else
    cluster_id="$(kafka_java kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n 1 | tr -d '[:space:]')" \
      || die "kafka.tools.StorageTool random-uuid failed"
    [[ -n "$cluster_id" ]] || die "kafka.tools.StorageTool random-uuid printed nothing"
    printf '%s\n' "$cluster_id" >"$KAFKA_CLUSTER_ID_FILE"
  fi
  log_info "formatting KRaft storage in $KAFKA_DATA (cluster id $cluster_id)"
  if ! out="$({ printf '%s\n' kafka.tools.StorageTool format --standalone -t "$cluster_id" -c "$KAFKA_CONF"
                kafka_format_args; } | kafka_java_argfile 2>&1)"; then
    printf '%s\n' "$out" >&2
    die "kafka storage format failed (config $KAFKA_CONF)"
  fi
}

port_owner() {
  if command -v ss >/dev/null 2>&1; then
    ss -Hltnp "sport = :$1" 2>/dev/null | head -n 1 || true
  fi
}

kafka_wait_ready() {
  local pid="$1" deadline=$((SECONDS + KAFKA_START_TIMEOUT))
  while ((SECONDS < deadline)); do
    if ! pid_alive "$pid"; then
      rm -f "$KAFKA_PID"
      tail_log "$KAFKA_LOG" 40
      die "$KAFKA_NAME (pid $pid) exited during startup; see $KAFKA_LOG"
    fi
    if port_open "$KAFKA_HOST" "$KAFKA_PORT" && kafka_probe; then
      return 0
    fi
    sleep 1
  done
  tail_log "$KAFKA_LOG" 40
  die "$KAFKA_NAME (pid $pid) did not answer metadata requests on $KAFKA_BOOTSTRAP within ${KAFKA_START_TIMEOUT}s; see $KAFKA_LOG"
}

kafka_cmd_start() {
  local pid t0=$SECONDS
  if pid="$(pid_read "$KAFKA_PID" "$KAFKA_PID_PATTERN" 2>/dev/null)"; then
    if port_open "$KAFKA_HOST" "$KAFKA_PORT" && kafka_probe; then
      kafka_after_ready
      log_info "already running (pid $pid) at $KAFKA_BOOTSTRAP"
      return 0
    fi
    log_info "process $pid is up but not serving yet; waiting"
    kafka_wait_ready "$pid"
    kafka_after_ready
    log_info "ready (pid $pid) at $KAFKA_BOOTSTRAP"
    return 0
  fi
  need_cmd java "Install a JDK >= 17 (Debian: apt-get install -y openjdk-17-jre-headless)."
  local p
  for p in "$KAFKA_PORT" "$KAFKA_CPORT"; do
    if port_open "$KAFKA_HOST" "$p"; then
      die "port $KAFKA_HOST:$p is already in use by a process this script did not start: $(port_owner "$p")
       stop it, or pick other ports via ${KAFKA_PORT_ENV:-EMBER_KAFKA_PORT} / ${KAFKA_CPORT_ENV:-EMBER_KAFKA_CONTROLLER_PORT}"
    fi
  done
  ensure_libs
  ensure_dir "$KAFKA_DIR" "$KAFKA_DATA" "$KAFKA_LOGS"
  kafka_prepare
  kafka_write_config
  ensure_formatted
  rotate_log "$KAFKA_LOG"
  printf '\n===== %s infra/%s.sh start =====\n' "$(date -Is)" "$KAFKA_NAME" >>"$KAFKA_LOG"
  pid="$(start_bg "$KAFKA_PID" "$KAFKA_LOG" \
    java "-Xmx$KAFKA_HEAP" -Xms256m -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
    -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="$KAFKA_LOG4J" -Dkafka.logs.dir="$KAFKA_LOGS" \
    -cp "$KAFKA_LIBS/*" kafka.Kafka "$KAFKA_CONF")"
  log_info "started pid $pid; waiting up to ${KAFKA_START_TIMEOUT}s for $KAFKA_BOOTSTRAP"
  kafka_wait_ready "$pid"
  kafka_after_ready
  log_info "ready (pid $pid) at $KAFKA_BOOTSTRAP after $((SECONDS - t0))s; log: $KAFKA_LOG"
}

kafka_cmd_stop() {
  stop_pid "$KAFKA_NAME" "$KAFKA_PID" "${EMBER_KAFKA_STOP_TIMEOUT:-30}" "$KAFKA_PID_PATTERN"
}

kafka_cmd_status() {
  local state=stopped
  if pid_running "$KAFKA_PID" "$KAFKA_PID_PATTERN"; then
    state=running
  fi
  status_line "$KAFKA_NAME" "$state" "$KAFKA_BOOTSTRAP" "$KAFKA_LOG"
}

kafka_cmd_reset() {
  kafka_cmd_stop
  log_info "deleting $KAFKA_DATA and cluster id"
  rm -rf "$KAFKA_DATA" "$KAFKA_CLUSTER_ID_FILE"
}

# Broker settings both instances share (single node: every replication factor is 1).
kafka_common_config() {
  cat <<CONF
num.partitions=1
default.replication.factor=1
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
# Topics are created explicitly by ember code.
auto.create.topics.enable=false
delete.topic.enable=true
CONF
}
