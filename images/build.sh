#!/usr/bin/env bash
# Builds the images (all that can be built here, or those named: images/build.sh operator router) with
# buildah, daemonless, from the repository root as the build context, tagged $DLLM_IMAGE_PREFIX/NAME:TAG.
# The base comes from Debian's archive (images/base/build.sh); the Dockerfiles' default base stays the
# public image a user pulls. An image whose inputs (images/inputs.py) have not changed is not rebuilt,
# and each image built is checked by running it (images/check.sh) before it gets its name.
#   DLLM_IMAGE_PREFIX (default localhost/dllm), DLLM_IMAGE_TAG (default dev)
# The CUDA image (images/vllm) needs vLLM's CUDA base, which no registry here serves: it is linted only.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
prefix=${DLLM_IMAGE_PREFIX:-localhost/dllm}
tag=${DLLM_IMAGE_TAG:-dev}
buildable=(operator router vllm-cpu)
export CONTAINERS_CONF=${CONTAINERS_CONF:-$here/containers.conf}
start=$SECONDS
log() { printf '[images %4ds] %s\n' $((SECONDS - start)) "$*" >&2; }

names=("$@")
[ ${#names[@]} -gt 0 ] || names=("${buildable[@]}")
for name in "${names[@]}"; do
  case " ${buildable[*]} " in
    *" $name "*) ;;
    *) echo "images/build.sh: cannot build '$name' here (one of: ${buildable[*]})" >&2; exit 2 ;;
  esac
done

# compose too: the test that runs the seed's compose shape runs these images, and nothing else installs.
bash "$root/tools/system-deps.sh" images compose
base=$(bash "$here/base/build.sh")
base_id=$(podman image inspect --format '{{.Id}}' "$base")
# RUN steps trust the CAs this host trusts (a proxy that re-signs TLS, as on this project's
# machines), mounted for the build only: nothing of the host's enters an image.
trust=()
host_cas=/etc/ssl/certs/ca-certificates.crt
[ -f "$host_cas" ] && trust=(--volume "$host_cas:$host_cas:ro")
iid=$(mktemp)
build_log=${TMPDIR:-/tmp}/dllm-image-build.log
trap 'rm -f "$iid"' EXIT

for name in "${names[@]}"; do
  ref=$prefix/$name:$tag
  key=$(python3 "$here/inputs.py" "$name" "$base_id")
  if [ "$(podman image inspect --format '{{index .Labels "dev.dllm.inputs"}}' "$ref" 2>/dev/null)" = "$key" ]; then
    log "$ref: cached (inputs $key)"
    continue
  fi
  log "$ref: building (inputs $key)"
  # --layers keeps each step's result, so a source change does not reinstall the dependencies;
  # RUN steps use the host's network to reach Debian's archive and PyPI. The name is given only
  # once the image passed its check, so a failed check is never taken for a cached image.
  if ! buildah build --layers --network host "${trust[@]}" --iidfile "$iid" \
    --build-arg "BASE=$base" --label "dev.dllm.inputs=$key" \
    --ignorefile "$here/$name/Dockerfile.dockerignore" \
    -f "$here/$name/Dockerfile" "$root" 2>&1 |
    tee "$build_log" | { grep --line-buffered -E 'STEP [0-9]|Downloading' || true; } | sed -u 's/^/  /' >&2; then
    log "$ref: build failed; its last lines (whole log: $build_log):"
    tail -n 40 "$build_log" >&2
    exit 1
  fi
  bash "$here/check.sh" "$name" "$(cat "$iid")"
  podman tag "$(cat "$iid")" "$ref"
  log "$ref: built and checked, $(podman image inspect --format '{{.Size}}' "$ref" | numfmt --to=iec)"
done
