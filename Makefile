# function_calling: make run · make test · make test-all · make lint · make version · make llama
# Only Python 3 and make are needed; `make lint` alone downloads its checkers (into .venv-lint/).

PYTHON ?= python3
SOURCES := function_calling.py test_function_calling.py
LINT_VENV := .venv-lint
LINT_TOOLS := ruff==0.17.6 mypy==2.4.1
MCP_VENV := .venv-mcp
BENCH_VENV := .venv-bench
PG_VENV := .venv-pg
OTEL_VENV := .venv-otel
OTEL_TOOLS := arize-phoenix==20.26.1 opentelemetry-proto==1.45.2
PG_DRIVER := psycopg[binary]==3.3.9
RUFF_RULES := --line-length 100 --target-version py310 \
	--select E,F,W,I,B,UP,SIM,RUF,N,C4,PL,PIE,RET,BLE,S \
	--ignore PLR2004,PLR0913,PLR0917 --per-file-ignores test_function_calling.py:S

.PHONY: run demo test test-all lint bench interop llama browser version pg-driver

# With a key or a base URL (a local server needs no key), ask that model; with neither,
# run the offline scripted demo.
run:
	@if [ -n "$$OPENAI_API_KEY$$OPENAI_BASE_URL" ]; then \
		$(PYTHON) function_calling.py ask "Where is my order ORD-1001?"; \
	else \
		echo "Neither OPENAI_API_KEY nor OPENAI_BASE_URL is set: running the offline demo."; echo; \
		$(PYTHON) function_calling.py demo; \
	fi

demo:
	@$(PYTHON) function_calling.py demo

# The last line of the combined output reads "N passed, N failed[, N skipped]".
test:
	@$(PYTHON) test_function_calling.py 2>&1

# The same on every Python 3.10+ found on PATH or in pyenv, then a total line.
test-all:
	@bash .ci/test-all

# Speed as ratios against baselines measured in the same run (skipped by `make test`); the
# openai SDK, one baseline, is downloaded into .venv-bench/ (its figures are skipped without).
bench:
	@$(MAKE) --no-print-directory $(BENCH_VENV)/.installed || echo "no openai SDK: its figures are skipped"
	@FUNCTION_CALLING_BENCH=1 \
	FUNCTION_CALLING_SDK_PYTHON=$$(test -f $(BENCH_VENV)/.installed && echo $(abspath $(BENCH_VENV))/bin/python) \
	$(PYTHON) test_function_calling.py Benchmarks 2>&1

# PostgreSQL's driver, psycopg 3, for the tests that run on a real PostgreSQL server (started by
# the suite from Debian's package `postgresql`, which .ci/run installs where missing), in
# .venv-pg/X.Y/ for the Python $(PYTHON) is (test-all makes one for each); the module itself
# imports no driver.
PG_PYTHON := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
pg-driver: $(PG_VENV)/$(PG_PYTHON)/.installed

$(PG_VENV)/$(PG_PYTHON)/.installed:
	rm -rf $(PG_VENV)/$(PG_PYTHON)
	$(PYTHON) -m venv $(PG_VENV)/$(PG_PYTHON)
	$(PG_VENV)/$(PG_PYTHON)/bin/pip install --quiet --disable-pip-version-check '$(PG_DRIVER)'
	touch $@

$(BENCH_VENV)/.installed:
	rm -rf $(BENCH_VENV)
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet --disable-pip-version-check openai==3.57.0
	touch $@

# The day this file is stamped, in __version__, and on line 1 with the hash of its text after
# line 1 (what `copy` and --version show, and a test checks is not stale); commit it after.
version:
	@sed -i -e "s/^__version__ = \"[^\"]*\"/__version__ = \"$$(date -u +%F)\"/" function_calling.py && \
	stamp="$$($(PYTHON) function_calling.py --version | cut -d' ' -f2-)" && \
	sed -i -e "1s/^# function_calling.py [^:]*:/# function_calling.py $$stamp:/" function_calling.py && \
	head -n 1 function_calling.py

# The same checks on the copies `copy --without` makes: none, each part, all but each, all.
PART_CUTS := $(shell $(PYTHON) -c 'import re; \
	parts = [p.lower() for p in re.findall(r"(?m)^\# >>> ([A-Z_]+)", open("function_calling.py").read())]; \
	cuts = [*parts, *(",".join(q for q in parts if q != p) for p in parts), ",".join(parts)]; \
	print(*dict.fromkeys(cuts))')
lint: $(LINT_VENV)/.installed
	$(LINT_VENV)/bin/ruff check $(RUFF_RULES) $(SOURCES)
	$(LINT_VENV)/bin/ruff format --check --line-length 100 $(SOURCES)
	$(LINT_VENV)/bin/mypy --strict --python-version 3.10 --cache-dir $(LINT_VENV)/mypy-cache $(SOURCES)
	@for cut in $(PART_CUTS); do \
		rm -rf $(LINT_VENV)/cut && mkdir -p $(LINT_VENV)/cut && \
		$(PYTHON) function_calling.py copy $(LINT_VENV)/cut/function_calling.py --without $$cut \
			>/dev/null && echo "lint: a copy without $$cut" && \
		$(LINT_VENV)/bin/ruff check --quiet $(RUFF_RULES) $(LINT_VENV)/cut/function_calling.py && \
		$(LINT_VENV)/bin/ruff format --check --quiet --line-length 100 $(LINT_VENV)/cut/function_calling.py && \
		$(LINT_VENV)/bin/mypy --strict --python-version 3.10 --cache-dir $(LINT_VENV)/mypy-cache \
			--no-error-summary $(LINT_VENV)/cut/function_calling.py || exit 1; \
	done
	@rm -rf $(LINT_VENV)/cut && mkdir -p $(LINT_VENV)/cut && \
	$(PYTHON) function_calling.py copy $(LINT_VENV)/cut/function_calling.py --mechanism \
		>/dev/null && echo "lint: the mechanism's copy (Part I alone)" && \
	$(LINT_VENV)/bin/ruff check --quiet $(RUFF_RULES) $(LINT_VENV)/cut/function_calling.py && \
	$(LINT_VENV)/bin/ruff format --check --quiet --line-length 100 $(LINT_VENV)/cut/function_calling.py && \
	$(LINT_VENV)/bin/mypy --strict --python-version 3.10 --cache-dir $(LINT_VENV)/mypy-cache \
		--no-error-summary $(LINT_VENV)/cut/function_calling.py

# The inbox in a real headless Chromium (FUNCTION_CALLING_CHROMIUM, else one on PATH; Debian's
# package `chromium`, which .ci/run installs where missing). `make test` runs it too, when found.
browser:
	@$(PYTHON) test_function_calling.py InboxBrowserTest 2>&1

$(LINT_VENV)/.installed:
	rm -rf $(LINT_VENV)
	$(PYTHON) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/pip install --quiet --disable-pip-version-check $(LINT_TOOLS)
	touch $@

# The README's MCP servers (on stdio, and over Streamable HTTP with a token) on the official
# Python SDK, both majors (2: the 2026-07-28 revision, 1: the 2025-11-25 handshake), and on
# the TypeScript SDK beside its reference server (server-everything, with npm where there is
# node); then the official MCP conformance suite's required client scenarios for both
# revisions (it prints N of M, and names the scenarios still expected to fail). All of it is
# downloaded into .venv-mcp/; the module itself never needs them. Then the telemetry, read
# by the official opentelemetry-proto definitions and by a real receiver, Arize Phoenix,
# both from PyPI into .venv-otel/.
interop: $(MCP_VENV)/2/.installed $(MCP_VENV)/1/.installed $(OTEL_VENV)/.installed
	@$(MAKE) --no-print-directory $(MCP_VENV)/ts/.installed || echo "npm could not install the TypeScript servers: they are skipped"
	@$(MAKE) --no-print-directory $(MCP_VENV)/conformance/.installed || echo "npm could not install the MCP conformance suite: it is skipped"
	@FUNCTION_CALLING_MCP_PYTHON=$(abspath $(MCP_VENV))/2/bin/python \
	FUNCTION_CALLING_MCP1_PYTHON=$(abspath $(MCP_VENV))/1/bin/python \
	FUNCTION_CALLING_MCP_TS=$(abspath $(MCP_VENV))/ts \
	FUNCTION_CALLING_MCP_CONFORMANCE=$(abspath $(MCP_VENV))/conformance \
	FUNCTION_CALLING_OTEL_PYTHON=$(abspath $(OTEL_VENV))/bin/python \
	$(PYTHON) test_function_calling.py RealMcpServerTest RealRemoteMcpServerTest \
		RealTypeScriptMcpServerTest McpConformanceTest RealTelemetryTest 2>&1

# A real llama.cpp llama-server, built from the llama-cpp-python sdist (it carries llama.cpp's
# source; some 12 to 17 minutes on two cores), and llama.cpp's own gguf package from the same
# sdist, which writes the tiny model the test runs: all in .venv-llama/. .ci/run runs it; the
# module itself never needs any of it.
LLAMA_VENV := .venv-llama
LLAMA_SDIST := llama-cpp-python==0.3.36
LLAMA_CPP = $(LLAMA_VENV)/src/llama_cpp_python-0.3.36/vendor/llama.cpp
llama: $(LLAMA_VENV)/.installed
	@FUNCTION_CALLING_LLAMA_SERVER=$(abspath $(LLAMA_CPP))/build/bin/llama-server \
	FUNCTION_CALLING_GGUF_PYTHON=$(abspath $(LLAMA_VENV))/bin/python \
	FUNCTION_CALLING_LLAMA_VOCAB=$(abspath $(LLAMA_CPP))/models/ggml-vocab-llama-bpe.gguf \
	$(PYTHON) test_function_calling.py RealLlamaCppTest 2>&1

$(LLAMA_VENV)/.installed:
	rm -rf $(LLAMA_VENV)
	$(PYTHON) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/pip download --quiet --disable-pip-version-check --no-deps \
		--no-binary :all: $(LLAMA_SDIST) -d $(LLAMA_VENV)/src
	tar xzf $(LLAMA_VENV)/src/llama_cpp_python-0.3.36.tar.gz -C $(LLAMA_VENV)/src
	cmake -S $(LLAMA_CPP) -B $(LLAMA_CPP)/build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
		-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
	cmake --build $(LLAMA_CPP)/build --target llama-server -j2 >/dev/null
	$(LLAMA_VENV)/bin/pip install --quiet --disable-pip-version-check $(LLAMA_CPP)/gguf-py
	touch $@

$(OTEL_VENV)/.installed:
	rm -rf $(OTEL_VENV)
	$(PYTHON) -m venv $(OTEL_VENV)
	$(OTEL_VENV)/bin/pip install --quiet --disable-pip-version-check $(OTEL_TOOLS)
	touch $@

# The suite needs Node 22 or newer (fs.globSync): where the system's is older, npm's `node`
# package puts one beside it.
CONFORMANCE = @modelcontextprotocol/conformance@0.2.0-alpha.12
$(MCP_VENV)/conformance/.installed:
	rm -rf $(MCP_VENV)/conformance
	mkdir -p $(MCP_VENV)/conformance
	npm install --prefix $(MCP_VENV)/conformance --silent --no-audit --no-fund $(CONFORMANCE)
	node -e 'process.exit(+(process.versions.node.split(".")[0] < 22))' 2>/dev/null || \
		npm install --prefix $(MCP_VENV)/conformance --silent --no-audit --no-fund node@22
	touch $@

$(MCP_VENV)/2/.installed:
	rm -rf $(MCP_VENV)/2
	$(PYTHON) -m venv $(MCP_VENV)/2
	$(MCP_VENV)/2/bin/pip install --quiet --disable-pip-version-check mcp==2.3.0
	touch $@

$(MCP_VENV)/ts/.installed:
	rm -rf $(MCP_VENV)/ts
	mkdir -p $(MCP_VENV)/ts
	npm install --prefix $(MCP_VENV)/ts --silent --no-audit --no-fund \
		@modelcontextprotocol/server-everything@2026.8.31
	touch $@

$(MCP_VENV)/1/.installed:
	rm -rf $(MCP_VENV)/1
	$(PYTHON) -m venv $(MCP_VENV)/1
	$(MCP_VENV)/1/bin/pip install --quiet --disable-pip-version-check mcp==1.30.0
	touch $@
