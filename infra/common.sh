# shellcheck shell=bash
# Shared helpers for infra/*.sh. Source it; do not execute it.
#
#   REPO        repository root (derived from this file's location)
#   INFRA_DIR   $REPO/infra
#   EMBER_HOME  state/cache/log root; default $REPO/.ember (env overridable)
#   EMBER_PY    python used for client-side checks; default $REPO/.venv/bin/python

if [[ -n "${_EMBER_COMMON_SOURCED:-}" ]]; then
  return 0
fi
_EMBER_COMMON_SOURCED=1

INFRA_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$INFRA_DIR/.." && pwd)"
EMBER_HOME="${EMBER_HOME:-$REPO/.ember}"
# Absolute path: slurm.conf and Kafka configs embed it.
EMBER_HOME="$(realpath -m -- "$EMBER_HOME")"
EMBER_PY="${EMBER_PY:-$REPO/.venv/bin/python}"
EMBER_RUN_DIR="$EMBER_HOME/run"
export REPO INFRA_DIR EMBER_HOME EMBER_PY EMBER_RUN_DIR

# ---------------------------------------------------------------- logging --
_ember_tag() { printf '%s' "${EMBER_LOG_TAG:-$(basename "$0" .sh)}"; }
log_info()  { printf '[%s] %s\n' "$(_ember_tag)" "$*" >&2; }
log_warn()  { printf '[%s] WARNING: %s\n' "$(_ember_tag)" "$*" >&2; }
log_error() { printf '[%s] ERROR: %s\n' "$(_ember_tag)" "$*" >&2; }

# die MESSAGE [EXIT_CODE]
die() {
  log_error "$1"
  exit "${2:-1}"
}

# need_cmd CMD HINT  -- fail with a clear message when CMD is not on PATH.
need_cmd() {
  local cmd="$1" hint="${2:-}"
  if ! command -v "$cmd" >/dev/null 2>&1; then
    die "required command '$cmd' not found on PATH${hint:+. $hint}"
  fi
}

need_root() {
  if [[ "$(id -u)" -ne 0 ]]; then
    die "$1 must run as root (current uid $(id -u))"
  fi
}

ensure_dir() {
  local d
  for d in "$@"; do
    mkdir -p "$d"
  done
}

# tail_log FILE [N] -- print the last N lines of FILE to stderr (for failures).
tail_log() {
  local f="$1" n="${2:-40}"
  if [[ -f "$f" ]]; then
    printf -- '----- last %s lines of %s -----\n' "$n" "$f" >&2
    tail -n "$n" "$f" >&2 || true
    printf -- '----- end of %s -----\n' "$f" >&2
  else
    printf -- '(log file %s does not exist)\n' "$f" >&2
  fi
}

# ------------------------------------------------------------------ ports --
# port_open HOST PORT -- true when a TCP connect to HOST:PORT succeeds.
port_open() {
  local host="$1" port="$2"
  # shellcheck disable=SC2016  # $1/$2 expand in the child bash
  timeout 2 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$host" "$port" >/dev/null 2>&1
}

# wait_for_port HOST PORT TIMEOUT_SECONDS -- poll until the port accepts TCP.
wait_for_port() {
  local host="$1" port="$2" timeout_s="${3:-30}"
  local deadline=$((SECONDS + timeout_s))
  while ((SECONDS < deadline)); do
    if port_open "$host" "$port"; then
      return 0
    fi
    sleep 0.5
  done
  return 1
}

# ------------------------------------------------------------- pid files --
# pid_alive PID -- process exists and is not a zombie.
pid_alive() {
  local pid="$1" state
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  kill -0 "$pid" 2>/dev/null || return 1
  state="$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || true)"
  [[ "$state" != "Z" ]]
}

# pid_matches PID PATTERN -- the process command line contains PATTERN
# (guards against pid reuse after a reboot/crash left a stale pid file).
pid_matches() {
  local pid="$1" pattern="${2:-}"
  [[ -z "$pattern" ]] && return 0
  tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$pattern"
}

# pid_read PIDFILE [PATTERN] -- print the pid and return 0 when the process
# recorded in PIDFILE is alive (and matches PATTERN); otherwise remove a stale
# pid file and return 1.
pid_read() {
  local pidfile="$1" pattern="${2:-}" pid
  [[ -f "$pidfile" ]] || return 1
  pid="$(tr -d '[:space:]' <"$pidfile" 2>/dev/null || true)"
  if [[ -n "$pid" ]] && pid_alive "$pid" && pid_matches "$pid" "$pattern"; then
    printf '%s\n' "$pid"
    return 0
  fi
  log_info "removing stale pid file $pidfile (pid '${pid}')"
  rm -f "$pidfile"
  return 1
}

# pid_running PIDFILE [PATTERN] -- boolean form of pid_read.
pid_running() {
  pid_read "$@" >/dev/null 2>&1
}

# start_bg PIDFILE LOGFILE CMD... -- start CMD detached (own session, nohup,
# stdin from /dev/null, stdout+stderr appended to LOGFILE) unless the process
# in PIDFILE is already alive. Prints the pid.
start_bg() {
  local pidfile="$1" logfile="$2" pid
  shift 2
  if pid="$(pid_read "$pidfile" 2>/dev/null)"; then
    printf '%s\n' "$pid"
    return 0
  fi
  ensure_dir "$(dirname "$pidfile")" "$(dirname "$logfile")"
  # setsid/nohup exec the command, so $! is the pid of the real process.
  # 9>&- : do not leak the acquire_lock fd into the long-lived daemon.
  setsid nohup "$@" >>"$logfile" 2>&1 </dev/null 9>&- &
  pid=$!
  printf '%s\n' "$pid" >"$pidfile"
  printf '%s\n' "$pid"
}

# stop_pid NAME PIDFILE [TIMEOUT_SECONDS] [PATTERN] -- SIGTERM, wait, SIGKILL.
stop_pid() {
  local name="$1" pidfile="$2" timeout_s="${3:-20}" pattern="${4:-}" pid deadline
  if ! pid="$(pid_read "$pidfile" "$pattern" 2>/dev/null)"; then
    rm -f "$pidfile"
    log_info "$name not running"
    return 0
  fi
  log_info "stopping $name (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  deadline=$((SECONDS + timeout_s))
  while pid_alive "$pid" && ((SECONDS < deadline)); do
    sleep 0.5
  done
  if pid_alive "$pid"; then
    log_warn "$name (pid $pid) still alive after ${timeout_s}s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    sleep 0.5
  fi
  rm -f "$pidfile"
}

# acquire_lock NAME [TIMEOUT_SECONDS] -- serialize start/stop of one service across
# concurrent callers (e.g. parallel test sessions). Held on fd 9 until the script exits;
# commands that leave daemons behind must be run with 9>&- (start_bg does this).
acquire_lock() {
  local name="$1" timeout_s="${2:-300}"
  command -v flock >/dev/null 2>&1 || return 0
  ensure_dir "$EMBER_RUN_DIR"
  exec 9>"$EMBER_RUN_DIR/$name.lock"
  flock -w "$timeout_s" 9 || die "timed out after ${timeout_s}s waiting for $EMBER_RUN_DIR/$name.lock"
}

# status_line NAME STATE ENDPOINT DETAIL -- the tab-separated status format.
status_line() {
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4"
}

# apt_install PKG... -- install Debian packages (fresh CI machines, as root).
apt_install() {
  need_cmd apt-get "install these packages manually: $*"
  need_root "installing $* with apt-get"
  log_info "installing $* with apt-get (first run on this machine)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# rotate_log FILE -- a daemon's log over 64 MiB becomes FILE.1 (the one before it is dropped) before a start appends.
rotate_log() {
  if [[ -f "$1" ]] && (($(stat -c %s "$1") > 64 * 1024 * 1024)); then
    mv -f "$1" "$1.1"
  fi
}
