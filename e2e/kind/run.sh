#!/usr/bin/env bash
# The kind suite: a real cluster with real containers (where a Docker engine exists). It creates a kind
# cluster, builds and loads the images, installs the chart, applies the CPU sample (its model from a
# hostPath volume), and runs the same request checks against the router Service as the CPU data plane.
# Without a Docker engine it says so and exits 0.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
if ! command -v docker >/dev/null 2>&1 || ! docker info >/dev/null 2>&1; then
  echo "skipped: no Docker engine"
  exit 0
fi
KIND_VERSION=v0.33.0
CACHE=${DLLM_CP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dllm-controlplane}
KIND=$CACHE/bin/kind-$KIND_VERSION/kind
if [ ! -x "$KIND" ]; then
  echo "[kind] building kind $KIND_VERSION from the Go module proxy"
  GOBIN=$(dirname "$KIND") GOMODCACHE=$CACHE/gomod GOCACHE=$CACHE/gocache CGO_ENABLED=0 \
    go install "sigs.k8s.io/kind@$KIND_VERSION"
fi
eval "$(python3 -m e2e.cluster env)"
export KUBECONFIG=/tmp/dllm-kind.kubeconfig
PY=.venv/bin/python
make -s venv
$PY -m e2e.dataplane.tiny_model /tmp/dllm-kind-models/tiny-llama
"$KIND" get clusters | grep -qx dllm-e2e || "$KIND" create cluster --config e2e/kind/kind-config.yaml --wait 3m
trap '[ -n "${KEEP:-}" ] || "$KIND" delete cluster --name dllm-e2e' EXIT
bash images/build.sh
for image in operator router vllm-cpu; do
  # images/build.sh builds with buildah: hand each to kind as an archive.
  CONTAINERS_CONF=images/containers.conf podman save --format docker-archive -o "/tmp/dllm-kind-$image.tar" \
    "localhost/dllm/$image:dev"
  "$KIND" load image-archive --name dllm-e2e "/tmp/dllm-kind-$image.tar"
  rm -f "/tmp/dllm-kind-$image.tar"
done
kubectl label node --all dllm.dev/node=real --overwrite
helm upgrade --install dllm charts/dllm-operator -n dllm-system --create-namespace --wait \
  -f e2e/demo-values.yaml
helm test dllm -n dllm-system
kubectl create namespace demo --dry-run=client -o yaml | kubectl apply -f -
kubectl apply -n demo -f e2e/kind/models-volume.yaml
kubectl apply -n demo -f crds/samples/cpu-tiny.yaml
kubectl wait -n demo dllm/tiny-cpu --for=condition=Ready --timeout=15m
kubectl port-forward -n demo svc/tiny-cpu-router 18000:8000 >/tmp/dllm-kind-pf.log 2>&1 &
pf=$!
trap 'kill $pf; [ -n "${KEEP:-}" ] || "$KIND" delete cluster --name dllm-e2e' EXIT
DLLM_ROUTER_URL=http://127.0.0.1:18000 $PY -m pytest e2e/dataplane -m dataplane -k router_endpoint -q
