# Quick start: `make run` (set up, then serve the bundled arithmetic generator and PRM over HTTP on
# 127.0.0.1:8000) and `make test` (set up, then run the test suite). Both create .venv idempotently.
# `make chat` serves the same models behind the gateway with the web chat on 127.0.0.1:4000/chat.
# `make search` solves PROBLEM with PRM-guided beam search; `make generate` decodes it greedily.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROBLEM ?= Start with 44 and work modulo 100. Step 1: * 7. Step 2: + 9. Step 3: - 4. Step 4: + 5. What is the result?

PORT ?= 8000
# pytest-xdist processes for `make test` (0: one process); each takes its share of the cores (tests/conftest.py)
TEST_WORKERS ?= 2
# only xdist of the installed pytest plugins: schemathesis, hypothesis and anyio register plugins that
# no test uses, and pytest would rewrite the asserts of ~260 of their modules in every worker (7 s each)
TEST_PLUGINS ?= --disable-plugin-autoload -p xdist.plugin
CHAT_PORT ?= 4000

.PHONY: run chat generate search test bench clean

# $(call missing,WHAT,CONSEQUENCE): a component could not be installed: fatal under CI=true.
missing = { if [ "$$CI" = "true" ]; then echo "CI=true: $(1) could not be installed" >&2; exit 1; fi; \
	echo "no $(1): $(2)"; }

$(STAMP): pyproject.toml
	# What cannot be installed is a warning (its tests skip), except under CI=true: there it fails.
	# treeserve's CPU kernels are C, built on first use with cc (PyTorch paths run without one).
	command -v cc >/dev/null || (command -v apt-get >/dev/null && apt-get update -q && apt-get install -y -q gcc) \
		|| $(call missing,C compiler (gcc),treeserve runs its PyTorch paths (slower))
	# The gateway's tests run a throwaway PostgreSQL cluster and RabbitMQ node (Debian's postgresql
	# and rabbitmq-server).
	(command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1) \
		&& test -x /usr/lib/rabbitmq/bin/rabbitmq-server \
		|| (command -v apt-get >/dev/null && apt-get update -q \
			&& DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql rabbitmq-server) \
		|| $(call missing,PostgreSQL or RabbitMQ (postgresql rabbitmq-server),the gateway tests that need them will skip)
	# The web chat's browser test drives Debian's chromium through chromium-driver.
	command -v chromium >/dev/null && command -v chromedriver >/dev/null \
		|| (command -v apt-get >/dev/null && apt-get update -q \
			&& DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver) \
		|| $(call missing,Chromium (chromium chromium-driver),the chat's browser test will skip)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU wheel pinned: an unpinned torch pulls gigabytes of CUDA packages.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	# Bytecode for treeserve's own modules now (an editable install has none, and PYTHONDONTWRITEBYTECODE
	# machines never write it): each process the tests start imports ~1 s faster.
	$(BIN)/python -m compileall -q src/treeserve >/dev/null
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/treeserve serve --port $(PORT)

# The web chat on the bundled models: a server, the gateway with /chat, and a first user it prints.
chat: $(STAMP)
	$(BIN)/treeserve chat --port $(CHAT_PORT)

generate: $(STAMP)
	$(BIN)/treeserve run --chat --max-tokens 256 "$(PROBLEM)"

search: $(STAMP)
	$(BIN)/treeserve search "$(PROBLEM)"

test: $(STAMP)
	$(BIN)/python -m pytest tests -m "not timing" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(TEST_PLUGINS)
	$(BIN)/python -m pytest tests -m timing $(TEST_PLUGINS)

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV)
