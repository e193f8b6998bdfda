#!/usr/bin/env bash
# Builds the images in images/ (all of them, or those named: images/build.sh operator router) with
# docker or podman, from the repository root as the build context, tagged $DLLM_IMAGE_PREFIX/NAME:TAG.
# Without a working container engine it says so plainly and exits 0, so `make images` is safe anywhere.
#   DLLM_IMAGE_PREFIX (default dllm), DLLM_IMAGE_TAG (default dev), CONTAINER_ENGINE (docker or podman)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
prefix=${DLLM_IMAGE_PREFIX:-dllm}
tag=${DLLM_IMAGE_TAG:-dev}
all=(operator router vllm-cpu vllm)

find_engine() {
  local candidate
  for candidate in ${CONTAINER_ENGINE:-docker podman}; do
    # A client without a reachable daemon (or podman without a usable runtime) is no engine.
    if command -v "$candidate" >/dev/null 2>&1 && timeout 20 "$candidate" info >/dev/null 2>&1; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

if ! engine=$(find_engine); then
  echo "no container engine (docker/podman) found: images not built"
  for client in docker podman; do
    if command -v "$client" >/dev/null 2>&1; then
      echo "($client is installed, but '$client info' failed: no daemon or runtime it can reach)"
    fi
  done
  exit 0
fi

names=("$@")
[ ${#names[@]} -gt 0 ] || names=("${all[@]}")
for name in "${names[@]}"; do
  dockerfile=$here/$name/Dockerfile
  [ -f "$dockerfile" ] || { echo "images/build.sh: no image '$name' (one of: ${all[*]})" >&2; exit 2; }
  ignore=()
  [ "$engine" = podman ] && ignore=(--ignorefile "$dockerfile.dockerignore")
  echo "building $prefix/$name:$tag with $engine"
  "$engine" build "${ignore[@]}" -f "$dockerfile" -t "$prefix/$name:$tag" "$root"
done
