# Quick start: `make run` (set up, then serve the built-in default model over HTTP on
# 127.0.0.1:8000) and `make test` (set up, then run the test suite). Both create .venv idempotently.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= Once upon a time

PORT ?= 8000

.PHONY: run generate test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU wheel pinned: an unpinned torch pulls gigabytes of CUDA packages.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/treeserve serve --port $(PORT)

generate: $(STAMP)
	$(BIN)/treeserve run --max-tokens 32 "$(PROMPT)"

test: $(STAMP)
	$(BIN)/python -m pytest tests

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV)
