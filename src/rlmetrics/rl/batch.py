"""Batch metrics of a rollout: scores, rewards, advantages, returns, lengths."""

from __future__ import annotations

from torch import Tensor

from rlmetrics.rl.explained_var import explained_var_update
from rlmetrics.rl.updates import MetricUpdate, bool_mask, extremes, masked


def per_sequence(values: Tensor, mask: Tensor) -> Tensor:
    """(B,) values as they are; (B, T) token values summed over the valid tokens."""
    return values if values.dim() == 1 else masked(values, mask).sum(-1)


def length_updates(
    name: str, lengths: Tensor, max_length: int | None, select: Tensor | None = None
) -> list[MetricUpdate]:
    """``name/{mean,max,min}`` per sequence and ``name/clip_ratio``: the fraction of
    sequences that reached ``max_length`` (omitted when it is None); only the sequences
    in ``select`` when given."""
    lengths = lengths.detach().double()
    updates = extremes(name, lengths, select)
    if max_length is not None:
        clipped = (lengths >= max_length).double()
        updates.append(MetricUpdate(f"{name}/clip_ratio", "mean", clipped, select))
    return updates


def aborted_updates(lengths: Tensor, max_length: int | None) -> list[MetricUpdate]:
    """response/aborted_ratio (sequences with an empty response) and
    response_length_non_aborted/{mean,max,min,clip_ratio} over the others."""
    aborted = lengths == 0
    return [
        MetricUpdate("response/aborted_ratio", "mean", aborted.double()),
        *length_updates("response_length_non_aborted", lengths, max_length, ~aborted),
    ]


def batch_metrics(
    response_mask: Tensor,
    *,
    scores: Tensor | None = None,
    rewards: Tensor | None = None,
    advantages: Tensor | None = None,
    returns: Tensor | None = None,
    values: Tensor | None = None,
    prompt_mask: Tensor | None = None,
    max_response_length: int | None = None,
    max_prompt_length: int | None = None,
) -> list[MetricUpdate]:
    """Metric updates describing a (piece of a) rollout batch; any split merges exactly.

    Per sequence: critic/score/{mean,max,min} (scores (B,), or token scores (B, T) summed
    over valid tokens) and critic/rewards/{mean,max,min} (same, after penalties), both
    over the sequences with a non-empty response (an empty one was aborted, as in
    verl); response_length/{mean,max,min,clip_ratio} over all sequences,
    response_length_non_aborted/{...} over the non-empty ones, response/aborted_ratio,
    prompt_length/{mean,max,min,clip_ratio}.
    Per valid token: critic/advantages/{...}, critic/returns/{...}, critic/values/{...}
    and critic/vf_explained_var (1 - Var(R - V)/Var(R), when returns and values given).

    Args:
        response_mask: valid response tokens, (B, T).
        prompt_mask: valid prompt tokens, (B, P).
        max_response_length, max_prompt_length: the configured limits: a sequence at
            the limit counts as clipped (use the config value, never the padded width,
            which depends on the split).
    """
    mask = bool_mask(response_mask)
    lengths = mask.sum(-1)
    answered = lengths > 0
    updates: list[MetricUpdate] = []
    if scores is not None:
        updates += extremes("critic/score", per_sequence(scores, mask), answered)
    if rewards is not None:
        updates += extremes("critic/rewards", per_sequence(rewards, mask), answered)
    if advantages is not None:
        updates += extremes("critic/advantages", advantages, mask)
    if returns is not None:
        updates += extremes("critic/returns", returns, mask)
    if values is not None:
        updates += extremes("critic/values", values, mask)
    if returns is not None and values is not None:
        updates.append(explained_var_update(returns, values, mask))
    updates += length_updates("response_length", lengths, max_response_length)
    updates += aborted_updates(lengths, max_response_length)
    if prompt_mask is not None:
        lengths = bool_mask(prompt_mask).sum(-1)
        updates += length_updates("prompt_length", lengths, max_prompt_length)
    return updates
