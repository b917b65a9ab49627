# quicedge: the two commands are `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test lint check bench clean certs bench-references

$(STAMP): pyproject.toml scripts/bootstrap.sh
	PYTHON=$(PYTHON) bash scripts/bootstrap.sh $(VENV)
	touch $(STAMP)

## run: set everything up and start the local stack (edge + two CPU stand-in backends).
run: $(STAMP)
	bash scripts/run-local.sh

## test: set everything up (venv, dependencies, a Redis server) and run the whole suite,
## in TEST_PROCESSES pytest processes (each with a Redis of its own; 0: all in this one).
TEST_PROCESSES ?= 2
test: $(STAMP)
	bash scripts/with-redis.sh $(BIN)/python -m pytest -n $(TEST_PROCESSES) --dist loadfile $(PYTEST_ARGS)

## lint: ruff and mypy.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy edge transport backends certs bench tools

check: lint test

certs: $(STAMP)
	$(BIN)/quicedge certs

## bench-references: Caddy and nginx (Debian packages), the yardsticks of
## `python -m bench.edge_latency --spawn --reference caddy --reference nginx`.
bench-references:
	command -v caddy >/dev/null && command -v nginx >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq caddy nginx-light; }

clean:
	rm -rf $(VENV) certs/dev .pytest_cache .ruff_cache .mypy_cache
