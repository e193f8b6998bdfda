#!/usr/bin/env bash
# Checks a built image by running it: its entrypoint answers --help, and every module it ships imports
# with only what the image installed (tools/import_all.py, fed on stdin).
#   images/check.sh NAME REF
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
name=$1 ref=$2
export CONTAINERS_CONF=${CONTAINERS_CONF:-$here/containers.conf}

case $name in
  operator) packages=("dllm_operator" "dllm_contract") ;;
  router) packages=("dllm_router" "dllm_contract") ;;
  vllm-cpu) packages=("dllm_connector" "dllm_contract") ;;
  *) echo "images/check.sh: no check for '$name'" >&2; exit 2 ;;
esac

help=$(podman run --rm --network none "$ref" --help 2>&1) || {
  echo "$ref: '--help' failed:" >&2; echo "$help" >&2; exit 1
}
grep -qi usage <<<"$help" || { echo "$ref: '--help' printed no usage:" >&2; echo "$help" >&2; exit 1; }
for spec in "${packages[@]}"; do
  read -r package skip <<<"$spec"
  podman run --rm -i --network none --entrypoint python3 "$ref" - "$package" "${skip:-}" \
    <"$root/tools/import_all.py" | sed 's/^/  /' >&2
done
if [ "$name" = vllm-cpu ]; then
  # torch.compile at run time (vLLM's CPU sampler uses it) needs the image's C++ compiler.
  podman run --rm --network none --entrypoint python3 "$ref" -c \
    'import torch; assert torch.compile(lambda x: x * 2)(torch.ones(4)).sum().item() == 8' >/dev/null 2>&1 || {
    echo "$ref: torch.compile does not work in the image (no C++ compiler?)" >&2; exit 1
  }
fi
echo "  $ref: --help answers; modules import" >&2
