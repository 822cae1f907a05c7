#!/usr/bin/env bash
# All local services at once.
#
#   infra/dev.sh up [--secure] [--regions us,eu]
#                               kafka start, slurm start, flink fetch (a flink failure is only a warning),
#                               objectstores start (gs:// and s3://);
#                               --secure or EMBER_KAFKA_SECURITY=sasl_ssl: also kafka-secure start;
#                               --regions: also regions.sh start (regional clusters + MirrorMaker 2);
#                               with --secure, regions.sh --secure start (SASL_SSL regions mirrored into kafka-secure)
#   infra/dev.sh down           stop MM2 and the regions, slurm, kafka, kafka-secure and the object stores
#   infra/dev.sh status         table of every service's status line
set -euo pipefail

# shellcheck source=infra/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
EMBER_LOG_TAG=dev

usage() {
  sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

cmd_up() {
  local secure=0 regions=""
  while (($#)); do
    case "$1" in
      --secure) secure=1 ;;
      --regions) [[ -n "${2:-}" ]] || usage; regions="$2"; shift ;;
      *) usage ;;
    esac
    shift
  done
  if [[ "${EMBER_KAFKA_SECURITY:-}" == sasl_ssl ]]; then
    secure=1
  fi
  "$INFRA_DIR/kafka.sh" start
  if ((secure)); then
    "$INFRA_DIR/kafka-secure.sh" start
  fi
  if [[ -n "$regions" ]]; then
    if ((secure)); then
      "$INFRA_DIR/regions.sh" --secure start "$regions"
    else
      "$INFRA_DIR/regions.sh" start "$regions"
    fi
  fi
  "$INFRA_DIR/slurm.sh" start
  local rc=0
  "$INFRA_DIR/flink.sh" fetch || rc=$?
  if ((rc != 0)); then
    log_warn "flink job server unavailable (infra/flink.sh fetch exit $rc); Kafka and Slurm are up, Beam-on-Flink is not"
  fi
  "$INFRA_DIR/objectstores.sh" start
  cmd_status
}

cmd_down() {
  local rc=0
  "$INFRA_DIR/regions.sh" stop || rc=1
  "$INFRA_DIR/regions.sh" --secure stop || rc=1
  "$INFRA_DIR/slurm.sh" stop || rc=1
  "$INFRA_DIR/kafka.sh" stop || rc=1
  "$INFRA_DIR/kafka-secure.sh" stop || rc=1
  "$INFRA_DIR/objectstores.sh" stop || rc=1
  return "$rc"
}

cmd_status() {
  {
    printf 'SERVICE\tSTATE\tENDPOINT\tDETAIL\n'
    "$INFRA_DIR/kafka.sh" status || status_line kafka error - "infra/kafka.sh status failed"
    "$INFRA_DIR/kafka-secure.sh" status || status_line kafka-secure error - "infra/kafka-secure.sh status failed"
    "$INFRA_DIR/regions.sh" status || status_line regions error - "infra/regions.sh status failed"
    "$INFRA_DIR/regions.sh" --secure status || status_line regions-secure error - "infra/regions.sh --secure status failed"
    "$INFRA_DIR/slurm.sh" status || status_line slurm error - "infra/slurm.sh status failed"
    "$INFRA_DIR/flink.sh" status || status_line flink-job-server error - "infra/flink.sh status failed"
    "$INFRA_DIR/objectstores.sh" status || status_line objectstores error - "infra/objectstores.sh status failed"
  } | if command -v column >/dev/null 2>&1 && [[ -t 1 ]]; then column -t -s $'\t'; else cat; fi
}

case "${1:-}" in
  up) shift; cmd_up "$@" ;;
  down) cmd_down ;;
  status) cmd_status ;;
  *) usage ;;
esac
