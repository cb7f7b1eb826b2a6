"""The README's example runs as written and prints what the README shows."""

from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def blocks(language: str) -> list[str]:
    """The README's fenced code blocks in ``language``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", README.read_text(), re.M | re.S)


def test_the_first_example_runs_and_prints_what_the_readme_shows() -> None:
    example, shown = blocks("python")[0], blocks("text")[0]
    out = io.StringIO()
    with torch.random.fork_rng(), contextlib.redirect_stdout(out):
        exec(compile(example, str(README), "exec"), {"__name__": "readme_example"})
    printed = out.getvalue().splitlines()
    expected = shown.splitlines()
    assert len(printed) == len(expected) == 3, printed
    for got, want in zip(printed, expected, strict=True):
        step, _, metrics = got.partition(" ")
        want_step, _, want_metrics = want.partition(" ")
        got_metrics, want_values = ast.literal_eval(metrics), ast.literal_eval(want_metrics)
        assert step == want_step and got_metrics.keys() == want_values.keys(), (got, want)
        for name, value in want_values.items():  # rounded to 4 places in both
            assert abs(got_metrics[name] - value) <= 2e-4, (name, got, want)
        assert got_metrics["actor/pg_clipfrac"] > 0  # the README says clip fractions move
