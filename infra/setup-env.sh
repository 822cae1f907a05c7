#!/usr/bin/env bash
# Creates .venv/ from uv.lock (exact versions, CI-reproducible). Idempotent and fast when nothing changed.
# Needs: Python 3.12 (PATH, pyenv or /usr), network access to PyPI. Installs uv itself if missing.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
UV_VERSION="0.13.9"
TOOLS="${XDG_CACHE_HOME:-$HOME/.cache}/ember/tools"

find_python312() {
  local candidate
  for candidate in "${EMBER_PYTHON:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do
    [ -n "$candidate" ] || continue
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      command -v "$candidate" 2>/dev/null || echo "$candidate"
      return 0
    fi
  done
  return 1
}

PYTHON="$(find_python312)" || {
  echo "error: Python 3.12 not found (tried \$EMBER_PYTHON, python3.12, ~/.pyenv/versions/3.12*, /usr/bin)." >&2
  echo "       Install it (e.g. 'pyenv install 3.12') or set EMBER_PYTHON=/path/to/python3.12." >&2
  exit 1
}

UV="$TOOLS/uv-$UV_VERSION/bin/uv"
if [ ! -x "$UV" ]; then
  echo "==> installing uv $UV_VERSION into $TOOLS"
  "$PYTHON" -m venv "$TOOLS/uv-$UV_VERSION"
  "$TOOLS/uv-$UV_VERSION/bin/python" -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
fi

# bubblewrap: the unit-test grader's sandbox (ember/rollouts/grading/sandbox.py), from Debian as Slurm is.
if ! command -v bwrap >/dev/null 2>&1; then
  # shellcheck source=infra/common.sh
  source "$REPO/infra/common.sh"
  apt_install bubblewrap
  need_cmd bwrap "apt-get install -y bubblewrap did not provide it"
fi

echo "==> syncing .venv from uv.lock with $PYTHON"
cd "$REPO"
# --compile-bytecode: write every .pyc now. Where PYTHONDONTWRITEBYTECODE is set (CI images often set it), Python
# never caches bytecode itself, and each process (every torchrun rank, Beam worker and CLI call) would compile
# torch, megatron and Beam from source again: about a minute of CPU per process on two cores.
"$UV" sync --locked --python "$PYTHON" --quiet --compile-bytecode
echo "==> .venv ready: $("$REPO/.venv/bin/python" --version)"
