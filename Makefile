# ladle: two commands set up a fresh machine and use it.
#   make demo   the whole pipeline on the bundled tiny model and data
#   make test   the test suite
# Both run `make setup` first; it is idempotent (a stamp file records success).

PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ladle-setup
# torch goes in first. The default is the CPU build; a GPU host installs the
# CUDA build of the same version, e.g.:
#   make setup TORCH_INDEX="--index-url https://download.pytorch.org/whl/cu128"
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "pip>=24,<27" "setuptools>=69,<85" "wheel<1"
	$(BIN)/pip install --quiet "torch==$(TORCH_VERSION)" $(TORCH_INDEX)
	# DeepSpeed builds from source: without build isolation (or it pulls a second torch), no ops prebuilt.
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet --no-build-isolation -c constraints.txt deepspeed
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: setup
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/ladle run recipes/tiny-cpu.yaml

# Lint and format are checked first (a violation fails the run), then the suite; the 15 slowest
# tests are printed at the end, and the test phase's wall time after them.
test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@start=$$(date +%s); \
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/python -m pytest -q --durations=15; rc=$$?; \
	echo "test phase: $$(( $$(date +%s) - start )) s (pytest exit $$rc)"; exit $$rc

bench: setup
	$(BIN)/pip install --quiet -c constraints.txt -e ".[bench]"
	$(BIN)/python bench/demo_stages.py
	$(BIN)/python bench/demo_under_load.py
	$(BIN)/python bench/serve_load.py
	$(BIN)/python bench/train_vs_trl.py
	$(BIN)/python bench/train_overhead.py
	$(BIN)/python bench/prepare_vs_trl.py
	$(BIN)/python bench/prepare_memory.py

clean:
	rm -rf runs bench/out
