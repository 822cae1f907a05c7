#!/usr/bin/env bash
# All local services at once.
#
#   infra/dev.sh up       kafka start, slurm start, flink fetch (a flink failure is only a warning)
#   infra/dev.sh down     stop slurm and kafka
#   infra/dev.sh status   table of every service's status line
set -euo pipefail

# shellcheck source=infra/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
EMBER_LOG_TAG=dev

usage() {
  sed -n '2,6p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

cmd_up() {
  "$INFRA_DIR/kafka.sh" start
  "$INFRA_DIR/slurm.sh" start
  local rc=0
  "$INFRA_DIR/flink.sh" fetch || rc=$?
  if ((rc != 0)); then
    log_warn "flink job server unavailable (infra/flink.sh fetch exit $rc); Kafka and Slurm are up, Beam-on-Flink is not"
  fi
  cmd_status
}

cmd_down() {
  local rc=0
  "$INFRA_DIR/slurm.sh" stop || rc=1
  "$INFRA_DIR/kafka.sh" stop || rc=1
  return "$rc"
}

cmd_status() {
  {
    printf 'SERVICE\tSTATE\tENDPOINT\tDETAIL\n'
    "$INFRA_DIR/kafka.sh" status || status_line kafka error - "infra/kafka.sh status failed"
    "$INFRA_DIR/slurm.sh" status || status_line slurm error - "infra/slurm.sh status failed"
    "$INFRA_DIR/flink.sh" status || status_line flink-job-server error - "infra/flink.sh status failed"
  } | if command -v column >/dev/null 2>&1 && [[ -t 1 ]]; then column -t -s $'\t'; else cat; fi
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  *) usage ;;
esac
