# make test / make demo work on a fresh clone with nothing installed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Extra pytest arguments for either test target, e.g. PYTEST_ARGS='-k quorum -x'.
PYTEST_ARGS ?=
# pytest-xdist workers. Most of the full suite waits (on servers, polling, learner processes), so
# more workers than CI's 2 cores still pays; tests/conftest.py keeps on one worker what shares a
# server, and says which tests are in the fast tier.
TEST_WORKERS ?= 3
FAST_WORKERS ?= 2

.PHONY: test test-fast check demo venv clean postgres faketime chromium gpu-check

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first: 2.13.0 is a CPU wheel already on disk; anything else downloads gigabytes.
	$(BIN)/pip install --disable-pip-version-check -q torch==2.13.0
	# Everything else in ONE resolve (moto[server] installed later would upgrade botocore
	# past what s3fs's aiobotocore accepts).
	$(BIN)/pip install --disable-pip-version-check -q -e '.[test]'
	touch $@

venv: $(BIN)/.installed

# Lint (pyflakes, bugbear, import order) and types: the whole package, and core + storage strictly.
check: venv
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/mypy --strict src/atoll/core src/atoll/storage

# PostgreSQL server binaries for tests/integration/test_postgres.py: apt-get install postgresql only
# when they are missing (as root or with passwordless sudo); elsewhere that test skips and says why.
postgres: venv
	@sh .ci/ensure-postgres $(BIN)/python

# libfaketime for the WAN lab's skewed-clock test: apt-get install faketime when missing (as root or
# with passwordless sudo); elsewhere that test skips and says why.
faketime:
	@sh .ci/ensure-faketime

# Headless Chromium for the real-browser test of the Prefect UI (tests/integration/test_ui.py): apt-get
# install chromium when missing (as root or with passwordless sudo); elsewhere that test skips and says why.
chromium:
	@sh .ci/ensure-chromium

# pytest with $(1) in a fresh PREFECT_HOME; every process it starts inherits ATOLL_TEST_TAG, and
# .ci/leftovers fails the target if any of them outlives it (and stops them).
define run_pytest
	home=$$(mktemp -d); tag=atoll-test-$$$$-$$(date +%s); \
	env PREFECT_HOME=$$home PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 \
	    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=90 GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false \
	    ATOLL_TEST_TAG=$$tag $(BIN)/python -m pytest $(1) $(PYTEST_ARGS); status=$$?; \
	$(PYTHON) .ci/leftovers $$tag || status=1; rm -rf $$home; exit $$status
endef

# The full suite: every tier, every real component (Prefect servers and stacks, moto, the GCS
# emulator, PostgreSQL, learner processes), lint and types first. Longest groups start first.
test: check postgres faketime chromium
	$(call run_pytest,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)

# The inner loop: unit tests, the pure core and policies, storage on the memory and local backends;
# no server, no process (tests/conftest.py). Under 3 minutes on 2 cores. No lint: see `make check`.
test-fast: venv
	$(call run_pytest,-m fast -n $(FAST_WORKERS) --dist loadgroup)

# What atoll does on this machine's GPU, in under 5 minutes (docs/gpus.md): the CUDA tests, a learner
# against a bare loop with MFU, 4 learners and the synchronizer sharing the GPU, evaluation and saves.
# Without CUDA it says so and exits 0. Runs with the runtime packages alone (pytest only for the tests).
GPU_CHECK_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
gpu-check:
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_CHECK_PYTHON) benchmarks/gpu_check.py

# Local stack (Prefect server + a process worker per pool), deploy, train the demo preset with 4
# learners on the two pools; prints the UI address, the final validation loss and the bucket path.
# Everything lives under out/demo (bucket, Prefect home, logs); DEMO_ARGS=--keep-up keeps the UI up.
DEMO_ARGS ?=
demo: venv
	mkdir -p out/demo/prefect
	PREFECT_HOME=$(CURDIR)/out/demo/prefect PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 \
	$(BIN)/atoll demo --dir out/demo --learners 4 $(DEMO_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
