"""pytest plugin of ``benchmarks/trl_own_tests.py`` (loaded with ``-p``).

- ``datasets.load_dataset("trl-internal-testing/zen", config)`` returns a local stand-in:
  the same columns and splits (``prompt`` as text, or as one user message for the
  ``conversational_*`` configs; 17 train and 2 test rows), prompts of its own; any other
  dataset raises, as it would offline without a cache.
- A newer ``tests/testing_utils.py`` may import a helper TRL 1.16 lacks
  (``is_joblib_available``); it is defined as False (the tests it gates are skipped).
- With ``RLMETRICS_TRAINER=exact`` every collected module's ``GRPOTrainer`` is
  ``rlmetrics.integrations.trl.ExactGRPOTrainer``.
- With ``RLMETRICS_MAX_STEPS=N``, a ``GRPOConfig`` that sets no ``max_steps`` trains N
  optimizer steps instead of its epochs (the tests' checks stay: parameters changed,
  the logs there); on a CPU a full epoch of every test takes hours.
- Each test's outcome is appended to the JSON lines file ``RLMETRICS_OUTCOMES`` as it
  ends, so a run cut short still reports what it ran.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

# the stand-in's prompts: unfinished sentences, so completions continue them
PROMPTS = [
    "A small step is better than",
    "Reading code is easier when",
    "A clear name is worth more than",
    "Tests that can fail are better than",
    "The simplest plan that works",
    "Measure twice before you",
    "A silent error is worse than",
    "The shortest path to a fix",
    "Two small files or one large",
    "Short lines are easier to read than",
    "A working draft beats",
    "When a design is hard to explain,",
    "When a design is easy to explain,",
    "Today is a good day to",
    "A rare case still deserves",
    "When in doubt, ask",
    "Good defaults save",
    "Logs are only useful when",
    "Later is often better than",
]
ZEN = "trl-internal-testing/zen"


def zen(config: str) -> Any:
    """The stand-in of ``trl-internal-testing/zen``'s ``config`` (a DatasetDict)."""
    from datasets import Dataset, DatasetDict

    if config.startswith("conversational"):
        rows = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    elif config.startswith("standard"):
        rows = list(PROMPTS)
    else:
        raise FileNotFoundError(f"no local stand-in for {ZEN!r} config {config!r}")
    return DatasetDict(
        train=Dataset.from_dict({"prompt": rows[:17]}),
        test=Dataset.from_dict({"prompt": rows[17:]}),
    )


def load_dataset(
    path: str, name: str | None = None, split: str | None = None, streaming: bool = False, **_: Any
) -> Any:
    """``datasets.load_dataset`` for the stand-in only."""
    if path != ZEN or name is None:
        raise FileNotFoundError(f"no local stand-in for dataset {path!r} ({name!r})")
    data = zen(name)
    if streaming:
        from datasets import IterableDatasetDict

        data = IterableDatasetDict(
            {key: value.to_iterable_dataset() for key, value in data.items()}
        )
    return data if split is None else data[split]


def pytest_configure(config: pytest.Config) -> None:
    import importlib

    import datasets

    datasets.load_dataset = load_dataset
    import_utils = importlib.import_module("trl.import_utils")
    if not hasattr(import_utils, "is_joblib_available"):
        import_utils.is_joblib_available = lambda: False
    max_steps = os.environ.get("RLMETRICS_MAX_STEPS")
    if max_steps:
        _cap_steps(int(max_steps))


def _cap_steps(steps: int) -> None:
    """GRPOConfig's ``max_steps``, when a test leaves it unset (-1), becomes ``steps``."""
    from trl import GRPOConfig

    post_init = GRPOConfig.__post_init__

    def capped(self: Any) -> None:
        if self.max_steps == -1:
            self.max_steps = steps
        post_init(self)

    GRPOConfig.__post_init__ = capped


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Append the test's outcome (its failing phase's, else its call's) to the file."""
    path = os.environ.get("RLMETRICS_OUTCOMES")
    failed_early = report.when == "setup" and not report.passed
    if path is None or not (report.when == "call" or failed_early or report.when == "teardown"):
        return
    if report.when == "teardown" and report.passed:
        return
    outcome = "error" if report.when != "call" and report.failed else report.outcome
    line = {"test": report.nodeid, "outcome": outcome, "when": report.when}
    if report.failed:
        line["message"] = str(report.longrepr).strip().splitlines()[-1][:300]
    with open(path, "a") as out:
        out.write(json.dumps(line) + "\n")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.environ.get("RLMETRICS_TRAINER") != "exact":
        return
    from rlmetrics.integrations.trl import ExactGRPOTrainer

    for item in items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "GRPOTrainer"):
            module.GRPOTrainer = ExactGRPOTrainer
