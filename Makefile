# Two entry points for a fresh machine: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint format proto

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,bench,ucx,engine]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/kvstore demo

test: $(BIN)/.installed lint
	$(BIN)/pytest -q

lint: $(BIN)/.installed
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy

format: $(BIN)/.installed
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

proto: $(BIN)/.installed
	PATH=$(BIN):$$PATH scripts/gen_proto.sh
