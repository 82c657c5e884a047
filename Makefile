# Two entry points for a fresh machine:
#   make demo   - runs the main job (2-rank FSDP2 on CPU, save/reload, table against DCP)
#   make test   - runs the test suite (core suite, then the torchtitan suite and the frameworks'
#                 (accelerate, Lightning, Megatron-Core), each in its own env)
# Each creates and uses its own environment with torch==2.13.0 (CPU build).  To bring your own:
#   make test TORCH_SPEC= VENV_FLAGS=--system-site-packages
PYTHON ?= python3
VENV ?= .venv
TITAN_VENV ?= .venv-titan
FW_VENV ?= .venv-frameworks
TORCH_SPEC ?= torch==2.13.0
# test processes (pytest-xdist): the suite waits on ranks, sockets and disks more than on cores
TEST_JOBS ?= 2
VENV_FLAGS ?=
PY := $(VENV)/bin/python
TPY := $(TITAN_VENV)/bin/python
FPY := $(FW_VENV)/bin/python

.PHONY: env env-titan env-frameworks demo test test-core lint test-torchtitan test-frameworks test-long bench clean

$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(PY) -m pip install -q -e ".[test]"
	@touch $@

# torchtitan pins its own data stack (datasets, fsspec); it gets an environment of its own
$(TITAN_VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV_FLAGS) $(TITAN_VENV)
	$(TPY) -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(TPY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(TPY) -m pip install -q -e ".[torchtitan]" pytest
	@touch $@

# accelerate, transformers, Lightning and Megatron-Core, pinned to the versions the integrations were tested with
$(FW_VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV_FLAGS) $(FW_VENV)
	$(FPY) -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(FPY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(FPY) -m pip install -q -e ".[frameworks]" pytest
	@touch $@

env: $(VENV)/.ready

env-titan: $(TITAN_VENV)/.ready

env-frameworks: $(FW_VENV)/.ready

demo: env
	$(PY) -m dcp_datastates demo

test: test-core test-torchtitan test-frameworks

test-core: env lint
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist worksteal tests

# layers (import-linter), lint and import order (ruff), types (basedpyright, pyright's basic mode)
lint: env
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check dcp_datastates cuda_ext
	$(VENV)/bin/basedpyright

test-torchtitan: env-titan
	$(TPY) -m pytest -q tests/test_torchtitan.py

test-frameworks: env-frameworks
	$(FPY) -m pytest -q tests/test_accelerate.py tests/test_lightning.py tests/test_megatron.py

test-long: env env-titan env-frameworks
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist worksteal -m "slow or not slow" tests
	$(TPY) -m pytest -q tests/test_torchtitan.py
	$(FPY) -m pytest -q tests/test_accelerate.py tests/test_lightning.py tests/test_megatron.py

bench: env
	$(PY) benchmarks/bench_core.py
	$(PY) benchmarks/bench_async.py
	$(PY) benchmarks/bench_tiers.py

clean:
	rm -rf $(VENV) $(TITAN_VENV) $(FW_VENV) runs .pytest_cache
