"""Fixtures shared by the TRL tests: the tiny local model, a quiet HOME, and the one
torchrun launch (2 processes) every two-process test reads."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="needs the .venv-trl environment (make test-trl)")

sys.path.insert(0, str(Path(__file__).parent))
import grpo_runs

# transformers 5.24's deprecations that TRL 1.16 itself triggers, on every run: GRPOConfig
# sets `gradient_checkpointing` (its default) and GRPOTrainer reads
# `model.is_gradient_checkpointing`. Known noise, not ours: a green run reads as green.
TRL_NOISE = (
    "ignore:`gradient_checkpointing` is deprecated:FutureWarning",
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning",
)


def pytest_configure(config: pytest.Config) -> None:
    for line in TRL_NOISE:
        config.addinivalue_line("filterwarnings", line)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return grpo_runs.build_model_dir(tmp_path_factory.mktemp("trl") / "model")


@pytest.fixture(scope="session", autouse=True)
def quiet_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """HF caches and logs go to a temp dir; nothing is downloaded."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:  # the session-scoped form of monkeypatch
        patch.setenv("HOME", str(home))
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("TOKENIZERS_PARALLELISM", "false")
        yield


@pytest.fixture(scope="session")
def two_processes(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every two-process run, from one torchrun launch: spec.key -> per rank."""
    out = tmp_path_factory.mktemp("dist")
    return grpo_runs.launch_two_processes(grpo_runs.two_process_specs(), model_dir, out)


@pytest.fixture(scope="session")
def first_steps(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The late-order runs with and without ExtraMetrics, each in its own torchrun
    launch, so that each one's first log() is its process group's first sync, as in a
    job: spec.key -> per rank."""
    runs: dict = {}
    for spec in grpo_runs.late_source_specs():
        out = tmp_path_factory.mktemp("first")
        runs.update(grpo_runs.launch_two_processes([spec], model_dir, out))
    return runs
