"""The verl suite runs in .venv-verl (``make test-verl``); elsewhere it is skipped whole.

Real verl 0.9.1 runs on the CPU here (``cpu_verl.py``); the spawned ranks share one
temporary HOME/TMPDIR, so nothing is written outside it. The tests that need Ray share
one local Ray (``verl_ray``), started once.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

if importlib.util.find_spec("verl") is None:  # the core venv: nothing here can run
    collect_ignore_glob = ["test_*.py"]

VERL_NOISE = (
    # verl 0.9.1 marks its V0 trainer (which test_trainer_fit.py runs) with a date it
    # has already passed: "... will be removed in v0.9.0"
    "ignore:.*RayPPOTrainer. is deprecated:FutureWarning",
    # verl's engine registry, at import, for each engine this venv does not install
    "ignore:.* engine is not available:UserWarning:verl.workers.engine",
    # what verl's dependencies say about themselves
    "ignore:Ray state API is no longer experimental:DeprecationWarning",
    "ignore:'set_vital' is deprecated:UserWarning:torchdata.*",
    # torch, when test_losses.py builds a strided nested mask on purpose
    "ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning",
)
"""verl's and its dependencies' known warnings, none of them rlmetrics': a green run
reads as green."""


def pytest_configure(config: pytest.Config) -> None:
    for line in VERL_NOISE:
        config.addinivalue_line("filterwarnings", line)


@pytest.fixture(scope="session")
def verl_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A temporary HOME and TMPDIR for verl, transformers and torch (and their caches)."""
    home = str(tmp_path_factory.mktemp("verl_home"))
    with pytest.MonkeyPatch.context() as patch:  # the session-scoped form of monkeypatch
        patch.setenv("HOME", home)
        patch.setenv("TMPDIR", home)
        patch.setenv("HF_HOME", os.path.join(home, "hf"))
        yield home


@pytest.fixture(scope="session")
def model_path(verl_home: str) -> str:
    """The tiny actor and critic models, saved once per session."""
    from scenarios import make_models

    path = os.path.join(verl_home, "models")
    make_models(path)
    return path


@pytest.fixture(scope="session")
def verl_ray() -> Iterator[None]:
    """One local Ray for the suite (4 logical CPUs: two worker groups of 2), started on
    first use and shut down at the end of the session."""
    from local_ray import local_ray

    with local_ray(num_cpus=4):
        yield
