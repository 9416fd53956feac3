# make test / make demo work on a fresh clone with nothing installed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# pytest parallelism is off by default: CI has 2 cores and the servers share them.
PYTEST_ARGS ?=

.PHONY: test check demo venv clean postgres

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

test: check postgres
	PREFECT_HOME=$$(mktemp -d) PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 \
	PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=90 GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false \
	$(BIN)/python -m pytest $(PYTEST_ARGS)

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
