# DynTree: `make run` (set up, fetch the embedded models, start the app) and `make test`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.dyntree-installed

.PHONY: setup browser simde models run test bench peers clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
	  echo "CUDA found: installing the CUDA build of torch"; $(PIP) install -q "torch>=2.13,<2.16"; \
	else \
	  echo "no CUDA: installing the local CPU build torch==2.13.0"; $(PIP) install -q torch==2.13.0; \
	fi
	$(PIP) install -q -e ".[test]"
	@touch $(STAMP)

# Debian's chromium serves Playwright (executable_path) and kaleido's figure export.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian chromium (browser test + figure export)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	  || echo "WARNING: could not install chromium; browser test and PNG/SVG export will fail"; }

# Debian's libsimde-dev (headers only): the tests run the AVX-512 VNNI kernels' C code on CPUs without AVX-512.
simde:
	@test -f /usr/include/simde/x86/avx512.h || { \
	  echo "installing Debian libsimde-dev (tests of the AVX-512 VNNI kernels on any x86 CPU)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libsimde-dev >/dev/null) \
	  || echo "WARNING: could not install libsimde-dev; the VNNI kernel tests will skip on CPUs without AVX-512"; }

models: setup
	$(PY) -m dyntree_core fetch
	$(PY) -m dyntree_core kernels
	$(PY) -m dyntree_core prepare

run: setup browser models
	$(PY) app.py

test: setup browser simde models
	@bash scripts/run_tests.sh

bench: setup models
	$(PY) -m dyntree_core.bench all --pair embedded

# llama.cpp's own binaries, the CPU peer of `bench speed --llamacpp-bin DIR` (never part of `make test`)
peers:
	@bash scripts/build_llamacpp.sh

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
