#!/usr/bin/env bash
# mypy --strict (pyproject.toml) over everything: the four packages, then e2e/, tools/ and bench/,
# then each test folder. A folder with its own conftest.py is a run of its own (mypy would see two
# modules named conftest), and each run puts the folder on the import path, as pytest does.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# Outside the clone, as the other caches are: a fresh clone then checks hashes, not every module.
export MYPY_CACHE_DIR=${MYPY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dllm/mypy}
run() {
    local path=$1
    shift
    echo "mypy: $*"
    MYPYPATH=.:$path "$PY" -m mypy "$@"
}
"$PY" -m mypy
run bench:images e2e tools bench
run operator/tests operator/tests contract/tests
run router/tests router/tests
run connector/tests/connector:bench connector/tests/connector  # its CUDA test imports bench/gpu
run connector/tests/serve connector/tests/serve connector/tests/test_*.py
