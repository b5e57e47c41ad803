# One command for the demo, one for the tests; each installs what it needs into .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean tools

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/llmhealth demo

lint: $(STAMP)
	$(BIN)/ruff check llmhealth tests bench
	$(BIN)/ruff format --check llmhealth tests bench
	$(BIN)/mypy llmhealth

# promtool and systemd-analyze for tests/test_deploy.py; returns at once when both exist.
tools:
	scripts/install-tools.sh

test: lint tools
	$(BIN)/pytest -q

bench: $(STAMP)
	cd bench && ../$(BIN)/python run.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
