"""The toy reward of the trainer-loop test (verl loads it by path: ``custom_reward_function``)."""

from __future__ import annotations

from typing import Any


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **kwargs: Any
) -> float:
    """The share of the response's words that are the prompt's target word (0 when empty)."""
    words = solution_str.split()
    return sum(word == ground_truth for word in words) / len(words) if words else 0.0
