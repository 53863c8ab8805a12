# `make train` and `make test` set themselves up on first use (.venv, the right vLLM build).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: train test unit lint format bench clean

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh

train: $(STAMP)
	$(PY) -m app train $(ARGS)

test: $(STAMP)
	PY=$(PY) bash scripts/test.sh $(ARGS)

unit: $(STAMP)
	$(PY) -m pytest -q -m "not integration" $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check app relay tests bench
	$(VENV)/bin/ruff format --check app relay tests bench

format: $(STAMP)
	$(VENV)/bin/ruff format app relay tests bench
	$(VENV)/bin/ruff check --fix app relay tests bench

bench: $(STAMP)
	$(PY) bench/rollout_overhead.py
	$(PY) bench/engine_step_cost.py
	$(PY) bench/sync_bandwidth.py

clean:
	rm -rf runs .cache .pytest_cache
