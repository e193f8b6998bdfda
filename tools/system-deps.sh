#!/usr/bin/env bash
# Installs the Debian packages a step needs: `tools/system-deps.sh GROUP...`.
# As root it runs apt-get (after an `apt-get update`); as anyone else it stops at
# once and prints the exact command to run, so a fresh machine never fails later with a missing .so.
set -euo pipefail

packages_for() {
  case $1 in
    # Mooncake's transfer engine links these (ImportError: libibverbs.so.1 without them).
    # The codec's C kernels (built at first use) and torch.compile's build with the system compilers.
    engine) echo libibverbs1 ibverbs-providers libnuma1 libcurl4 gcc g++ libc6-dev ;;
    # Daemonless image builds and base images made from Debian's archive; images/containers.conf
    # names netavark as podman's network backend (with aardvark-dns for compose's service names),
    # and podman refuses even an import without it.
    images) echo buildah podman runc mmdebstrap uidmap fuse-overlayfs netavark aardvark-dns ;;
    # The real node: runc for containerd, kube-proxy's and the CNI's netfilter tools, ipset for
    # kube-router's NetworkPolicy firewall.
    node) echo runc iptables ipset conntrack iproute2 ethtool socat util-linux kmod ;;
    # The seed's docker-compose shape, run over podman on the images built here (the images group brings
    # netavark and aardvark-dns, which resolve the compose services' names).
    compose) echo podman-compose ;;
    *) echo "system-deps: unknown group '$1' (engine, images, node, compose)" >&2; return 2 ;;
  esac
}

installed() {
  [ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null)" = installed ]
}

main() {
  local group pkg list missing=()
  for group in "$@"; do
    list=$(packages_for "$group") || return 2
    for pkg in $list; do
      installed "$pkg" || missing+=("$pkg")
    done
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local cmd="apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    printf 'system-deps: missing Debian packages. Run as root, then retry:\n  apt-get update && %s\n' \
      "$cmd" >&2
    return 1
  fi
  # make -j runs several steps that may each install: one apt at a time.
  exec 9>"${TMPDIR:-/tmp}/dllm-system-deps.lock"
  flock 9
  printf '[system-deps] installing: %s\n' "${missing[*]}" >&2
  # apt's lists may be empty or stale on a fresh machine; this runs only when something is missing.
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update -q >&2
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive $cmd -q >&2
}

main "$@"
