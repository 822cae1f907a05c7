#!/usr/bin/env bash
# Secured local Kafka (KRaft, one combined broker+controller) on 127.0.0.1: SASL_SSL + SCRAM-SHA-512,
# TLS from a local CA, StandardAuthorizer with allow.everyone.if.no.acl.found=false.
# A separate instance from the PLAINTEXT quick-start broker (infra/kafka.sh); both share infra/kafka/lib.sh.
#
#   infra/kafka-secure.sh start        set up once (CA + broker cert, passwords, format with the admin SCRAM
#                                      credential), start, wait until ember-admin gets metadata over SASL_SSL,
#                                      create the role users with ConfigCommand (idempotent)
#   infra/kafka-secure.sh stop         SIGTERM (controlled shutdown), SIGKILL after a timeout
#   infra/kafka-secure.sh restart
#   infra/kafka-secure.sh status       kafka-secure<TAB>running|stopped<TAB>127.0.0.1:<port><TAB><server.log>
#   infra/kafka-secure.sh bootstrap    prints 127.0.0.1:<port>
#   infra/kafka-secure.sh credentials  prints the credentials directory (ca.pem, <role>.password, <role>.properties)
#   infra/kafka-secure.sh reset        stop and delete broker data, TLS material and credentials
#
# Env: EMBER_HOME, EMBER_KAFKA_SECURE_PORT (19192), EMBER_KAFKA_SECURE_CONTROLLER_PORT (19193),
#      EMBER_KAFKA_HEAP (1G), EMBER_KAFKA_START_TIMEOUT (90 seconds),
#      EMBER_KAFKA_SECURE_NAME (kafka-secure): kafka-secure-<region> is a secured regional cluster
#      (infra/regions.sh --secure): own ports, data and users, the central one's CA, certificate and passwords.
# Passwords are generated once, stored in mode-0600 files and never printed, logged or put on a command line.
set -euo pipefail

# shellcheck source=infra/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# shellcheck source=infra/kafka/lib.sh
source "$INFRA_DIR/kafka/lib.sh"

KAFKA_NAME="${EMBER_KAFKA_SECURE_NAME:-kafka-secure}"
[[ "$KAFKA_NAME" =~ ^kafka-secure(-[a-z][a-z0-9]{0,15})?$ ]] \
  || die "EMBER_KAFKA_SECURE_NAME must be kafka-secure or kafka-secure-<region>, got '$KAFKA_NAME'" 2
EMBER_LOG_TAG="$KAFKA_NAME"
KAFKA_PORT="${EMBER_KAFKA_SECURE_PORT:-19192}"
KAFKA_CPORT="${EMBER_KAFKA_SECURE_CONTROLLER_PORT:-19193}"
KAFKA_PORT_ENV=EMBER_KAFKA_SECURE_PORT
KAFKA_CPORT_ENV=EMBER_KAFKA_SECURE_CONTROLLER_PORT
KAFKA_DIR="$EMBER_HOME/$KAFKA_NAME"
kafka_init_paths
KAFKA_PID_PATTERN="$KAFKA_CONF"

# One CA, one broker certificate (SAN 127.0.0.1) and one password per role for every secured cluster: a regional
# cluster uses the central one's, so a role's identity is the same everywhere (the ETL's config names one of each).
CRED_DIR="$EMBER_HOME/kafka-secure/credentials"  # 0700: ca.pem, <role>.password (0600), <role>.properties (0600)
TLS_DIR="$EMBER_HOME/kafka-secure/tls"           # 0700: broker.p12 (PKCS12 keystore), keystore.password
CA_PEM="$CRED_DIR/ca.pem"
KEYSTORE="$TLS_DIR/broker.p12"
KEYSTORE_PASS_FILE="$TLS_DIR/keystore.password"
USERS_MARKER="$KAFKA_DIR/users.applied"
ROLES=(admin inference grader etl trainer mirror)  # mirror: MirrorMaker 2 (infra/regions.sh --secure)
ADMIN_USER=ember-admin
BROKER_PRINCIPAL=ember-kafka-secure   # CN of the broker certificate; its identity on the mTLS controller listener
SCRAM=SCRAM-SHA-512

usage() {
  sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

role_user() { printf 'ember-%s\n' "$1"; }
pw_file() { printf '%s/%s.password\n' "$CRED_DIR" "$1"; }
pw() { local v; v="$(<"$(pw_file "$1")")"; printf '%s' "${v//[[:space:]]/}"; }

# redact -- copy stdin to stdout with every role password replaced (for tool output shown on failure).
redact() {
  local text role p
  text="$(cat)"
  for role in "${ROLES[@]}"; do
    if [[ -s "$(pw_file "$role")" ]]; then
      p="$(pw "$role")"
      text="${text//"$p"/<redacted>}"
    fi
  done
  printf '%s\n' "$text"
}

# A random secret written straight to a mode-0600 file (hex: no quoting issues in JAAS or argfiles).
new_secret() {
  (umask 077 && openssl rand -hex 24 >"$1.tmp" && mv "$1.tmp" "$1")
}

ensure_passwords() {
  local role f
  if [[ -f "$KAFKA_DATA/meta.properties" && ! -s "$(pw_file admin)" ]]; then
    die "$KAFKA_DATA is formatted but $(pw_file admin) is missing: the admin SCRAM credential is lost.
       run infra/kafka-secure.sh reset (deletes the secured broker's data) and start again"
  fi
  for role in "${ROLES[@]}"; do
    f="$(pw_file "$role")"
    if [[ ! -s "$f" ]]; then
      log_info "generating a password for $(role_user "$role") in $f"
      new_secret "$f"
    fi
    chmod 0600 "$f"
  done
}

# Local CA + broker certificate (SAN IP:127.0.0.1, DNS:localhost), once. The CA key signs the broker
# certificate and is then deleted: no other certificate can be issued that the brokers trust.
ensure_tls() {
  if [[ -s "$CA_PEM" && -s "$KEYSTORE" && -s "$KEYSTORE_PASS_FILE" ]]; then
    return 0
  fi
  need_cmd openssl "Install openssl (Debian: apt-get install -y openssl); it creates the local CA."
  log_info "creating a local CA and the broker certificate in $TLS_DIR (first run only)"
  local work out
  work="$(mktemp -d "$TLS_DIR/gen.XXXXXX")"
  if ! out="$( (
    set -e
    cd "$work"
    umask 077
    openssl req -x509 -newkey rsa:2048 -sha256 -nodes -days 3650 -keyout ca.key -out ca.pem \
      -subj "/CN=ember-local-ca" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
    openssl req -newkey rsa:2048 -sha256 -nodes -keyout broker.key -out broker.csr -subj "/CN=$BROKER_PRINCIPAL"
    printf '%s\n' "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
      "extendedKeyUsage=serverAuth,clientAuth" "subjectAltName=IP:127.0.0.1,DNS:localhost" >broker.ext
    openssl x509 -req -sha256 -days 825 -in broker.csr -CA ca.pem -CAkey ca.key -CAcreateserial \
      -extfile broker.ext -out broker.pem
    openssl rand -hex 24 >keystore.password
    openssl pkcs12 -export -name broker -in broker.pem -inkey broker.key -certfile ca.pem \
      -passout file:keystore.password -out broker.p12
  ) 2>&1)"; then
    printf '%s\n' "$out" >&2
    rm -rf "$work"
    die "openssl could not create the CA / broker certificate"
  fi
  mv -f "$work/keystore.password" "$KEYSTORE_PASS_FILE"
  mv -f "$work/broker.p12" "$KEYSTORE"
  mv -f "$work/ca.pem" "$CA_PEM"
  chmod 0600 "$KEYSTORE_PASS_FILE" "$KEYSTORE"
  chmod 0644 "$CA_PEM"
  rm -rf "$work"
}

# Client properties for Kafka's Java tools (ConfigCommand, AclCommand, ProducerPerformance --command-config).
write_client_properties() {
  local role f
  for role in "${ROLES[@]}"; do
    f="$CRED_DIR/$role.properties"
    (umask 077 && cat >"$f.tmp" <<PROPS
# Generated by infra/kafka-secure.sh: Java client settings for $(role_user "$role"). Mode 0600.
security.protocol=SASL_SSL
sasl.mechanism=$SCRAM
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="$(role_user "$role")" password="$(pw "$role")";
ssl.truststore.type=PEM
ssl.truststore.location=$CA_PEM
PROPS
    )
    mv -f "$f.tmp" "$f"
  done
}

kafka_prepare() {
  if [[ "$KAFKA_NAME" != kafka-secure ]]; then
    [[ -s "$CA_PEM" && -s "$KEYSTORE" && -s "$(pw_file admin)" && -s "$(pw_file mirror)" ]] \
      || die "$KAFKA_NAME uses kafka-secure's CA and credentials ($CRED_DIR), which are missing: start kafka-secure first (infra/kafka-secure.sh start)"
    chmod 0700 "$KAFKA_DIR"
    return 0
  fi
  need_cmd openssl "Install openssl (Debian: apt-get install -y openssl)."
  ensure_dir "$CRED_DIR" "$TLS_DIR"
  chmod 0700 "$KAFKA_DIR" "$CRED_DIR" "$TLS_DIR"
  ensure_passwords
  ensure_tls
  write_client_properties
}

kafka_write_config() {
  local tmp="$KAFKA_CONF.tmp"
  (umask 077 && cat >"$tmp" <<CONF
# Generated by infra/kafka-secure.sh -- edits are overwritten on every start. Mode 0600 (holds secrets).
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=$KAFKA_HOST:$KAFKA_CPORT
# Clients and the inter-broker channel: SASL_SSL (SCRAM-SHA-512) only. The controller listener takes
# mutual TLS: only a certificate signed by the local CA (the broker's own) gets through.
listeners=SASL_SSL://$KAFKA_HOST:$KAFKA_PORT,CONTROLLER://$KAFKA_HOST:$KAFKA_CPORT
advertised.listeners=SASL_SSL://$KAFKA_HOST:$KAFKA_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=SASL_SSL
listener.security.protocol.map=CONTROLLER:SSL,SASL_SSL:SASL_SSL
sasl.enabled.mechanisms=$SCRAM
sasl.mechanism.inter.broker.protocol=$SCRAM
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="$ADMIN_USER" password="$(pw admin)";
ssl.keystore.type=PKCS12
ssl.keystore.location=$KEYSTORE
ssl.keystore.password=$(<"$KEYSTORE_PASS_FILE")
ssl.key.password=$(<"$KEYSTORE_PASS_FILE")
ssl.truststore.type=PEM
ssl.truststore.location=$CA_PEM
ssl.endpoint.identification.algorithm=https
listener.name.controller.ssl.client.auth=required
ssl.principal.mapping.rules=RULE:^CN=([^,]+)\$/\$1/,DEFAULT
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:$ADMIN_USER;User:$BROKER_PRINCIPAL
log.dirs=$KAFKA_DATA
$(kafka_common_config)
CONF
  )
  mv "$tmp" "$KAFKA_CONF"
}

# The admin SCRAM credential goes into the metadata log at format time (the role users need a running broker).
kafka_format_args() {
  printf '%s\n' --add-scram "$SCRAM=[name=$ADMIN_USER,password=$(pw admin)]"
}

# True when ember-admin gets metadata over SASL_SSL (password read from its file, never argv).
kafka_probe() {
  if [[ -x "$EMBER_PY" ]]; then
    "$EMBER_PY" - "$KAFKA_BOOTSTRAP" "$ADMIN_USER" "$(pw_file admin)" "$CA_PEM" >/dev/null 2>&1 <<'PY'
import sys
from pathlib import Path
from kafka import KafkaAdminClient
bootstrap, user, pw_file, cafile = sys.argv[1:5]
admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="ember-infra-probe",
                         security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
                         sasl_plain_username=user, sasl_plain_password=Path(pw_file).read_text().strip(),
                         ssl_cafile=cafile, request_timeout_ms=5000, bootstrap_timeout_ms=5000)
try:
    admin.list_topics()
finally:
    admin.close()
PY
  else
    timeout 30 java -cp "$KAFKA_LIBS/*" -Dlog4j2.configurationFile="$KAFKA_LOG4J" \
      org.apache.kafka.tools.BrokerApiVersionsCommand --bootstrap-server "$KAFKA_BOOTSTRAP" \
      --command-config "$CRED_DIR/admin.properties" >/dev/null 2>&1
  fi
}

users_digest() {
  local role
  {
    cat "$KAFKA_CLUSTER_ID_FILE"
    for role in "${ROLES[@]}"; do
      printf '%s ' "$(role_user "$role")"
      sha256sum <"$(pw_file "$role")"
    done
  } | sha256sum | awk '{print $1}'
}

# SCRAM users for every role but admin, created (or updated) as ember-admin with Kafka's ConfigCommand,
# one JVM per user, run concurrently. Skipped when users.applied matches this cluster and these password files.
kafka_after_ready() {
  local digest role rc=0 failed=()
  local -A pids=() outs=()
  if [[ "$KAFKA_NAME" == kafka-secure ]]; then  # a role added since the last cold start gets its password now
    ensure_passwords
    write_client_properties
  fi
  digest="$(users_digest)"
  if [[ -f "$USERS_MARKER" && "$(cat "$USERS_MARKER")" == "$digest" ]]; then
    return 0
  fi
  log_info "creating SCRAM users ($SCRAM) with org.apache.kafka.tools.ConfigCommand as $ADMIN_USER"
  for role in "${ROLES[@]}"; do
    [[ "$role" == admin ]] && continue
    outs[$role]="$(umask 077 && mktemp "$EMBER_RUN_DIR/$KAFKA_NAME-users.XXXXXX")"
    printf '%s\n' org.apache.kafka.tools.ConfigCommand --bootstrap-server "$KAFKA_BOOTSTRAP" \
      --command-config "$CRED_DIR/admin.properties" --alter --entity-type users \
      --entity-name "$(role_user "$role")" --add-config "$SCRAM=[password=$(pw "$role")]" \
      | kafka_java_argfile >"${outs[$role]}" 2>&1 &
    pids[$role]=$!
  done
  for role in "${!pids[@]}"; do
    rc=0
    wait "${pids[$role]}" || rc=$?
    if ((rc != 0)); then
      failed+=("$(role_user "$role")")
      redact <"${outs[$role]}" >&2
    fi
    rm -f "${outs[$role]}"
  done
  if ((${#failed[@]})); then
    die "ConfigCommand could not create SCRAM user(s) ${failed[*]} on $KAFKA_BOOTSTRAP"
  fi
  log_info "SCRAM users ready: $(for role in "${ROLES[@]}"; do printf '%s ' "$(role_user "$role")"; done)"
  printf '%s\n' "$digest" >"$USERS_MARKER"
}

cmd_reset() {
  kafka_cmd_reset
  rm -f "$USERS_MARKER"
  [[ "$KAFKA_NAME" == kafka-secure ]] || return 0  # the CA and credentials are the central cluster's
  log_info "deleting TLS material, credentials and $USERS_MARKER"
  rm -rf "$TLS_DIR" "$CRED_DIR" "$USERS_MARKER"
}

case "${1:-}" in
  start) acquire_lock "$KAFKA_NAME"; kafka_cmd_start ;;
  stop) acquire_lock "$KAFKA_NAME"; kafka_cmd_stop ;;
  restart) acquire_lock "$KAFKA_NAME"; kafka_cmd_stop; kafka_cmd_start ;;
  status) kafka_cmd_status ;;
  bootstrap) printf '%s\n' "$KAFKA_BOOTSTRAP" ;;
  credentials) printf '%s\n' "$CRED_DIR" ;;
  reset) acquire_lock "$KAFKA_NAME"; cmd_reset ;;
  *) usage ;;
esac
