#!/usr/bin/env bash
# Beam Flink job server (for FlinkRunner / PortableRunner with --flink_master=[local]).
#
#   infra/flink.sh fetch    get a job-server jar via Maven; exit 3 when none is served
#   infra/flink.sh status   flink-job-server<TAB>available|unavailable<TAB><jar or -><TAB><detail/reason>
#   infra/flink.sh path     print the job-server jar path (exit 3 when not fetched/unavailable)
#
# Resolution order (first that works wins):
#   1. org.apache.beam:beam-runners-flink-<F>-job-server:<SDK version>  (official shaded jar)
#   2. org.apache.beam:beam-runners-flink-<F>:<SDK version> + runtime deps -> classpath launcher jar
#   3. the same two for each version in EMBER_FLINK_FALLBACK_BEAM_VERSIONS (default 2.62.0),
#      i.e. a job server OLDER than the Python SDK (warned about; skip with EMBER_FLINK_STRICT=1)
# <SDK version> = installed apache-beam (EMBER_BEAM_VERSION overrides), <F> = EMBER_FLINK_VERSION (1.19).
#
# Use:  python -m ... --runner=FlinkRunner --flink_version=<F> \
#         --flink_job_server_jar="$(infra/flink.sh path)" --environment_type=LOOPBACK
set -euo pipefail

# shellcheck source=infra/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
EMBER_LOG_TAG=flink

EXIT_UNAVAILABLE=3
FLINK_VERSION="${EMBER_FLINK_VERSION:-1.19}"
FALLBACK_VERSIONS="${EMBER_FLINK_FALLBACK_BEAM_VERSIONS-2.62.0}"
STRICT="${EMBER_FLINK_STRICT:-0}"
FLINK_POM="$INFRA_DIR/flink/pom.xml"
JARS_DIR="$EMBER_HOME/cache/jars"
BEAM_JAR_CACHE="${EMBER_BEAM_JAR_CACHE:-$HOME/.apache_beam/cache/jars}"
JS_ROOT="$EMBER_HOME/cache/flink-job-server"
MAIN_CLASS=org.apache.beam.runners.flink.FlinkJobServerDriver

usage() {
  sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# Prints the installed apache-beam version; returns 1 (message in SDK_ERR) when unknown.
sdk_version() {
  if [[ -n "${EMBER_BEAM_VERSION:-}" ]]; then
    printf '%s\n' "$EMBER_BEAM_VERSION"
    return 0
  fi
  if [[ ! -x "$EMBER_PY" ]]; then
    printf 'python not found at %s (create the venv, or set EMBER_PY / EMBER_BEAM_VERSION)\n' "$EMBER_PY" >&2
    return 1
  fi
  # importlib.metadata avoids importing apache_beam (slow, noisy); fall back to the import.
  "$EMBER_PY" -c 'import importlib.metadata as m; print(m.version("apache-beam"))' 2>/dev/null \
    || "$EMBER_PY" -c 'import apache_beam; print(apache_beam.__version__)' 2>/dev/null \
    || { printf 'apache-beam is not installed in %s (set EMBER_BEAM_VERSION to override)\n' "$EMBER_PY" >&2; return 1; }
}

SDK_ERR=""
if ! SDK_VERSION="$(sdk_version 2>/dev/null | tail -n 1)" || [[ -z "$SDK_VERSION" ]]; then
  SDK_ERR="$(sdk_version 2>&1 >/dev/null || true)"
  SDK_VERSION=unknown
fi
STATE_FILE="$JS_ROOT/sdk-$SDK_VERSION-flink-$FLINK_VERSION.state"
REASON_FILE="$JS_ROOT/sdk-$SDK_VERSION-flink-$FLINK_VERSION.unavailable"

shaded_coords() { printf 'org.apache.beam:beam-runners-flink-%s-job-server:%s' "$FLINK_VERSION" "$1"; }
runner_coords() { printf 'org.apache.beam:beam-runners-flink-%s:%s' "$FLINK_VERSION" "$1"; }

candidate_versions() {
  printf '%s\n' "$SDK_VERSION"
  if [[ "$STRICT" != "1" ]]; then
    local v
    for v in $FALLBACK_VERSIONS; do
      [[ "$v" != "$SDK_VERSION" ]] && printf '%s\n' "$v"
    done
  fi
  return 0
}

# state file: 4 lines -- jar path, beam version of the job server, kind, detail
write_state() {
  ensure_dir "$JS_ROOT"
  printf '%s\n%s\n%s\n%s\n' "$1" "$2" "$3" "$4" >"$STATE_FILE.tmp"
  mv "$STATE_FILE.tmp" "$STATE_FILE"
  rm -f "$REASON_FILE"
}

state_jar() { sed -n 1p "$STATE_FILE" 2>/dev/null; }
state_detail() { sed -n 4p "$STATE_FILE" 2>/dev/null; }

available() {
  local jar
  [[ -f "$STATE_FILE" ]] || return 1
  jar="$(state_jar)"
  [[ -n "$jar" && -f "$jar" ]]
}

# 1. official shaded job-server jar
try_shaded() {
  local v="$1" coords name log
  coords="$(shaded_coords "$v")"
  name="beam-runners-flink-$FLINK_VERSION-job-server-$v.jar"
  log="$JS_ROOT/mvn-$name.log"
  if [[ -f "$JARS_DIR/$name" ]]; then
    printf '%s\n' "$JARS_DIR/$name"
    return 0
  fi
  log_info "trying $coords"
  ensure_dir "$JARS_DIR" "$JS_ROOT"
  if mvn -B -U dependency:copy -Dartifact="$coords" -DoutputDirectory="$JARS_DIR" >"$log" 2>&1 \
      && [[ -f "$JARS_DIR/$name" ]]; then
    printf '%s\n' "$JARS_DIR/$name"
    return 0
  fi
  log_info "  not served (mvn log: $log)"
  return 1
}

# 2. unshaded runner + deps -> libs/, plus a manifest-only launcher jar next to it
try_classpath() {
  local v="$1" coords dir libs tmp log jar python_bin
  coords="$(runner_coords "$v")"
  dir="$JS_ROOT/beam-$v-flink-$FLINK_VERSION"
  libs="$dir/libs"
  jar="$dir/beam-runners-flink-$FLINK_VERSION-job-server-$v-classpath.jar"
  log="$dir/mvn-resolve.log"
  if [[ -f "$jar" && -f "$libs/.ember-resolved" ]]; then
    printf '%s\n' "$jar"
    return 0
  fi
  log_info "trying $coords (+ runtime dependencies)"
  ensure_dir "$dir"
  tmp="$libs.tmp.$$"
  rm -rf "$tmp"
  if ! mvn -B -U -f "$FLINK_POM" dependency:copy-dependencies -Dbeam.version="$v" -Dflink.version="$FLINK_VERSION" \
      -DoutputDirectory="$tmp" -DincludeScope=runtime >"$log" 2>&1; then
    rm -rf "$tmp"
    log_info "  not resolvable: $(grep -m1 -oE 'Could not find artifact [^ ]*' "$log" || echo "see $log")"
    return 1
  fi
  if [[ ! -f "$tmp/beam-runners-flink-$FLINK_VERSION-$v.jar" ]]; then
    rm -rf "$tmp"
    log_info "  resolved, but beam-runners-flink-$FLINK_VERSION-$v.jar is missing (see $log)"
    return 1
  fi
  rm -rf "$libs"
  mv "$tmp" "$libs"
  # Class-Path entries are relative to the launcher jar, so the jar must stay next to libs/.
  python_bin="$(command -v python3 || true)"
  [[ -x "$EMBER_PY" ]] && python_bin="$EMBER_PY"
  [[ -n "$python_bin" ]] || die "python3 is needed to write the launcher jar"
  "$python_bin" - "$jar" "$libs" "$MAIN_CLASS" <<'PY'
import os, sys, zipfile
jar, libs, main = sys.argv[1:4]
names = sorted(n for n in os.listdir(libs) if n.endswith(".jar"))
runner = [n for n in names if n.startswith("beam-runners-flink-")]
with zipfile.ZipFile(os.path.join(libs, runner[0])) as z:
    if main.replace(".", "/") + ".class" not in z.namelist():
        sys.exit(f"{main} not found in {runner[0]}")
# Manifest lines: 72-byte limit is handled by continuation lines (leading space).
lines = ["Manifest-Version: 1.0", "Main-Class: " + main,
         "Class-Path: " + "\n  ".join("libs/" + n for n in names), ""]
tmp = jar + ".tmp"
with zipfile.ZipFile(tmp, "w") as z:
    z.writestr("META-INF/MANIFEST.MF", "\n".join(lines))
os.replace(tmp, jar)
PY
  date -Is >"$libs/.ember-resolved"
  printf '%s\n' "$jar"
}

cmd_fetch() {
  need_cmd java "Install a JDK >= 11 (Debian: apt-get install -y openjdk-17-jre-headless); the job server is Java."
  need_cmd mvn "Install Maven (Debian: apt-get install -y maven); it downloads the job server."
  [[ -z "$SDK_ERR" ]] || die "cannot determine the Beam SDK version: $SDK_ERR"
  if available; then
    log_info "job server already fetched: $(state_jar)"
    return 0
  fi
  ensure_dir "$JS_ROOT"
  local v jar tried=()
  while read -r v; do
    [[ -n "$v" ]] || continue
    tried+=("$(shaded_coords "$v")")
    if jar="$(try_shaded "$v")"; then
      ensure_dir "$BEAM_JAR_CACHE"
      cp -f "$jar" "$BEAM_JAR_CACHE/"
      finish_fetch "$jar" "$v" shaded
      return 0
    fi
    tried+=("$(runner_coords "$v")")
    if jar="$(try_classpath "$v")"; then
      finish_fetch "$jar" "$v" classpath
      return 0
    fi
  done < <(candidate_versions)
  local reason list
  list="$(printf '%s, ' "${tried[@]}")"
  reason="no Beam Flink job server for SDK $SDK_VERSION / Flink $FLINK_VERSION is served by the Maven mirror; tried: ${list%, } (mvn logs in $JS_ROOT)"
  printf '%s\n' "$reason" >"$REASON_FILE"
  rm -f "$STATE_FILE"
  log_error "$reason"
  exit "$EXIT_UNAVAILABLE"
}

finish_fetch() {
  local jar="$1" v="$2" kind="$3" detail
  if [[ "$kind" == shaded ]]; then
    detail="beam $v shaded job server, flink $FLINK_VERSION"
  else
    detail="beam $v classpath launcher for $(runner_coords "$v"), flink $FLINK_VERSION"
  fi
  if [[ "$v" != "$SDK_VERSION" ]]; then
    detail="$detail; VERSION SKEW: python SDK is $SDK_VERSION (official job-server jar not served)"
    log_warn "using a Beam $v job server with the Beam $SDK_VERSION Python SDK (the $SDK_VERSION artifacts are not served by the Maven mirror); simple pipelines in LOOPBACK mode were verified to work, but expect rough edges"
  fi
  write_state "$jar" "$v" "$kind" "$detail"
  log_info "job server: $jar"
  log_info "use: --runner=FlinkRunner --flink_version=$FLINK_VERSION --flink_job_server_jar=$jar --environment_type=LOOPBACK"
}

cmd_status() {
  if [[ -n "$SDK_ERR" ]]; then
    status_line flink-job-server unavailable - "cannot determine the Beam SDK version: $SDK_ERR"
  elif available; then
    status_line flink-job-server available "$(state_jar)" "$(state_detail)"
  elif [[ -s "$REASON_FILE" ]]; then
    status_line flink-job-server unavailable - "$(cat "$REASON_FILE")"
  else
    local first
    first="$(shaded_coords "$SDK_VERSION")"
    status_line flink-job-server unavailable - "not fetched yet for SDK $SDK_VERSION / Flink $FLINK_VERSION (run infra/flink.sh fetch; it tries $first first)"
  fi
}

cmd_path() {
  if available; then
    state_jar
    return 0
  fi
  local reason="not fetched yet (run infra/flink.sh fetch)"
  [[ -s "$REASON_FILE" ]] && reason="$(cat "$REASON_FILE")"
  log_error "$reason"
  exit "$EXIT_UNAVAILABLE"
}

case "${1:-}" in
  fetch) acquire_lock flink 1200; cmd_fetch ;;
  status) cmd_status ;;
  path) cmd_path ;;
  *) usage ;;
esac
