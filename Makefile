# Two entry points on a fresh machine: `make demo` and `make test`.
# Both create (or reuse) local venvs and install what they need into them; every pip
# call takes requirements/constraints.txt, so no dependency replaces the pinned torch.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
CONSTRAINTS := requirements/constraints.txt
PIP_INSTALL = -m pip install -q -c $(CONSTRAINTS)

.PHONY: demo test test-core test-fast test-verl test-trl lint format bench clean

$(VENV)/.core: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) $(PIP_INSTALL) -e ".[console,plot]"
	touch $@

$(VENV)/.dev: $(VENV)/.core
	$(PY) $(PIP_INSTALL) -e ".[dev]"
	touch $@

# A framework's own venv: its pins differ from ours. rlmetrics goes in without
# dependencies (editable, so its entry points are registered).
.venv-%/.ready: requirements/%.txt $(CONSTRAINTS) pyproject.toml
	$(PYTHON) -m venv .venv-$*
	.venv-$*/bin/python -m pip install -q --upgrade pip
	.venv-$*/bin/python $(PIP_INSTALL) -r requirements/$*.txt
	.venv-$*/bin/python $(PIP_INSTALL) --no-deps -e .
	touch $@

demo: $(VENV)/.core
	$(VENV)/bin/rlmetrics demo

# Everything: lint, the core suite, then the verl and TRL integration suites.
test: test-core test-verl test-trl

test-core: lint
	$(PY) -m pytest -q --durations=15 tests --ignore=tests/integrations

# The inner loop: the core suite without the slow (multi-process, trainer) tests.
test-fast: lint
	$(PY) -m pytest -q -x -m "not slow" tests --ignore=tests/integrations

test-verl: .venv-verl/.ready
	.venv-verl/bin/python -m pytest -q --durations=10 -p no:cacheprovider tests/integrations/verl

test-trl: .venv-trl/.ready
	.venv-trl/bin/python -m pytest -q --durations=10 -p no:cacheprovider tests/integrations/trl

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
	rm -rf $(VENV) .venv-verl .venv-trl build *.egg-info src/*.egg-info
