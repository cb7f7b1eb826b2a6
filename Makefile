# Two entry points on a fresh machine: `make demo` and `make test`.
# Both create (or reuse) .venv and install what they need into it.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0

.PHONY: demo test lint format bench clean

$(VENV)/.core: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[console]" "$(TORCH_PIN)"
	touch $@

$(VENV)/.dev: $(VENV)/.core
	$(PY) -m pip install -q -e ".[dev]" "$(TORCH_PIN)"
	touch $@

demo: $(VENV)/.core
	$(VENV)/bin/rlmetrics demo

test: $(VENV)/.dev
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(PY) -m pytest -q

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

format: $(VENV)/.dev
	$(VENV)/bin/ruff format src tests benchmarks
	$(VENV)/bin/ruff check --fix src tests benchmarks

bench: $(VENV)/.dev
	$(PY) benchmarks/log_bench.py
	$(PY) benchmarks/sync_bench.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
