# Two entry points on a fresh machine: `make demo` and `make test`.
# Both create (or reuse) local venvs and install what they need into them; every pip
# call takes requirements/constraints.txt, so no dependency replaces the pinned torch.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
CONSTRAINTS := requirements/constraints.txt
PIP_INSTALL = -m pip install -q -c $(CONSTRAINTS)
TOOLS := .venv-tools
DIST := dist
PACKAGED := pyproject.toml README.md LICENSE $(shell find src -name '*.py' -o -name py.typed)

.PHONY: demo test test-core test-fast test-slow test-plain test-verl test-verl-fit test-trl test-skyrl lint format bench gpu-check clean dist docs api-snapshot

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

# SkyRL's venv: an explicit rule, as the pattern above cannot pass --ignore-requires-python.
# skyrl 0.4.0 declares Python >= 3.12; the CPU torch on disk is for 3.11, and SkyRL runs
# on it with the tests' shims (tests/integrations/skyrl/cpu_skyrl.py, requirements/skyrl.txt).
.venv-skyrl/.ready: requirements/skyrl.txt $(CONSTRAINTS) pyproject.toml
	$(PYTHON) -m venv .venv-skyrl
	.venv-skyrl/bin/python -m pip install -q --upgrade pip
	.venv-skyrl/bin/python $(PIP_INSTALL) --ignore-requires-python -r requirements/skyrl.txt
	.venv-skyrl/bin/python $(PIP_INSTALL) --no-deps -e .
	touch $@

# The tools that need neither torch nor the package: the docs site's (the `docs` extra:
# mkdocs reads src/ statically) and the release's (`release`: build, twine). The
# requirements are the two extras of pyproject.toml, read from it. An explicit rule, so
# the .venv-%/.ready pattern above does not apply.
$(TOOLS)/.ready: pyproject.toml $(CONSTRAINTS)
	test -x $(TOOLS)/bin/python || $(PYTHON) -m venv $(TOOLS)
	$(PYTHON) -c "import tomllib; extras = tomllib.load(open('pyproject.toml', 'rb'))\
	  ['project']['optional-dependencies']; print('\n'.join(extras['docs'] + extras['release']))" \
	  > $(TOOLS)/requirements.txt
	$(TOOLS)/bin/python $(PIP_INSTALL) -r $(TOOLS)/requirements.txt
	touch $@

# The release: an sdist and a wheel in dist/ (what `twine upload dist/*` would send),
# checked by twine (metadata, the README as the long description). Rebuilt when a
# packaged file changes.
$(DIST)/.built: $(TOOLS)/.ready $(PACKAGED)
	rm -rf $(DIST)
	$(TOOLS)/bin/python -m build -q --outdir $(DIST) .
	$(TOOLS)/bin/twine check --strict $(DIST)/*
	touch $@

dist: $(DIST)/.built

# A plain install of the wheel a user gets: torch, numpy and the package, no extras
# (an explicit rule, so the .venv-%/.ready pattern above does not apply). The wheel's
# version does not change from build to build, so the package is uninstalled first.
.venv-plain/.ready: $(DIST)/.built $(CONSTRAINTS)
	test -x .venv-plain/bin/python || $(PYTHON) -m venv .venv-plain
	.venv-plain/bin/python -m pip uninstall -q -y rlmetrics
	.venv-plain/bin/python $(PIP_INSTALL) $(DIST)/rlmetrics-*.whl
	touch $@

demo: $(VENV)/.core
	$(VENV)/bin/rlmetrics demo

# Everything (what CI runs, .ci/run): lint and the fast core tests, the slow core tests, a
# plain install of the wheel, the docs site, then the verl, TRL and SkyRL suites. PYTEST_ARGS go
# to each core pytest run (e.g. PYTEST_ARGS=-x to stop at the first failure).
test: test-fast test-slow test-plain docs test-verl test-trl test-skyrl

test-core: test-fast test-slow

# The inner loop and the first part of `make test`: lint, then the core suite without the
# tests marked slow (spawned ranks, Ray, trainer runs: all of tests/multiprocess/, and a
# few tests elsewhere marked @pytest.mark.slow).
test-fast: lint
	$(PY) -m pytest -q --durations=15 -m "not slow" tests --ignore=tests/integrations $(PYTEST_ARGS)

# The core tests marked slow.
test-slow: $(VENV)/.dev
	$(PY) -m pytest -q --durations=15 -m slow tests --ignore=tests/integrations $(PYTEST_ARGS)

# What a plain `pip install rlmetrics` user runs first, from the wheel of `make dist`: it
# is installed (not editable) with py.typed and without tests or benchmarks, and its
# version is the package's; no optional package may be present; the demo (2 spawned ranks, a plain-text table; a smaller batch and model to
# keep it short) and the audit exit 0; `audit --plot` stops at once naming
# rlmetrics[plot]. Their output goes to files, checked and shown in full only when
# something is wrong (a green run prints the demo's summary and the audit's verdict).
# Run in a temp folder (HOME and TMPDIR too), not in the repository.
test-plain: .venv-plain/.ready
	.venv-plain/bin/python -c "import importlib.metadata as m, sys, rlmetrics; \
	  files = [str(f) for f in m.files('rlmetrics')]; \
	  shipped = [f for f in files if f.split('/')[0] in ('tests', 'benchmarks')]; \
	  sys.exit(f'the wheel ships {shipped}' if shipped \
	    else 'no py.typed in the wheel' if 'rlmetrics/py.typed' not in files \
	    else f'not the wheel: {rlmetrics.__file__}' if 'site-packages' not in rlmetrics.__file__ \
	    else f'version {rlmetrics.__version__} != {m.version(\"rlmetrics\")}' \
	      if rlmetrics.__version__ != m.version('rlmetrics') else 0)"
	.venv-plain/bin/python -c "import importlib.util as u, sys; \
	  extra = [m for m in ('rich', 'tqdm', 'matplotlib') if u.find_spec(m)]; \
	  sys.exit(f'not a plain install: {extra}' if extra else 0)"
	set -e; dir=$$(mktemp -d); cd $$dir; export HOME=$$dir TMPDIR=$$dir; \
	  show() { cat $$1; echo "test-plain: $$2"; exit 1; }; \
	  $(CURDIR)/.venv-plain/bin/rlmetrics demo --steps 3 --log-every 3 --num-prompts 8 \
	    --samples-per-prompt 4 --n-embd 64 >demo.txt 2>&1 || show demo.txt "the demo failed"; \
	  grep -q "^group  *metric  *value" demo.txt || show demo.txt "no plain metrics table"; \
	  grep -q "^next: .* audit --naive" demo.txt || show demo.txt "no closing hint"; \
	  $(CURDIR)/.venv-plain/bin/rlmetrics audit >audit.txt 2>&1 || show audit.txt "the audit failed"; \
	  grep -q "metrics invariant to" audit.txt || show audit.txt "no audit verdict"; \
	  if $(CURDIR)/.venv-plain/bin/rlmetrics audit --plot a.png 2>err.txt; then exit 1; fi; \
	  grep -q "rlmetrics\[plot\]" err.txt; sed -n '/ steps on /,$$p' demo.txt; \
	  grep "metrics invariant to" audit.txt; \
	  cd /; rm -rf $$dir

test-verl: .venv-verl/.ready
	.venv-verl/bin/python -m pytest -q --durations=10 -p no:cacheprovider tests/integrations/verl

# verl's RayPPOTrainer.fit() on the CPU alone, 4 runs of 2 steps (minutes; in test-verl too).
test-verl-fit: .venv-verl/.ready
	.venv-verl/bin/python -m pytest -q --durations=10 -p no:cacheprovider \
	  tests/integrations/verl/test_trainer_fit.py

test-trl: .venv-trl/.ready
	.venv-trl/bin/python -m pytest -q --durations=10 -p no:cacheprovider tests/integrations/trl

# SkyRL's real FSDP workers on gloo ranks and its trainer on Ray, on the CPU.
test-skyrl: .venv-skyrl/.ready
	.venv-skyrl/bin/python -m pytest -q --durations=10 -p no:cacheprovider tests/integrations/skyrl

# The docs site (mkdocs.yml: docs/ and an API reference from the docstrings) into site/.
# --strict: a broken link or anchor, a page outside the nav, or an API name that does not
# exist fails the build.
docs: $(TOOLS)/.ready
	NO_MKDOCS_2_WARNING=1 $(TOOLS)/bin/mkdocs build --strict --site-dir site

# Rewrite tests/unit/public_api.txt from the code, after a deliberate API change: the core
# venv writes every section but verl's, TRL's and SkyRL's, which their venvs write.
api-snapshot: $(VENV)/.dev .venv-verl/.ready .venv-trl/.ready .venv-skyrl/.ready
	RLMETRICS_UPDATE_API=1 $(PY) -m pytest -q -p no:cacheprovider tests/unit/test_public_api.py
	RLMETRICS_UPDATE_API=1 .venv-verl/bin/python -m pytest -q -p no:cacheprovider \
	  tests/integrations/verl/test_verl_public_api.py
	RLMETRICS_UPDATE_API=1 .venv-trl/bin/python -m pytest -q -p no:cacheprovider \
	  tests/integrations/trl/test_trl_public_api.py
	RLMETRICS_UPDATE_API=1 .venv-skyrl/bin/python -m pytest -q -p no:cacheprovider \
	  tests/integrations/skyrl/test_skyrl_public_api.py

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
	$(PY) benchmarks/cycle_bench.py
	$(PY) benchmarks/fold_bench.py

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
	rm -rf $(VENV) .venv-verl .venv-trl .venv-skyrl .venv-plain $(TOOLS) build $(DIST) site *.egg-info \
	  src/*.egg-info
