#!/usr/bin/env bash
# Regional Kafka clusters mirrored into the central (training) cluster by MirrorMaker 2, all on 127.0.0.1.
#
#   infra/regions.sh start us,eu     one KRaft cluster per region (infra/kafka.sh, named kafka-<region>), then MM2
#   infra/regions.sh stop            stop MM2 and every regional cluster started so far
#   infra/regions.sh status          one status line per regional cluster, and one for mm2
#   infra/regions.sh bootstrap R     prints 127.0.0.1:<port> of region R's cluster
#   infra/regions.sh broker R start|stop   one regional cluster only (outage tests)
#   infra/regions.sh mm2 start|stop|kill   MirrorMaker 2 only; kill is SIGKILL (the crash the fault tests make)
#   infra/regions.sh --secure <any of the above>   the secured set (below); the two sets can run side by side
#
# The central cluster is infra/kafka.sh's broker (start it first). MM2 runs in dedicated mode on Kafka Connect with
# exactly.once.source.support=enabled on every target and the intra-cluster REST of KIP-710; it copies each region's
# *.rollouts and *.rewards into central as <region>.<topic>, and central's *.policy-versions into every region as
# central.<topic>. A region's ports are given once and kept ($EMBER_HOME/regions/ports): slot n>=1 has client port
# 19300+10n, controller +1. MM2's internal REST server (one per node, every flow behind it) listens on 127.0.0.1:19302.
# --secure: central is kafka-secure (start it first); each region is infra/kafka-secure.sh named kafka-secure-<region>
# (SASL_SSL + SCRAM-SHA-512, kafka-secure's CA and role passwords, deny-by-default authorizer) on 19400+10n; MM2
# (state in mm2-secure/, REST on 127.0.0.1:19402) talks SASL_SSL as ember-mirror, its password read by Kafka's
# FileConfigProvider from the 0600 mirror.properties (never in its config, argv or log), with MM2's own ACLs
# (ember.rollouts.acls.mirror_cluster_bindings) applied on every cluster; a deployment's topics are granted with
# `ember rollouts acls --prefix P --region R --apply`.
# Env: EMBER_HOME, EMBER_REGION_HEAP (384m), EMBER_MM2_HEAP (512m), EMBER_MM2_START_TIMEOUT (180 seconds),
#      EMBER_MM2_OUT_TOPICS (regex of central topics copied out to every region; .*\.policy-versions): a central
#      cluster shared by many test prefixes narrows it, or every region holds a copy of every prefix's versions.
# Idempotent: a running MM2 whose config is what this start would write is left alone, another one is restarted.
set -euo pipefail

# shellcheck source=infra/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
EMBER_LOG_TAG=regions

SECURE=0
if [[ "${1:-}" == --secure ]]; then
  SECURE=1
  shift
fi
# Every path, port and name below differs between the two sets, so a secured set never touches a plaintext one.
MM2_NAME=mm2
SELF="infra/regions.sh"  # how messages name this script for the set in use
REGIONS_DIR="$EMBER_HOME/regions"
CENTRAL_BOOTSTRAP="127.0.0.1:${EMBER_KAFKA_PORT:-19092}"
BASE_PORT=19300
if ((SECURE)); then
  MM2_NAME=mm2-secure
  SELF="infra/regions.sh --secure"
  REGIONS_DIR="$EMBER_HOME/regions-secure"
  CENTRAL_BOOTSTRAP="127.0.0.1:${EMBER_KAFKA_SECURE_PORT:-19192}"
  BASE_PORT=19400
  CRED_DIR="$EMBER_HOME/kafka-secure/credentials"  # infra/kafka-secure.sh's: ca.pem, <role>.password|properties
fi
# MM2's helpers below (readiness probe, hanging transactions, compaction) act as ember-admin on a secured set; the
# password is read from its 0600 file by the client, never passed on a command line.
ADMIN_CONFIG=()
if ((SECURE)); then
  ADMIN_CONFIG=(--command-config "$CRED_DIR/admin.properties")
  export MM2_ADMIN_PASSWORD_FILE="$CRED_DIR/admin.password" MM2_CAFILE="$CRED_DIR/ca.pem"
fi
MM2_VERSION=4.3.1
MM2_POM="$INFRA_DIR/kafka/mm2-pom.xml"
MM2_LIBS="$EMBER_HOME/cache/mm2-$MM2_VERSION/libs"
MM2_DIR="$EMBER_HOME/$MM2_NAME"
MM2_CONF="$MM2_DIR/mm2.properties"
MM2_LOG="$MM2_DIR/logs/mm2.log"
MM2_PID="$EMBER_RUN_DIR/$MM2_NAME.pid"
MM2_PID_PATTERN="org.apache.kafka.connect.mirror.MirrorMaker $MM2_CONF"
MM2_START_TIMEOUT="${EMBER_MM2_START_TIMEOUT:-180}"
PORTS_FILE="$REGIONS_DIR/ports"
CENTRAL=central

usage() {
  sed -n '2,26p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
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
  if ((SECURE)); then
    EMBER_KAFKA_SECURE_NAME="kafka-secure-$region" EMBER_KAFKA_SECURE_PORT="$port" EMBER_KAFKA_SECURE_CONTROLLER_PORT=$((port + 1)) \
      EMBER_KAFKA_HEAP="${EMBER_REGION_HEAP:-384m}" "$INFRA_DIR/kafka-secure.sh" "$action"
    return
  fi
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
    if ((SECURE)); then
      printf 'config.providers = file\nconfig.providers.file.class = org.apache.kafka.common.config.provider.FileConfigProvider\n'
    fi
    printf 'clusters = %s\n' "$(IFS=,; echo "$CENTRAL,$*")"
    printf '%s.bootstrap.servers = %s\n' "$CENTRAL" "$CENTRAL_BOOTSTRAP"
    mm2_security "$CENTRAL"
    printf 'listeners = http://127.0.0.1:%s\n' $((BASE_PORT + 2))
    printf '%s.exactly.once.source.support = enabled\n' "$CENTRAL"
    printf '%s.plugin.discovery = service_load\n' "$CENTRAL"
    printf '%s.consumer.isolation.level = read_committed\n' "$CENTRAL"
    for region in "$@"; do
      port="$(region_port "$region")"
      printf '%s.bootstrap.servers = 127.0.0.1:%s\n' "$region" "$port"
      mm2_security "$region"
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

# mm2_security ALIAS -- a secured cluster's client settings for every MM2 client of it (worker, producers, consumers,
# admins). The JAAS line, password included, stays in the 0600 mirror.properties: MM2 reads it from there through
# Kafka's FileConfigProvider when it builds a client, so it is in no config MM2 writes, no argv and no log.
mm2_security() {
  ((SECURE)) || return 0
  printf '%s.security.protocol = SASL_SSL\n' "$1"
  printf '%s.sasl.mechanism = SCRAM-SHA-512\n' "$1"
  printf '%s.sasl.jaas.config = ${file:%s:sasl.jaas.config}\n' "$1" "$CRED_DIR/mirror.properties"
  printf '%s.ssl.truststore.type = PEM\n' "$1"
  printf '%s.ssl.truststore.location = %s\n' "$1" "$CRED_DIR/ca.pem"
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
import os, sys
from pathlib import Path
from kafka import KafkaConsumer, TopicPartition
since_ms, pairs = int(sys.argv[1]), sys.argv[2:]
secured = os.environ.get("MM2_ADMIN_PASSWORD_FILE")
security = dict(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_plain_username="ember-admin",
                sasl_plain_password=Path(secured).read_text().strip(), ssl_cafile=os.environ["MM2_CAFILE"]) if secured else {}
for bootstrap, topic in zip(pairs[::2], pairs[1::2]):
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, request_timeout_ms=5000, consumer_timeout_ms=3000, **security)
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
import os, sys
from pathlib import Path
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient
secured = os.environ.get("MM2_ADMIN_PASSWORD_FILE")
security = dict(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_plain_username="ember-admin",
                sasl_plain_password=Path(secured).read_text().strip(), ssl_cafile=os.environ["MM2_CAFILE"]) if secured else {}
admin = KafkaAdminClient(bootstrap_servers=sys.argv[1], request_timeout_ms=30000, **security)
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
      "${ADMIN_CONFIG[@]}" abort --topic "$topic" --partition "$partition" --start-offset "$start" >/dev/null 2>&1 \
      || log_warn "could not abort it: kafka-transactions.sh --bootstrap-server $bootstrap abort --topic $topic --partition $partition --start-offset $start"
  done < <(java -XX:TieredStopAtLevel=1 -cp "$classpath" org.apache.kafka.tools.TransactionsCommand --bootstrap-server "$bootstrap" \
    "${ADMIN_CONFIG[@]}" find-hanging --broker-id 1 --max-transaction-timeout 1 2>/dev/null | awk -v re="$regex" 'NR > 1 && $1 ~ re {print $1, $2, $6, $8}')
}

# mm2_grant R... -- on a secured set, MM2's own ACLs on every cluster (ember.rollouts.acls.mirror_cluster_bindings),
# created as ember-admin where missing: central takes copies from the regions, each region from central.
mm2_grant() {
  ((SECURE)) || return 0
  local args=("$CENTRAL_BOOTSTRAP=$(IFS=,; echo "$*")") region
  for region in "$@"; do
    args+=("127.0.0.1:$(region_port "$region")=$CENTRAL")
  done
  "$EMBER_PY" - "${args[@]}" <<'PY' || die "could not apply MirrorMaker 2's ACLs as ember-admin (the error is above)"
import os
import sys

from ember.rollouts.acls import mirror_cluster_bindings
from ember.rollouts.admin import apply_acls
from ember.rollouts.security import KafkaSecurity

admin = KafkaSecurity(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_plain_username="ember-admin",
                      sasl_plain_password_file=os.environ["MM2_ADMIN_PASSWORD_FILE"], ssl_cafile=os.environ["MM2_CAFILE"])
for arg in sys.argv[1:]:
    bootstrap, sources = arg.split("=")
    apply_acls(bootstrap, mirror_cluster_bindings(sources.split(",")), admin)
PY
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
  ((${#regions[@]})) || die "mm2 start: no regions (start some first: $SELF start us,eu)" 2
  mm2_write_config "${regions[@]}"
  if pid="$(pid_read "$MM2_PID" "$MM2_PID_PATTERN" 2>/dev/null)"; then
    if cmp -s "$MM2_CONF" "$MM2_CONF.next"; then
      rm -f "$MM2_CONF.next"
      log_info "mm2 already running (pid $pid) for ${regions[*]}"
      return 0
    fi
    log_info "mm2 (pid $pid) runs another config; restarting it for ${regions[*]}"
    stop_pid "$MM2_NAME" "$MM2_PID" 30 "$MM2_PID_PATTERN"
  fi
  mv "$MM2_CONF.next" "$MM2_CONF"
  mm2_launch
}

# mm2_launch -- start MM2 on the config last written (a restart after a crash keeps it) and wait for it.
mm2_launch() {
  local regions pid t0=$SECONDS deadline next_abort since_ms missing=""
  read -r -a regions <<<"$(mm2_regions)"
  ((${#regions[@]})) || die "mm2 has no config yet: $SELF start us,eu first" 2
  if pid="$(pid_read "$MM2_PID" "$MM2_PID_PATTERN" 2>/dev/null)"; then
    log_info "mm2 already running (pid $pid)"
    return 0
  fi
  port_open 127.0.0.1 "${CENTRAL_BOOTSTRAP##*:}" \
    || die "the central cluster is not up at $CENTRAL_BOOTSTRAP: run infra/$( ((SECURE)) && echo kafka-secure || echo kafka).sh start first"
  need_cmd java "Install a JDK >= 17 (Debian: apt-get install -y openjdk-17-jre-headless)."
  ensure_mm2_libs
  mm2_grant "${regions[@]}"
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
  [[ -n "${1:-}" ]] || die "start needs the regions, e.g. $SELF start us,eu" 2
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
  acquire_lock "$MM2_NAME"
  mm2_start "${regions[@]}"
}

cmd_stop() {
  local region
  acquire_lock "$MM2_NAME"
  stop_pid "$MM2_NAME" "$MM2_PID" 30 "$MM2_PID_PATTERN"
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
  status_line "$MM2_NAME" "$state" "$(mm2_regions | tr ' ' ,)" "$MM2_LOG"
}

cmd_mm2() {
  case "${1:-}" in
    start) acquire_lock "$MM2_NAME"; mm2_launch ;;
    stop) acquire_lock "$MM2_NAME"; stop_pid "$MM2_NAME" "$MM2_PID" 30 "$MM2_PID_PATTERN" ;;
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
    known_regions | grep -qx -- "$2" || die "region '$2' was never started here (known: $(known_regions | xargs)); run $SELF start $2" 2
    printf '127.0.0.1:%s\n' "$(region_port "$2")"
    ;;
  broker) [[ -n "${2:-}" && -n "${3:-}" ]] || usage; broker "$2" "$3" ;;
  mm2) shift; cmd_mm2 "$@" ;;
  *) usage ;;
esac
