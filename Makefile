# function_calling: make run · make test · make test-all · make lint
# Only Python 3 and make are needed; `make lint` alone downloads its checkers (into .venv-lint/).

PYTHON ?= python3
SOURCES := function_calling.py test_function_calling.py
LINT_VENV := .venv-lint
LINT_TOOLS := ruff==0.17.6 mypy==2.4.1
RUFF_RULES := --line-length 100 --target-version py310 \
	--select E,F,W,I,B,UP,SIM,RUF,N,C4,PL,PIE,RET,BLE,S \
	--ignore PLR2004,PLR0913,PLR0917 --per-file-ignores test_function_calling.py:S

.PHONY: run demo test test-all lint bench

# With a key, ask the real model; without one, run the offline scripted demo.
run:
	@if [ -n "$$OPENAI_API_KEY" ]; then \
		$(PYTHON) function_calling.py ask "Where is my order ORD-1001?"; \
	else \
		echo "OPENAI_API_KEY is not set: running the offline demo instead."; echo; \
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

# Speed as ratios against baselines measured in the same run (skipped by `make test`).
bench:
	@FUNCTION_CALLING_BENCH=1 $(PYTHON) test_function_calling.py Benchmarks 2>&1

lint: $(LINT_VENV)/.installed
	$(LINT_VENV)/bin/ruff check $(RUFF_RULES) $(SOURCES)
	$(LINT_VENV)/bin/ruff format --check --line-length 100 $(SOURCES)
	$(LINT_VENV)/bin/mypy --strict --python-version 3.10 --cache-dir $(LINT_VENV)/mypy-cache $(SOURCES)

$(LINT_VENV)/.installed:
	rm -rf $(LINT_VENV)
	$(PYTHON) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/pip install --quiet --disable-pip-version-check $(LINT_TOOLS)
	touch $@
