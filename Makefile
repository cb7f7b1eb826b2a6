# Two entry points on a fresh machine: `make demo` and `make test`.
# Both create (or reuse) local venvs and install what they need into them; every pip
# call takes requirements/constraints.txt, so no dependency replaces the pinned torch.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
CONSTRAINTS := requirements/constraints.txt
PIP_INSTALL = -m pip install -q -c $(CONSTRAINTS)

.PHONY: demo test test-core test-fast test-slow test-plain test-verl test-trl lint format bench gpu-check clean

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

# A plain install: torch, numpy and the package, no extras, not editable (an explicit
# rule, so the .venv-%/.ready pattern above does not apply). Rebuilt when a source changes.
.venv-plain/.ready: pyproject.toml $(CONSTRAINTS) $(shell find src -name '*.py')
	test -x .venv-plain/bin/python || $(PYTHON) -m venv .venv-plain
	.venv-plain/bin/python $(PIP_INSTALL) .
	touch $@

demo: $(VENV)/.core
	$(VENV)/bin/rlmetrics demo

# Everything (what CI runs, .ci/run): lint and the fast core tests, the slow core tests, a
# plain install, then the verl and TRL suites. PYTEST_ARGS go to each core pytest run
# (e.g. PYTEST_ARGS=-x to stop at the first failure).
test: test-fast test-slow test-plain test-verl test-trl

test-core: test-fast test-slow

# The inner loop and the first part of `make test`: lint, then the core suite without the
# tests marked slow (spawned ranks, Ray, trainer runs: all of tests/multiprocess/, and a
# few tests elsewhere marked @pytest.mark.slow).
test-fast: lint
	$(PY) -m pytest -q --durations=15 -m "not slow" tests --ignore=tests/integrations $(PYTEST_ARGS)

# The core tests marked slow.
test-slow: $(VENV)/.dev
	$(PY) -m pytest -q --durations=15 -m slow tests --ignore=tests/integrations $(PYTEST_ARGS)

# What a plain `pip install rlmetrics` user runs first: no optional package may be
# present; the demo (2 spawned ranks, plain-text tables; a smaller batch and model to
# keep it short) and the audit exit 0; `audit --plot` stops at once naming
# rlmetrics[plot]. Run in a temp folder (HOME and TMPDIR too), not in the repository.
test-plain: .venv-plain/.ready
	.venv-plain/bin/python -c "import importlib.util as u, sys; \
	  extra = [m for m in ('rich', 'tqdm', 'matplotlib') if u.find_spec(m)]; \
	  sys.exit(f'not a plain install: {extra}' if extra else 0)"
	set -e; dir=$$(mktemp -d); cd $$dir; export HOME=$$dir TMPDIR=$$dir; \
	  $(CURDIR)/.venv-plain/bin/rlmetrics demo --steps 3 --log-every 1 --num-prompts 8 \
	    --samples-per-prompt 4 --n-embd 64; \
	  $(CURDIR)/.venv-plain/bin/rlmetrics audit; \
	  if $(CURDIR)/.venv-plain/bin/rlmetrics audit --plot a.png 2>err.txt; then exit 1; fi; \
	  grep -q "rlmetrics\[plot\]" err.txt; cd /; rm -rf $$dir

test-verl: .venv-verl/.ready
	.venv-verl/bin/python -m pytest -q --durations=10 -p no:cacheprovider tests/integrations/verl

test-trl: .venv-trl/.ready
	.venv-trl/bin/python -m pytest -q --durations=10 -p no:cacheprovider tests/integrations/trl

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy

format: $(VENV)/.dev
	$(VENV)/bin/ruff format src tests benchmarks
	$(VENV)/bin/ruff check --fix src tests benchmarks

bench: $(VENV)/.dev
	$(PY) benchmarks/log_bench.py
	$(PY) benchmarks/step_bench.py
	$(PY) benchmarks/sync_bench.py

# The GPU check (benchmarks/gpu_check.py): the CUDA tests, the demo on the GPU with every
# log call under the sync guard, kernels per log call, compute() and the fold's ns per
# element, into $(GPU_CHECK_OUT)/gpu_check.json. No venv: GPU_PYTHON's own torch, nothing
# installed. Without CUDA it is the CPU dry run (tests/benchmarks/test_gpu_check.py runs
# that one).
GPU_PYTHON ?= python3
GPU_CHECK_OUT ?= gpu-check-results
gpu-check:
	PYTHONPATH=src $(GPU_PYTHON) benchmarks/gpu_check.py --out $(GPU_CHECK_OUT)

clean:
	rm -rf $(VENV) .venv-verl .venv-trl .venv-plain build *.egg-info src/*.egg-info
