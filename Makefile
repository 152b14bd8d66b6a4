# mpinfer: `make demo` runs the whole pipeline on an example model, `make test` runs the CPU test suite.
# Each target installs what it needs into .venv (torch pinned: an unpinned torch pulls CUDA wheels).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo test test-gpu lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m mpinfer run models/demo.toml

test: $(STAMP)
	$(PY) -m pytest -m "not gpu and not tensorrt and not slow" -q --timeout=600

test-gpu: $(STAMP)
	$(PY) -m pytest -m "gpu or tensorrt" -q

test-slow: $(STAMP)
	$(PY) -m pytest -m "slow" -q

lint: $(STAMP)
	$(PY) -m ruff check mpinfer tests models bench
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) bench/precision.py
	$(PY) bench/amp.py

clean:
	rm -rf out runs .pytest_cache .mypy_cache .ruff_cache
