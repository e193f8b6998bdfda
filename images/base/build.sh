#!/usr/bin/env bash
# Makes the Python base image the Dockerfiles take as BASE, from Debian's archive with mmdebstrap,
# since no registry is reachable here to pull python:3.11-slim-bookworm. It offers what the
# Dockerfiles use of that image: python, pip, venv, Python's C headers (torch.compile builds against
# them at run time), apt sources for Debian 12 (with its updates and security suites, so the
# Dockerfiles' `deb12u*` pins resolve), and pip free to install system-wide.
# Prints the image's name on stdout; cached by the hash of this script (a warm run takes a second).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
name=${DLLM_BASE_IMAGE:-localhost/dllm-base/python:3.11-bookworm}
key=$(sha256sum "$here/build.sh" | cut -c1-16)
start=$SECONDS
log() { printf '[base %4ds] %s\n' $((SECONDS - start)) "$*" >&2; }

if [ "$(podman image inspect --format '{{index .Labels "dev.dllm.inputs"}}' "$name" 2>/dev/null)" = "$key" ]; then
  log "$name: cached"
  echo "$name"
  exit 0
fi

mirror=http://deb.debian.org/debian
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
log "$name: mmdebstrap bookworm (about 2 minutes)"
# EXTERNALLY-MANAGED goes: like the python image, this base is a container whose one Python is
# the application's, so pip installs system-wide (into /usr/local).
mmdebstrap --variant=minbase --mode=root --format=tar \
  --include=python3,python3-dev,python3-pip,python3-venv,python-is-python3,ca-certificates \
  --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
  bookworm "$tmp/rootfs.tar" \
  "deb $mirror bookworm main" "deb $mirror bookworm-updates main" \
  "deb http://deb.debian.org/debian-security bookworm-security main" 2>&1 |
  grep --line-buffered -E '^I: (downloading|extracting|installing|success)' | sed -u 's/^/  /' >&2
log "$name: importing"
podman import --quiet \
  --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
  --change "LABEL dev.dllm.inputs=$key" \
  "$tmp/rootfs.tar" "$name" >/dev/null
log "$name: built"
echo "$name"
