# Quickstart: `make demo` (set up, run one batch on the embedded default) and `make test`.
# 3.12 or newer where the machine has one (tau2-bench needs it), else python3.
PYTHON ?= $(shell scripts/find_python.sh)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install demo test lint pytest openapi bench serve clean

$(STAMP): pyproject.toml client/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]" -e ./client
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m service demo

# Lint, type-check, then the whole suite on SQLite and on the local PostgreSQL (started if it is
# installed but down; if it is not installed at all, its tests are skipped with that reason, except on CI).
test: lint pytest

lint: $(STAMP)
	$(BIN)/ruff check service client tests bench scripts docker examples
	$(BIN)/mypy

pytest: $(STAMP)
	@scripts/ensure_postgres.sh; status=$$?; \
	if [ $$status -eq 0 ]; then $(BIN)/python -m pytest $(PYTEST_ARGS); \
	elif [ $$status -eq 3 ]; then ROLLOUT_SKIP_POSTGRES=1 $(BIN)/python -m pytest $(PYTEST_ARGS); \
	else exit $$status; fi

openapi: $(STAMP)
	$(BIN)/python -m service openapi --output openapi.yaml

bench: $(STAMP)
	for bench in bench/*.py; do echo "== $$bench"; $(BIN)/python $$bench || exit 1; done

serve: $(STAMP)
	$(BIN)/python -m service serve --migrate

clean:
	rm -rf $(VENV) demo.db rollouts.db .pytest_cache .mypy_cache .ruff_cache .hypothesis
