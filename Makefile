# mpinfer: `make demo` runs the whole pipeline on an example model, `make test` runs the CPU test suite.
# Each target installs what it needs into .venv (torch pinned: an unpinned torch pulls CUDA wheels).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo test test-shuffled test-kernels test-gpu lint bench clean

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
	$(PY) -m pytest -m "not gpu and not tensorrt and not slow" -q --timeout=600 -p no:randomly

# The same suite in a random order (pytest-randomly), to catch tests that depend on another's leftovers. The
# seed is printed; `make test-shuffled SEED=<n>` replays an order (OMP_NUM_THREADS=1 or 2 varies the kernels).
test-shuffled: $(STAMP)
	@seed=$${SEED:-$$($(PY) -c 'import random; print(random.randrange(1, 2**31))')}; \
	echo "test-shuffled: --randomly-seed=$$seed (replay: make test-shuffled SEED=$$seed)"; \
	$(PY) -m pytest -m "not gpu and not tensorrt and not slow" -q --timeout=600 -p randomly --randomly-seed=$$seed

# The same suite on other kernel paths, as on another CPU (issue 28): ONNX Runtime with 1 and with 3 intra-op
# threads (tests/kernel_paths.py splits every session's sums differently), then numpy, OpenBLAS and torch held
# below this CPU's widest SIMD (numpy >= 2.4 feature names; features a CPU lacks are ignored). Three full runs;
# the counts per CPU are in bench/RESULTS.md, "Test-suite stability".
NARROW_SIMD := NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR" OPENBLAS_CORETYPE=Sandybridge \
	ATEN_CPU_CAPABILITY=avx2
test-kernels: $(STAMP)
	@failed=""; \
	for variant in "--ort-threads 1" "--ort-threads 3" "narrow-simd"; do \
		echo "test-kernels: $$variant"; \
		if [ "$$variant" = narrow-simd ]; then env $(NARROW_SIMD) $(PY) -m pytest -m "not gpu and not tensorrt and not slow" \
			-q --timeout=600 -p no:randomly || failed="$$failed [$$variant]"; \
		else $(PY) -m pytest -m "not gpu and not tensorrt and not slow" -q --timeout=600 -p no:randomly \
			-p tests.kernel_paths $$variant || failed="$$failed [$$variant]"; fi; \
	done; \
	if [ -n "$$failed" ]; then echo "test-kernels: failed under$$failed"; exit 1; fi

test-gpu: $(STAMP)
	$(PY) -m pytest -m "gpu or tensorrt" -q

test-slow: $(STAMP)
	$(PY) -m pip install -q "scipy>=1.10"  # the published VAD's synthetic speech (bench extra)
	$(PY) -m pytest -m "slow" -q

lint: $(STAMP)
	$(PY) -m ruff check mpinfer tests models bench
	$(PY) -m mypy

# ModelOpt AutoCast for the side-by-side benchmark, in its own venv layered over .venv (its pins would
# downgrade onnx/onnxruntime here), installed without its pinned dependencies.
MODELOPT_VENV := .venv-modelopt
MODELOPT_PKGS := nvidia-modelopt==0.47.0 onnx-graphsurgeon==0.6.1 onnxslim==0.1.98 polygraphy==0.53.6 lief==1.0.0 \
	cppimport mako pybind11 omegaconf pulp nvidia-ml-py cuda-pathfinder

$(MODELOPT_VENV)/.installed: $(STAMP)
	$(PYTHON) -m venv $(MODELOPT_VENV)
	$(MODELOPT_VENV)/bin/python -m pip install -q --no-deps $(MODELOPT_PKGS)
	$(PY) -c "import site; print(site.getsitepackages()[0])" > \
		"$$($(MODELOPT_VENV)/bin/python -c 'import site; print(site.getsitepackages()[0])')/mpinfer-base.pth"
	touch $@

bench: $(STAMP) $(MODELOPT_VENV)/.installed
	$(PY) -m pip install -q -e ".[bench]"
	PYTHONPATH=$(CURDIR) $(PY) bench/precision.py --sizes --modelopt-python $(MODELOPT_VENV)/bin/python
	PYTHONPATH=$(CURDIR) $(PY) bench/search_speed.py
	PYTHONPATH=$(CURDIR) $(PY) bench/amp.py
	PYTHONPATH=$(CURDIR) $(PY) bench/emulator_speed.py

clean:
	rm -rf out runs .pytest_cache .mypy_cache .ruff_cache $(MODELOPT_VENV)
