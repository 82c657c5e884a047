# Two entry points for a fresh machine:
#   make demo   - runs the main job (2-rank FSDP2 on CPU, save/reload, table against DCP)
#   make test   - runs the test suite
# Each creates and uses .venv with torch==2.13.0 (CPU build).  To bring your own torch:
#   make test TORCH_SPEC= VENV_FLAGS=--system-site-packages
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
VENV_FLAGS ?=
PY := $(VENV)/bin/python

.PHONY: env demo test test-long bench clean

$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(PY) -m pip install -q -e ".[test]"
	@touch $@

env: $(VENV)/.ready

demo: env
	$(PY) -m dcp_datastates demo

test: env
	$(PY) -m pytest -q tests

test-long: env
	$(PY) -m pytest -q -m "slow or not slow" tests

bench: env
	$(PY) benchmarks/bench_core.py

clean:
	rm -rf $(VENV) runs .pytest_cache
