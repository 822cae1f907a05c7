#!/usr/bin/env bash
# Local single-node Slurm (Debian slurm-wlm 22.05 + munge), no systemd.
#
#   infra/slurm.sh start    install packages if missing, munge key + munged, slurm.conf,
#                           slurmctld + slurmd, wait until the node is idle
#   infra/slurm.sh stop     stop slurmd, slurmctld and munged (only processes this script started)
#   infra/slurm.sh restart
#   infra/slurm.sh status   slurm<TAB>running|stopped<TAB><host>:<ctld port><TAB><slurmctld log>
#   infra/slurm.sh conf     print the path of the generated slurm.conf
#
# Must run as root (the daemons run as root; SlurmUser=root). The generated config is
# $EMBER_HOME/slurm/slurm.conf and is also installed as /etc/slurm/slurm.conf so that
# plain `sbatch`/`squeue`/`sinfo` work without SLURM_CONF (set EMBER_SLURM_ETC_CONF=0 to
# leave /etc alone; then export SLURM_CONF=$EMBER_HOME/slurm/slurm.conf for clients).
#
# Env: EMBER_HOME, EMBER_SLURMCTLD_PORT (6817), EMBER_SLURMD_PORT (6818),
#      EMBER_SLURM_START_TIMEOUT (60 seconds), EMBER_SLURM_ETC_CONF (1).
set -euo pipefail

# shellcheck source=infra/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
EMBER_LOG_TAG=slurm

SLURM_DIR="$EMBER_HOME/slurm"
SLURM_CONF_FILE="$SLURM_DIR/slurm.conf"
SLURM_LOGS="$SLURM_DIR/logs"
SLURM_STATE="$SLURM_DIR/state"
SLURM_SPOOL="$SLURM_DIR/spool"
SLURM_RUNDIR="$SLURM_DIR/run"
SLURMCTLD_LOG="$SLURM_LOGS/slurmctld.log"
SLURMD_LOG="$SLURM_LOGS/slurmd.log"
SLURMCTLD_PID="$SLURM_RUNDIR/slurmctld.pid"   # written by slurmctld itself
SLURMD_PID="$SLURM_RUNDIR/slurmd.pid"         # written by slurmd itself
MUNGED_PID="$EMBER_RUN_DIR/munged.pid"        # only exists when this script started munged
SLURMCTLD_PORT="${EMBER_SLURMCTLD_PORT:-6817}"
SLURMD_PORT="${EMBER_SLURMD_PORT:-6818}"
SLURM_START_TIMEOUT="${EMBER_SLURM_START_TIMEOUT:-60}"
SLURM_ETC_CONF="${EMBER_SLURM_ETC_CONF:-1}"
ETC_SLURM_CONF=/etc/slurm/slurm.conf
MANAGED_MARKER="# Managed by ember infra/slurm.sh"

MUNGE_KEY=/etc/munge/munge.key
MUNGE_SOCKET=/run/munge/munge.socket.2
MUNGE_SYS_PID=/run/munge/munged.pid

NODE="$(hostname -s)"
# Our own client calls always use our config, whatever /etc says.
export SLURM_CONF="$SLURM_CONF_FILE"

usage() {
  sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

ensure_packages() {
  local missing=0 c
  for c in slurmctld slurmd sbatch sinfo scontrol munged munge unmunge; do
    command -v "$c" >/dev/null 2>&1 || missing=1
  done
  if ((missing)); then
    apt_install slurm-wlm munge
  fi
  for c in slurmctld slurmd sbatch sinfo scontrol munged munge unmunge; do
    need_cmd "$c" "apt-get install -y slurm-wlm munge did not provide it"
  done
}

# ------------------------------------------------------------------ munge --
munge_works() {
  munge -n -S "$MUNGE_SOCKET" 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1
}

have_munge_user() { id -u munge >/dev/null 2>&1; }

ensure_munge_key() {
  local owner=root:root
  have_munge_user && owner=munge:munge
  ensure_dir /etc/munge
  if [[ ! -s "$MUNGE_KEY" ]]; then
    log_info "creating munge key $MUNGE_KEY"
    if command -v mungekey >/dev/null 2>&1; then
      mungekey --create --keyfile="$MUNGE_KEY"
    else
      dd if=/dev/urandom of="$MUNGE_KEY" bs=1 count=1024 status=none
    fi
  fi
  chown "$owner" /etc/munge "$MUNGE_KEY"
  chmod 0700 /etc/munge
  chmod 0600 "$MUNGE_KEY"
}

start_munged() {
  if pid_running "$MUNGED_PID" munged && munge_works; then
    log_info "munged already running (pid $(cat "$MUNGED_PID"))"
    return 0
  fi
  if munge_works; then
    log_info "munged already running (not started by this script; it will be left alone by stop)"
    return 0
  fi
  ensure_munge_key
  local owner=root:root
  have_munge_user && owner=munge:munge
  ensure_dir /run/munge /var/log/munge /var/lib/munge "$EMBER_RUN_DIR"
  chown "$owner" /run/munge /var/log/munge /var/lib/munge
  chmod 0755 /run/munge
  chmod 0700 /var/log/munge
  chmod 0711 /var/lib/munge
  rm -f "$MUNGE_SYS_PID"
  local out
  # munged daemonizes and writes $MUNGE_SYS_PID. Prefer the unprivileged munge user
  # (Debian's default); as root it needs --force.
  if have_munge_user; then
    out="$(runuser -u munge -- munged 2>&1 9>&-)" || { printf '%s\n' "$out" >&2; tail_log /var/log/munge/munged.log 20; die "munged failed to start (as user munge)"; }
  else
    out="$(munged --force 2>&1 9>&-)" || { printf '%s\n' "$out" >&2; tail_log /var/log/munge/munged.log 20; die "munged --force failed to start (as root)"; }
  fi
  local deadline=$((SECONDS + 15))
  until munge_works; do
    if ((SECONDS >= deadline)); then
      tail_log /var/log/munge/munged.log 20
      die "munged started but 'munge -n | unmunge' still fails after 15s"
    fi
    sleep 0.3
  done
  if [[ -s "$MUNGE_SYS_PID" ]]; then
    cp "$MUNGE_SYS_PID" "$MUNGED_PID"
  fi
  log_info "munged running (pid $(cat "$MUNGED_PID" 2>/dev/null || echo '?'))"
}

# ------------------------------------------------------------ slurm.conf --
node_hw() {
  # slurmd -C: "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105"
  local line key val
  line="$(slurmd -C 2>/dev/null | head -n 1 || true)"
  HW_CPUS=""; HW_BOARDS=""; HW_SOCKETS=""; HW_CORES=""; HW_THREADS=""; HW_MEM=""
  for kv in $line; do
    key="${kv%%=*}"; val="${kv#*=}"
    case "$key" in
      CPUs) HW_CPUS="$val" ;;
      Boards) HW_BOARDS="$val" ;;
      SocketsPerBoard) HW_SOCKETS="$val" ;;
      CoresPerSocket) HW_CORES="$val" ;;
      ThreadsPerCore) HW_THREADS="$val" ;;
      RealMemory) HW_MEM="$val" ;;
    esac
  done
  if [[ -z "$HW_CPUS" || -z "$HW_CORES" ]]; then
    log_warn "could not parse 'slurmd -C' ('$line'); falling back to nproc/free"
    HW_CPUS="$(nproc)"; HW_BOARDS=1; HW_SOCKETS=1; HW_CORES="$HW_CPUS"; HW_THREADS=1
  fi
  if [[ -z "$HW_MEM" ]]; then
    HW_MEM="$(free -m | awk '/^Mem:/ {print $2}')"
  fi
  # Leave ~5% headroom: slurmd drains a node whose RealMemory exceeds what it detects.
  HW_MEM_CONF=$((HW_MEM * 95 / 100))
  ((HW_MEM_CONF >= 1)) || HW_MEM_CONF=1
}

write_conf() {
  ensure_dir "$SLURM_DIR" "$SLURM_LOGS" "$SLURM_STATE" "$SLURM_SPOOL" "$SLURM_RUNDIR"
  node_hw
  local tmp="$SLURM_CONF_FILE.tmp"
  cat >"$tmp" <<EOF
$MANAGED_MARKER -- regenerated on every start; source of truth: $SLURM_CONF_FILE
ClusterName=ember
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$SLURMCTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
StateSaveLocation=$SLURM_STATE
SlurmdSpoolDir=$SLURM_SPOOL
SlurmctldPidFile=$SLURMCTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$SLURMCTLD_LOG
SlurmdLogFile=$SLURMD_LOG
SlurmctldDebug=info
SlurmdDebug=info
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
# No slurmdbd: finished jobs are appended here (JobId, JobState, ExitCode, ...).
JobCompType=jobcomp/filetxt
JobCompLoc=$SLURM_LOGS/jobcomp.log
# Finished jobs stay visible to 'scontrol show job' for 5 minutes.
MinJobAge=300
InactiveLimit=0
KillWait=10
SlurmctldTimeout=120
SlurmdTimeout=300
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$HW_CPUS Boards=$HW_BOARDS SocketsPerBoard=$HW_SOCKETS CoresPerSocket=$HW_CORES ThreadsPerCore=$HW_THREADS RealMemory=$HW_MEM_CONF State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$tmp" "$SLURM_CONF_FILE"
  if [[ "$SLURM_ETC_CONF" == "1" ]]; then
    if [[ -e "$ETC_SLURM_CONF" ]] && ! grep -qF "$MANAGED_MARKER" "$ETC_SLURM_CONF"; then
      die "$ETC_SLURM_CONF exists and was not written by infra/slurm.sh; refusing to overwrite it.
       Move it away, or set EMBER_SLURM_ETC_CONF=0 and export SLURM_CONF=$SLURM_CONF_FILE for clients."
    fi
    ensure_dir "$(dirname "$ETC_SLURM_CONF")"
    cp "$SLURM_CONF_FILE" "$ETC_SLURM_CONF.tmp"
    mv "$ETC_SLURM_CONF.tmp" "$ETC_SLURM_CONF"
  fi
}

# ------------------------------------------------------------ daemons --
# sinfo %T: idle, mixed, allocated, completing, down*, drained, draining, idle* (not responding)...
node_state() {
  sinfo -h -n "$NODE" -o %T 2>/dev/null | head -n 1 | tr -d '[:space:]' || true
}

# start_slurm_daemon NAME PIDFILE LOGFILE PORT CMD...
start_slurm_daemon() {
  local name="$1" pidfile="$2" logfile="$3" port="$4" out
  shift 4
  if pid_running "$pidfile" "$name"; then
    log_info "$name already running (pid $(cat "$pidfile"))"
    return 0
  fi
  if port_open 127.0.0.1 "$port"; then
    die "port $port is in use but $name from this script is not running (another Slurm?). Stop it first."
  fi
  # The daemon forks into the background and writes its own pid file.
  if ! out="$("$@" 2>&1 9>&-)"; then
    printf '%s\n' "$out" >&2
    tail_log "$logfile" 40
    die "$name failed to start: $*"
  fi
  local deadline=$((SECONDS + 20))
  until pid_running "$pidfile" "$name" && port_open 127.0.0.1 "$port"; do
    if ((SECONDS >= deadline)); then
      [[ -n "$out" ]] && printf '%s\n' "$out" >&2
      tail_log "$logfile" 40
      die "$name did not come up (pid file $pidfile, port $port) within 20s"
    fi
    sleep 0.3
  done
  log_info "$name running (pid $(cat "$pidfile"))"
}

wait_node_idle() {
  local deadline=$((SECONDS + SLURM_START_TIMEOUT)) state="" last_resume=-100
  while ((SECONDS < deadline)); do
    state="$(node_state)"
    case "$state" in
      idle | mixed | allocated | completing)
        log_info "node $NODE is $state"
        return 0
        ;;
      down* | drain* | fail* | inval*)
        if ((SECONDS - last_resume >= 5)); then
          log_info "node $NODE is $state; resuming it"
          scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
          last_resume=$SECONDS
        fi
        ;;
    esac
    sleep 1
  done
  scontrol show node "$NODE" >&2 2>/dev/null || true
  tail_log "$SLURMCTLD_LOG" 30
  tail_log "$SLURMD_LOG" 30
  die "node $NODE not idle after ${SLURM_START_TIMEOUT}s (state: '${state:-unknown}')"
}

cmd_start() {
  local t0=$SECONDS
  need_root "infra/slurm.sh start (munged/slurmctld/slurmd are run as root here)"
  ensure_packages
  start_munged
  write_conf
  start_slurm_daemon slurmctld "$SLURMCTLD_PID" "$SLURMCTLD_LOG" "$SLURMCTLD_PORT" \
    slurmctld -f "$SLURM_CONF_FILE"
  start_slurm_daemon slurmd "$SLURMD_PID" "$SLURMD_LOG" "$SLURMD_PORT" \
    slurmd -f "$SLURM_CONF_FILE" -N "$NODE"
  wait_node_idle
  log_info "ready after $((SECONDS - t0))s: controller $NODE:$SLURMCTLD_PORT, conf $SLURM_CONF_FILE"
}

cmd_stop() {
  stop_pid slurmd "$SLURMD_PID" 20 slurmd
  stop_pid slurmctld "$SLURMCTLD_PID" 20 slurmctld
  if [[ -f "$MUNGED_PID" ]]; then
    stop_pid munged "$MUNGED_PID" 10 munged
    rm -f "$MUNGE_SYS_PID"
  else
    log_info "munged was not started by this script; leaving it alone"
  fi
}

cmd_status() {
  local state=stopped
  if pid_running "$SLURMCTLD_PID" slurmctld && pid_running "$SLURMD_PID" slurmd; then
    state=running
  fi
  status_line slurm "$state" "$NODE:$SLURMCTLD_PORT" "$SLURMCTLD_LOG"
}

case "${1:-}" in
  start) acquire_lock slurm; cmd_start ;;
  stop) acquire_lock slurm; cmd_stop ;;
  restart) acquire_lock slurm; cmd_stop; cmd_start ;;
  status) cmd_status ;;
  conf) printf '%s\n' "$SLURM_CONF_FILE" ;;
  *) usage ;;
esac
