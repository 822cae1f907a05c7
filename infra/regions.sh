#!/usr/bin/env bash
# Regional Kafka clusters mirrored into the central (training) cluster by MirrorMaker 2, all on 127.0.0.1.
#
#   infra/regions.sh start us,eu     one KRaft cluster per region (infra/kafka.sh, named kafka-<region>), then MM2
#   infra/regions.sh stop            stop MM2 and every regional cluster started so far
#   infra/regions.sh status          one status line per regional cluster, and one for mm2
#   infra/regions.sh bootstrap R     prints 127.0.0.1:<port> of region R's cluster
#   infra/regions.sh broker R start|stop   one regional cluster only (outage tests)
#   infra/regions.sh mm2 start|stop|kill   MirrorMaker 2 only; kill is SIGKILL (the crash the fault tests make)
#
# The central cluster is infra/kafka.sh's broker (start it first). MM2 runs in dedicated mode on Kafka Connect with
# exactly.once.source.support=enabled on every target and the intra-cluster REST of KIP-710; it copies each region's
# *.rollouts and *.rewards into central as <region>.<topic>, and central's *.policy-versions into every region as
# central.<topic>. A region's ports are given once and kept ($EMBER_HOME/regions/ports): slot n>=1 has client port
# 19300+10n, controller +1. MM2's internal REST server (one per node, every flow behind it) listens on 127.0.0.1:19302.
# Env: EMBER_HOME, EMBER_REGION_HEAP (384m), EMBER_MM2_HEAP (512m), EMBER_MM2_START_TIMEOUT (180 seconds),
#      EMBER_MM2_OUT_TOPICS (regex of central topics copied out to every region; .*\.policy-versions): a central
#      cluster shared by many test prefixes narrows it, or every region holds a copy of every prefix's versions.
# Idempotent: a running MM2 whose config is what this start would write is left alone, another one is restarted.
set -euo pipefail

# shellcheck source=infra/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
EMBER_LOG_TAG=regions

MM2_VERSION=4.3.1
MM2_POM="$INFRA_DIR/kafka/mm2-pom.xml"
MM2_LIBS="$EMBER_HOME/cache/mm2-$MM2_VERSION/libs"
MM2_DIR="$EMBER_HOME/mm2"
MM2_CONF="$MM2_DIR/mm2.properties"
MM2_LOG="$MM2_DIR/logs/mm2.log"
MM2_PID="$EMBER_RUN_DIR/mm2.pid"
MM2_PID_PATTERN="org.apache.kafka.connect.mirror.MirrorMaker $MM2_CONF"
MM2_START_TIMEOUT="${EMBER_MM2_START_TIMEOUT:-180}"
REGIONS_DIR="$EMBER_HOME/regions"
PORTS_FILE="$REGIONS_DIR/ports"
CENTRAL=central
CENTRAL_BOOTSTRAP="127.0.0.1:${EMBER_KAFKA_PORT:-19092}"
BASE_PORT=19300

usage() {
  sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

check_region() {
  [[ "$1" =~ ^[a-z][a-z0-9]{0,15}$ && "$1" != "$CENTRAL" ]] \
    || die "region '$1' must be 1-16 lowercase letters and digits, starting with a letter, and not '$CENTRAL'" 2
}

# region_slot R -- the slot of region R, given on first use and kept (ports must not move under a running cluster).
region_slot() {
  local region="$1" slot
  ensure_dir "$REGIONS_DIR"
  slot="$(awk -v r="$region" '$1 == r {print $2}' "$PORTS_FILE" 2>/dev/null || true)"
  if [[ -z "$slot" ]]; then
    slot=$(($(awk 'BEGIN {m = 0} $2 > m {m = $2} END {print m}' "$PORTS_FILE" 2>/dev/null || echo 0) + 1))
    printf '%s %s\n' "$region" "$slot" >>"$PORTS_FILE"
  fi
  printf '%s\n' "$slot"
}

known_regions() {
  [[ -f "$PORTS_FILE" ]] && awk '{print $1}' "$PORTS_FILE"
  return 0
}

region_port() { printf '%s\n' $((BASE_PORT + 10 * $(region_slot "$1"))); }

# The regions MM2 was last started for (its config names them); empty when it never was.
mm2_regions() {
  [[ -f "$MM2_CONF" ]] && sed -n 's/^# regions: //p' "$MM2_CONF"
  return 0
}

broker() {
  local region="$1" action="$2" port
  check_region "$region"
  port="$(region_port "$region")"
  EMBER_KAFKA_NAME="kafka-$region" EMBER_KAFKA_PORT="$port" EMBER_KAFKA_CONTROLLER_PORT=$((port + 1)) \
    EMBER_KAFKA_HEAP="${EMBER_REGION_HEAP:-384m}" "$INFRA_DIR/kafka.sh" "$action"
}

mm2_digest() { sha256sum "$MM2_POM" | awk '{print $1}'; }

ensure_mm2_libs() {
  if [[ -f "$MM2_LIBS/.ember-resolved" && "$(cat "$MM2_LIBS/.ember-resolved")" == "$(mm2_digest)" ]]; then
    return 0
  fi
  need_cmd mvn "Install Maven (Debian: apt-get install -y maven); it resolves the MirrorMaker 2 jars."
  local tmp="$MM2_LIBS.tmp.$$" mvn_log
  mvn_log="$(dirname "$MM2_LIBS")/mvn-resolve.log"
  ensure_dir "$(dirname "$MM2_LIBS")"
  rm -rf "$tmp"
  log_info "resolving MirrorMaker 2 ($MM2_VERSION) jars with Maven into $MM2_LIBS (first run only)"
  if ! mvn -q -B -f "$MM2_POM" dependency:copy-dependencies -DoutputDirectory="$tmp" -DincludeScope=runtime >"$mvn_log" 2>&1; then
    tail_log "$mvn_log" 40
    rm -rf "$tmp"
    die "mvn could not resolve the MirrorMaker 2 classpath from $MM2_POM (full log: $mvn_log)"
  fi
  [[ -f "$tmp/connect-mirror-$MM2_VERSION.jar" ]] || die "mvn finished but connect-mirror-$MM2_VERSION.jar is missing"
  rm -rf "$MM2_LIBS"
  mv "$tmp" "$MM2_LIBS"
  mm2_digest >"$MM2_LIBS/.ember-resolved"
}

# mm2_write_config R... -- one dedicated MM2 node driving every flow: region->central (rollouts, rewards) and
# central->region (policy versions). Every cluster is a target, so each gets its own EOS worker; the one REST server
# is bound to 127.0.0.1 (its default, http://:8083, listens on every interface).
mm2_write_config() {
  local region port a b
  ensure_dir "$MM2_DIR" "$MM2_DIR/logs"
  {
    printf '# Generated by infra/regions.sh -- edits are overwritten on every start.\n'
    printf '# regions: %s\n' "$*"
    printf 'clusters = %s\n' "$(IFS=,; echo "$CENTRAL,$*")"
    printf '%s.bootstrap.servers = %s\n' "$CENTRAL" "$CENTRAL_BOOTSTRAP"
    printf 'listeners = http://127.0.0.1:%s\n' $((BASE_PORT + 2))
    printf '%s.exactly.once.source.support = enabled\n' "$CENTRAL"
    printf '%s.plugin.discovery = service_load\n' "$CENTRAL"
    printf '%s.consumer.isolation.level = read_committed\n' "$CENTRAL"
    for region in "$@"; do
      port="$(region_port "$region")"
      printf '%s.bootstrap.servers = 127.0.0.1:%s\n' "$region" "$port"
      printf '%s.exactly.once.source.support = enabled\n' "$region"
      printf '%s.plugin.discovery = service_load\n' "$region"
      printf '%s.consumer.isolation.level = read_committed\n' "$region"
      printf '%s->%s.enabled = true\n' "$region" "$CENTRAL"
      printf '%s->%s.topics = .*\\.rollouts, .*\\.rewards\n' "$region" "$CENTRAL"
      printf '%s->%s.enabled = true\n' "$CENTRAL" "$region"
      printf '%s->%s.topics = %s\n' "$CENTRAL" "$region" "${EMBER_MM2_OUT_TOPICS:-.*\\.policy-versions}"
    done
    for a in "$@"; do
      for b in "$@"; do
        [[ "$a" == "$b" ]] || printf '%s->%s.enabled = false\n%s->%s.emit.heartbeats.enabled = false\n' "$a" "$b" "$a" "$b"
      done
    done
    cat <<CONF
# KIP-618 (above, per target: a worker setting): each target's Connect worker writes records and source offsets in
# one transaction. plugin.discovery (per target too): plugins found from their ServiceLoader manifests instead of a
# scan of every jar, which cost ~10 s per target's worker at each start (three for us,eu) at load 20.
# KIP-710: followers reach the leader over an internal-only REST server (on the listeners above).
dedicated.mode.enable.internal.rest = true
rest.advertised.host.name = 127.0.0.1
# Each cluster's <alias>.consumer.isolation.level (above) is what MM2's replication consumer reads with: its default
# is read_uncommitted, which copies a region's aborted transactions into central as committed records.
# (exactly.once.support=required cannot be set per flow: the heartbeat and checkpoint connectors lack the preflight
# check and would refuse to start.) Readers of the mirrored topics must read_committed too.
# New rollout topics are picked up within seconds, not the default 10 minutes.
refresh.topics.interval.seconds = 2
refresh.groups.enabled = false
sync.group.offsets.enabled = false
sync.topic.acls.enabled = false
emit.heartbeats.interval.seconds = 1
offset.lag.max = 0
tasks.max = 1
replication.factor = 1
checkpoints.topic.replication.factor = 1
heartbeats.topic.replication.factor = 1
offset-syncs.topic.replication.factor = 1
offset.storage.replication.factor = 1
status.storage.replication.factor = 1
config.storage.replication.factor = 1
CONF
  } >"$MM2_CONF.next"
}

# mm2_probe SINCE_MS R... -- true when every flow carried a heartbeat stamped at or after SINCE_MS end to end (else
# prints the first flow without one):
# <region>.heartbeats in central, central.heartbeats in each region (an old heartbeat proves nothing about this start).
mm2_probe() {
  local since_ms="$1" args=() region
  shift
  for region in "$@"; do
    args+=("$CENTRAL_BOOTSTRAP" "$region.heartbeats" "127.0.0.1:$(region_port "$region")" "$CENTRAL.heartbeats")
  done
  "$EMBER_PY" - "$since_ms" "${args[@]}" 2>/dev/null <<'PY'
import sys
from kafka import KafkaConsumer, TopicPartition
since_ms, pairs = int(sys.argv[1]), sys.argv[2:]
for bootstrap, topic in zip(pairs[::2], pairs[1::2]):
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, request_timeout_ms=5000, consumer_timeout_ms=3000)
    try:
        found = consumer.offsets_for_times({TopicPartition(topic, p): since_ms for p in consumer.partitions_for_topic(topic) or ()})
        if not any(found.values()):
            print(f"no heartbeat since this start in {topic} on {bootstrap}")
            sys.exit(1)
    finally:
        consumer.close()
PY
}

# mm2_compact_offsets R... -- MM2's source-offset topics in central (one record per flush per partition: 10^5 after a day
# of tests) roll a segment every 10 minutes, so the broker compacts them to one record per partition: every reader of
# replication lag (ember.rollouts.mirror) starts by reading them whole. Incremental: Connect's cleanup.policy stays.
mm2_compact_offsets() {
  "$EMBER_PY" - "$CENTRAL_BOOTSTRAP" "$@" <<'PY'
import sys
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient
admin = KafkaAdminClient(bootstrap_servers=sys.argv[1], request_timeout_ms=30000)
try:
    topics = set(admin.list_topics())
    names = [f"mm2-offsets.{region}.internal" for region in sys.argv[2:]]
    resources = [ConfigResource(ConfigResourceType.TOPIC, n, configs={"segment.ms": "600000"}) for n in names if n in topics]
    if resources:
        admin.alter_configs(resources)
finally:
    admin.close()
PY
}

# mm2_abort_hanging BOOTSTRAP TOPIC_REGEX -- abort the transactions MM2's dead producers left open on one cluster.
# A producer of MM2's that dies mid-transaction while its coordinator is unreachable (a central broker restart, MM2
# killed) can leave a transaction the coordinator no longer tracks: it is never aborted. On MM2's offsets topic it
# holds the last stable offset, and a restarted MM2 worker reads that topic to its end before anything else, forever
# (no heartbeat within the start timeout); on a mirrored topic it holds every read_committed reader (the ETL).
# Only MM2's own topics, and only transactions open for over a minute (longer than any transaction of its producers
# may live: their transaction.timeout.ms is the default 60 s) that the coordinator no longer tracks, so no live
# transaction is touched, with MM2 up or down. Kafka's own tool (KIP-664) finds and aborts them.
mm2_abort_hanging() {
  local bootstrap="$1" regex="$2" classpath topic partition start minutes
  classpath="$("$INFRA_DIR/kafka.sh" classpath)"
  while read -r topic partition start minutes; do
    log_warn "aborting a hanging transaction of MM2 on $bootstrap: $topic[$partition] from offset $start, open ${minutes} min"
    java -XX:TieredStopAtLevel=1 -cp "$classpath" org.apache.kafka.tools.TransactionsCommand --bootstrap-server "$bootstrap" \
      abort --topic "$topic" --partition "$partition" --start-offset "$start" >/dev/null 2>&1 \
      || log_warn "could not abort it: kafka-transactions.sh --bootstrap-server $bootstrap abort --topic $topic --partition $partition --start-offset $start"
  done < <(java -XX:TieredStopAtLevel=1 -cp "$classpath" org.apache.kafka.tools.TransactionsCommand --bootstrap-server "$bootstrap" \
    find-hanging --broker-id 1 --max-transaction-timeout 1 2>/dev/null | awk -v re="$regex" 'NR > 1 && $1 ~ re {print $1, $2, $6, $8}')
}

# mm2_abort_hanging_everywhere R... -- mm2_abort_hanging on MM2's own topics in central and in every region that is up:
# its internal ones, heartbeats, and the copies it writes (<region>. in central, central. in a region).
mm2_abort_hanging_everywhere() {
  local region
  mm2_abort_hanging "$CENTRAL_BOOTSTRAP" "^(mm2-.*[.]internal|heartbeats|($(IFS='|'; echo "$*"))[.].*)$"
  for region in "$@"; do
    if port_open 127.0.0.1 "$(region_port "$region")"; then
      mm2_abort_hanging "127.0.0.1:$(region_port "$region")" "^(mm2-.*[.]internal|heartbeats|$CENTRAL[.].*)$"
    fi
  done
}

# mm2_start R... -- MM2 for these regions with the config this start writes; one already running it is left alone.
mm2_start() {
  local regions=("$@") pid
  ((${#regions[@]})) || die "mm2 start: no regions (start some first: infra/regions.sh start us,eu)" 2
  mm2_write_config "${regions[@]}"
  if pid="$(pid_read "$MM2_PID" "$MM2_PID_PATTERN" 2>/dev/null)"; then
    if cmp -s "$MM2_CONF" "$MM2_CONF.next"; then
      rm -f "$MM2_CONF.next"
      log_info "mm2 already running (pid $pid) for ${regions[*]}"
      return 0
    fi
    log_info "mm2 (pid $pid) runs another config; restarting it for ${regions[*]}"
    stop_pid mm2 "$MM2_PID" 30 "$MM2_PID_PATTERN"
  fi
  mv "$MM2_CONF.next" "$MM2_CONF"
  mm2_launch
}

# mm2_launch -- start MM2 on the config last written (a restart after a crash keeps it) and wait for it.
mm2_launch() {
  local regions pid t0=$SECONDS deadline next_abort since_ms missing=""
  read -r -a regions <<<"$(mm2_regions)"
  ((${#regions[@]})) || die "mm2 has no config yet: infra/regions.sh start us,eu first" 2
  if pid="$(pid_read "$MM2_PID" "$MM2_PID_PATTERN" 2>/dev/null)"; then
    log_info "mm2 already running (pid $pid)"
    return 0
  fi
  port_open 127.0.0.1 "${CENTRAL_BOOTSTRAP##*:}" || die "the central cluster is not up at $CENTRAL_BOOTSTRAP: run infra/kafka.sh start first"
  need_cmd java "Install a JDK >= 17 (Debian: apt-get install -y openjdk-17-jre-headless)."
  ensure_mm2_libs
  mm2_abort_hanging_everywhere "${regions[@]}"
  since_ms="$(date +%s%3N)"
  rotate_log "$MM2_LOG"
  printf '\n===== %s infra/regions.sh mm2 start =====\n' "$(date -Is)" >>"$MM2_LOG"
  pid="$(start_bg "$MM2_PID" "$MM2_LOG" \
    java "-Xmx${EMBER_MM2_HEAP:-512m}" -Xms128m -XX:+UseG1GC -XX:TieredStopAtLevel=1 -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="$INFRA_DIR/kafka/log4j2.properties" \
    -cp "$MM2_LIBS/*" org.apache.kafka.connect.mirror.MirrorMaker "$MM2_CONF")"
  log_info "mm2 started pid $pid; waiting up to ${MM2_START_TIMEOUT}s for a heartbeat through every flow"
  deadline=$((SECONDS + MM2_START_TIMEOUT))
  next_abort=$((SECONDS + 65))
  while ((SECONDS < deadline)); do
    if ((SECONDS >= next_abort)); then
      # A transaction left hanging moments before this start (central stopped mid-transaction and back within the
      # minute) was too young to tell from a live one above; by now it is not.
      mm2_abort_hanging_everywhere "${regions[@]}"
      next_abort=$((SECONDS + 30))
    fi
    if ! pid_alive "$pid"; then
      rm -f "$MM2_PID"
      tail_log "$MM2_LOG" 40
      die "mm2 (pid $pid) exited during startup; see $MM2_LOG"
    fi
    if missing="$(mm2_probe "$since_ms" "${regions[@]}")"; then
      log_info "mm2 ready (pid $pid) after $((SECONDS - t0))s: ${regions[*]} <-> $CENTRAL; log: $MM2_LOG"
      mm2_compact_offsets "${regions[@]}" || log_warn "could not set segment.ms on MM2's offsets topics in $CENTRAL (replication lag reads grow with them)"
      return 0
    fi
    sleep 2
  done
  tail_log "$MM2_LOG" 40
  die "mm2 (pid $pid) carried no heartbeat through every flow within ${MM2_START_TIMEOUT}s (${missing:-the probe could not read the heartbeat topics}) (a hanging transaction in an mm2-offsets topic holds a flow: kafka-transactions.sh find-hanging); see $MM2_LOG"
}

cmd_start() {
  [[ -n "${1:-}" ]] || die "start needs the regions, e.g. infra/regions.sh start us,eu" 2
  local regions=() region
  IFS=, read -r -a regions <<<"$1"
  for region in "${regions[@]}"; do
    check_region "$region"
    region_slot "$region" >/dev/null  # slots given one at a time: side by side, two new regions took the same ports
  done
  # The regions' brokers start side by side (each has its own lock); any that fails fails the start.
  local pids=() rc=0 pid
  for region in "${regions[@]}"; do
    broker "$region" start &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do
    wait "$pid" || rc=1
  done
  ((rc == 0)) || die "a regional cluster did not start (its error is above)"
  acquire_lock mm2
  mm2_start "${regions[@]}"
}

cmd_stop() {
  local region
  acquire_lock mm2
  stop_pid mm2 "$MM2_PID" 30 "$MM2_PID_PATTERN"
  for region in $(known_regions); do
    broker "$region" stop
  done
}

cmd_status() {
  local region state=stopped
  for region in $(known_regions); do
    broker "$region" status
  done
  pid_running "$MM2_PID" "$MM2_PID_PATTERN" && state=running
  status_line mm2 "$state" "$(mm2_regions | tr ' ' ,)" "$MM2_LOG"
}

cmd_mm2() {
  case "${1:-}" in
    start) acquire_lock mm2; mm2_launch ;;
    stop) acquire_lock mm2; stop_pid mm2 "$MM2_PID" 30 "$MM2_PID_PATTERN" ;;
    kill)
      local pid
      pid="$(pid_read "$MM2_PID" "$MM2_PID_PATTERN")" || die "mm2 is not running"
      kill -KILL "$pid"
      while pid_alive "$pid"; do sleep 0.1; done
      log_info "mm2 (pid $pid) killed with SIGKILL"
      ;;
    *) usage ;;
  esac
}

case "${1:-}" in
  start) shift; cmd_start "$@" ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  bootstrap)
    [[ -n "${2:-}" ]] || usage
    check_region "$2"
    known_regions | grep -qx -- "$2" || die "region '$2' was never started here (known: $(known_regions | xargs)); run infra/regions.sh start $2" 2
    printf '127.0.0.1:%s\n' "$(region_port "$2")"
    ;;
  broker) [[ -n "${2:-}" && -n "${3:-}" ]] || usage; broker "$2" "$3" ;;
  mm2) shift; cmd_mm2 "$@" ;;
  *) usage ;;
esac
