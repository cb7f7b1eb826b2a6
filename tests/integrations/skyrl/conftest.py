"""Fixtures shared by the SkyRL tests: the CPU shims for imports, the tiny local model,
a quiet HOME, and the two gloo launches (1 rank and 2 ranks) every worker test reads."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("skyrl", reason="needs the .venv-skyrl environment (make test-skyrl)")

sys.path.insert(0, str(Path(__file__).parent))
import cpu_skyrl

cpu_skyrl.install_imports()  # before this process imports SkyRL's modules
import skyrl_runs  # noqa: E402 (after the shims)


@pytest.fixture(scope="session", autouse=True)
def quiet_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """HF caches, SkyRL's and Ray's files go to a temp dir; nothing is downloaded."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:  # the session-scoped form of monkeypatch
        patch.setenv("HOME", str(home))
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("TOKENIZERS_PARALLELISM", "false")
        patch.setenv("RAY_AUTH_MODE", "disabled")
        patch.delenv("SKYRL_LOG_FILE", raising=False)  # SkyRL's workers would write there
        yield


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return skyrl_runs.build_model_dir(tmp_path_factory.mktemp("skyrl") / "model")


@pytest.fixture(scope="session")
def one_rank(model_dir: Path) -> dict[str, Any]:
    """The 1-rank launch: its split, the reference forward passes."""
    return skyrl_runs.launch(1, model_dir)[0]


@pytest.fixture(scope="session")
def two_ranks(model_dir: Path) -> dict[int, dict[str, Any]]:
    """The 2-rank launch: its four splits, SkyRL's own step of several mini-batches."""
    return skyrl_runs.launch(2, model_dir)


@pytest.fixture(scope="session")
def splits(one_rank: dict[str, Any], two_ranks: dict[int, dict[str, Any]]) -> dict:
    """(split name, role, "plain" | "exact") -> rank 0's metrics dict, every split."""
    return {**one_rank["splits"], **two_ranks[0]["splits"]}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The first test of each launch pays for it (spawned ranks or Ray actors importing
    SkyRL and building its workers): minutes on a loaded 2-core machine, past the
    project's 300 s default."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.timeout(1200))
