"""A short soak (benchmarks/soak.py, scaled down): 2 gloo ranks, every step exact, one
schema agreement and one cached layout however many steps, resident memory flat."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from soak import soak

STEPS = 400


def test_short_soak_is_exact_and_flat() -> None:
    for result in soak(STEPS, 100, tensor_every=5):
        assert result["steps"] == STEPS
        assert result["agreements"] == 1  # the name set never changes: agreed once
        assert result["cached_layouts"] == 1  # and the cache holds one layout
        assert result["exact_steps"] == result["checked_steps"] >= 2
        growth = result["rss_end_mib"] - result["rss_step100_mib"]
        assert growth < 16.0, result["rss_mib"]  # MiB over 300 steps: flat, with noise
