# kvspec: two commands do everything on a fresh machine.
#   make audit   set up .venv, then run the conformance audit of impl/ against spec/
#   make test    set up .venv, then run the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvspec-installed
COMPILED := build/.kvspec-compiled
VLLM ?= 0.13.0
VLLM_PYTHON ?=
# One setuptools build in the source tree at a time: .venv's and the vLLM envs' editable installs
# and the tests that build a wheel all write kvspec.egg-info and build/ (tests/tree_build.py).
TREE_LOCK := $(if $(shell command -v flock),flock build/.tree-build.lock,)
CROSSHAIR_TIMEOUT ?= 4
# Modules whose PEP 316 contracts CrossHair checks in `make check`.
CROSSHAIR_TARGETS ?= kvspec.spec.pool kvspec.conformance.pool_programs kvspec.spec.hashing \
	kvspec.spec.slot_mapping kvspec.spec.attention_rules kvspec.spec.manager kvspec.spec.event_consumer kvspec.spec.event_stream \
	kvspec.spec.free_queue kvspec.spec.hash_map kvspec.spec.eviction kvspec.spec.events \
	kvspec.spec.offload kvspec.conformance.offload_programs

.PHONY: setup compile wheel audit audit-vllm test test-pure check typecheck crosshair mutants bench vllm-env vllm-tests \
	vllm-loop vllm-check clean

setup: $(STAMP) $(COMPILED)

# torch first (the CPU build on disk), so nothing later pulls a CUDA build;
# a machine that already has a torch in the venv keeps it.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	@mkdir -p build
	KVSPEC_PURE_PYTHON=1 $(TREE_LOCK) $(PY) -m pip install --quiet -e '.[dev]'  # mypyc: next
	@touch $(STAMP)

# impl/'s hot modules compiled with mypyc (about two minutes); KVSPEC_PURE_PYTHON=1 skips it.
$(COMPILED): $(STAMP) $(wildcard impl/*.py) scripts/compile.py
	@if [ "$${KVSPEC_PURE_PYTHON:-0}" = 0 ]; then $(PY) scripts/compile.py; \
	else $(PY) scripts/compile.py --clean; fi
	@mkdir -p build && touch $@

compile: $(STAMP)
	$(PY) scripts/compile.py
	@mkdir -p build && touch $(COMPILED)

# A wheel with impl's modules compiled, built once (about a minute on a quiet 2-core machine):
# `pip install dist/kvspec-*.whl` puts it into any environment of this Python (3.11 here) in
# seconds, no compiler needed there (docs/plugin.md). The build tools are .venv's own.
wheel: $(STAMP)
	rm -f dist/kvspec-*.whl
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir dist .
	@ls dist/kvspec-*.whl

audit: setup
	$(VENV)/bin/kvspec audit --target impl --profile vllm-0.13 --seed 1

test: setup
	$(PY) -m pytest -n auto  # one worker per core (pytest-xdist)

# The conformance machines and the hostile-input suite on the Python sources (make test runs
# the compiled build).
test-pure: setup
	KVSPEC_PURE_PYTHON=1 $(PY) -m pytest -n auto tests/test_pool_machine.py \
		tests/test_manager_machine.py tests/hostile

check: typecheck crosshair

typecheck: setup
	@# mypy reads the package as the wheel lays it out (scripts/package_view.py); its messages
	@# name the repository's files.
	@$(PY) scripts/package_view.py > /dev/null
	set -o pipefail; MYPYPATH=build/view $(PY) -m mypy --strict build/view/kvspec tests benchmarks \
		scripts | $(PY) scripts/package_view.py --unview
	$(PY) -m ruff check .

# One core for about six minutes (docs/development.md).
crosshair: setup
	$(PY) -m crosshair check --analysis_kind=PEP316 --per_condition_timeout=$(CROSSHAIR_TIMEOUT) \
		--max_uninteresting_iterations=64 $(CROSSHAIR_TARGETS)

mutants: setup
	$(PY) -m tests.mutants

bench: setup
	$(PY) -m benchmarks.run $(if $(VLLM_PYTHON),--vllm-python $(VLLM_PYTHON),)

vllm-env:
	bash scripts/vllm_env.sh $(VLLM)

audit-vllm: vllm-env
	.venv-vllm-$(VLLM)/bin/kvspec audit --target vllm --profile vllm-$(basename $(VLLM))

# vLLM's own tests/v1/core, on real vLLM and with kvspec in place (docs/vllm-tests.md).
# DOWNLOADS vLLM's source distribution (18 MB for 0.13.0) from PyPI into build/vllm-src/ on
# first use, checked by sha256; only its tests/ are extracted, into build/vllm-tests-$(VLLM)/.
# BOTH_BUILDS=1: with kvspec's compiled build and with its Python sources, both compared with
# one run on real vLLM (what CI does).
vllm-tests: vllm-env
	@echo "vllm-tests: downloads vLLM $(VLLM)'s source distribution from PyPI into build/vllm-src/ (once; checked by sha256)"
	.venv-vllm-$(VLLM)/bin/python scripts/vllm_tests.py $(VLLM) $(if $(BOTH_BUILDS),--both-builds,)

# vLLM's real Scheduler driven for thousands of steps, once with vLLM's KV-cache manager and
# once with kvspec's through the plugin; every step's output must match (nothing downloaded).
# 0.33.x: vLLM's own managers over vLLM's BlockPool and over kvspec's (hybrid Mamba included).
# The test serves the release of the environment it runs in.
vllm-loop: vllm-env
	.venv-vllm-$(VLLM)/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm_scheduler_loop.py

# Everything that needs the vLLM environment and gates: the scheduler loop, and kvspec's own
# tests that compare with vLLM when its environment exists (hash bytes, event bytes, planning,
# the plugin loaded by vLLM's own loader); make test skips those without it.
vllm-check: setup vllm-loop
	$(PY) -m pytest tests/test_hashing.py tests/test_kv_events.py tests/test_kv_events_033.py \
		tests/test_kv_cache_planning.py tests/test_vllm_plugin.py

clean:
	rm -rf $(VENV) build dist *.egg-info .hypothesis .mypy_cache .ruff_cache
	rm -f impl/*.so kvspec_impl__mypyc*.so
