"""What one micro-batch of verl's ``ppo_loss`` / ``value_loss`` means, as Tracker logs.

verl's loss functions return one number per metric and micro-batch, normalised in one
of two ways, and verl then combines those numbers by a mean of means (clip fractions,
ppo_kl, vpred_mean) or a sum over micro-batches averaged over ranks (the losses). The
first drifts with the split. Here each number is logged with the weight it stands for,
so the merged result is the whole batch's value whatever the split:

* token means (``masked_mean`` over the micro-batch's response tokens): weight = the
  micro-batch's response tokens (the tokens rejection sampling kept, for the policy
  loss's own means under ``bypass_mode`` with ``rollout_rs``);
* sequence means (a mean over the micro-batch's rows), maxima and minima: weight = the
  micro-batch's sequences, or a max / min;
* losses from ``agg_loss`` normalised by the global mini-batch (``batch_num_tokens`` or
  ``global_batch_size``, times ``dp_size``): the micro-batch's share is turned back into
  its own mean (value x global normaliser / (dp_size x local count)) and logged with its
  local count (tokens for "token-mean", non-empty sequences for the "seq-mean-*" modes).
  Its merge over micro-batches, ranks and mini-batches is then the token (or sequence)
  mean over everything the step saw.

The policy-loss mode (``actor.policy_loss.loss_mode``) decides how ``actor/pg_loss`` is
normalised (``PG_LOSS_AGG``); every mode's other metrics are in the tables below. Names
not listed here (kl_coef, "token-sum" losses, the importance-sampling and rejection
statistics ``bypass_mode`` adds with ``rollout_is`` / ``rollout_rs``) keep verl's value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from rlmetrics.integrations.verl import detail
from rlmetrics.tracker import Tracker

POLICY_TOKEN_MEANS = frozenset({"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"})
"""The policy loss's own token means (every mode that reports them: a masked mean over
the tokens its loss covers)."""

TOKEN_MEANS = POLICY_TOKEN_MEANS | {
    "critic/vf_clipfrac",
    "critic/vpred_mean",
    "rollout_corr/kl",
    "rollout_corr/k3_kl",
    "rollout_corr/chi2_token",
    "rollout_corr/rollout_rs_masked_fraction",
}
"""Metrics verl computes as a masked mean over the micro-batch's response tokens
(``chi2_token`` is one minus 1, which averages the same way)."""

ROW_MEANS = frozenset(
    {
        "rollout_corr/training_ppl",
        "rollout_corr/training_log_ppl",
        "rollout_corr/rollout_ppl",
        "rollout_corr/rollout_log_ppl",
        "rollout_corr/log_ppl_diff",
        "rollout_corr/log_ppl_abs_diff",
        "rollout_corr/ppl_ratio",
        "rollout_corr/chi2_seq",
        "rollout_corr/rollout_rs_seq_masked_fraction",
    }
)
"""Metrics verl computes as a mean over the micro-batch's sequences (``bypass_mode``'s
off-policy diagnostics and its share of sequences rejection sampling touched: one
value per sequence, ``.mean()`` over the rows)."""

MAXIMA = frozenset({"rollout_corr/log_ppl_diff_max"})
"""Metrics verl computes as the micro-batch's largest per-sequence value."""

MINIMA = frozenset({"rollout_corr/log_ppl_diff_min"})
"""Metrics verl computes as the micro-batch's smallest per-sequence value."""

AGG_LOSSES = frozenset({"actor/pg_loss", "actor/entropy_loss", "kl_loss", "critic/vf_loss"})
"""Metrics verl computes with ``agg_loss`` (scaled by the global mini-batch)."""

MASK_WEIGHTED = TOKEN_MEANS | AGG_LOSSES
"""Metrics whose value over some of the micro-batch's rows comes from restricting the
response mask to them (the per-source extras). Row means, maxima and minima count every
row, masked or not, so they have no per-source value."""

KINDS = (
    dict.fromkeys(TOKEN_MEANS | ROW_MEANS | AGG_LOSSES, "mean")
    | dict.fromkeys(MAXIMA, "max")
    | dict.fromkeys(MINIMA, "min")
)
"""The Tracker kind each metric this module makes exact is logged as."""

TOKEN_MODE = "token-mean"
SEQUENCE_MODES = frozenset({"seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"})
ROW_MEAN = "row-mean"
"""A loss that is the plain mean over the micro-batch's sequences (no global count)."""

PG_LOSS_AGG = {"sapo": "seq-mean-token-mean", "geo_mean": ROW_MEAN}
"""Policy-loss modes whose ``actor/pg_loss`` ignores ``loss_agg_mode``: sapo always
aggregates "seq-mean-token-mean" (by the global batch, as the others do); geo_mean
takes ``torch.mean`` over the micro-batch's sequence losses."""

RS_MASKED_FRACTION = "rollout_corr/rollout_rs_masked_fraction"
"""``bypass_mode`` with rejection sampling: the share of the micro-batch's response
tokens it rejected. The policy loss's token means cover the kept tokens only."""


def scalar(value: Any) -> torch.Tensor:
    """A verl metric value (a ``Metric`` holding one value, a float, a 0-d tensor) as a
    float64 0-d tensor, without a host sync for tensors."""
    values = getattr(value, "values", None)
    if isinstance(values, list):  # verl.utils.metric.Metric
        if len(values) != 1:
            raise ValueError(f"expected one value per micro-batch, got {len(values)}")
        value = values[0]
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).to(torch.float64)
    return torch.tensor(float(value), dtype=torch.float64)


def response_counts(data: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(response tokens, sequences with a response token, sequences) of a micro-batch.

    ``data`` is the micro-batch TensorDict verl hands its loss function, with
    ``response_mask`` nested (no padding) or padded; both count the same.
    """
    mask = data["response_mask"]
    if mask.is_nested and mask.layout is torch.jagged:
        # each sequence's tokens, summed over the jagged values by offsets: no padded copy
        values = mask.values().to(torch.bool)
        marked = values.flatten(1).sum(-1, dtype=torch.float64) if values.dim() > 1 else values
        per_seq = torch.segment_reduce(marked.to(torch.float64), "sum", offsets=mask.offsets())
    elif mask.is_nested:  # a strided nested tensor: its rows one by one
        per_seq = torch.stack(
            [row.to(torch.bool).sum(dtype=torch.float64) for row in mask.unbind()]
        )
    else:
        per_seq = mask.to(torch.bool).flatten(1).sum(-1, dtype=torch.float64)
    rows = torch.tensor(float(per_seq.shape[0]), dtype=torch.float64, device=per_seq.device)
    return per_seq.sum(), (per_seq > 0).sum().to(torch.float64), rows


def loss_share(
    value: torch.Tensor, *, mode: str, counts: tuple[torch.Tensor, ...], info: Mapping
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(this micro-batch's own mean, its weight) from an ``agg_loss`` value; None when
    the mode keeps verl's own value ("token-sum", or a mode this module does not know).

    ``agg_loss`` divides the micro-batch's sum by a global count and multiplies by
    dp_size; multiplying back gives the sum, and the local count the same global count
    adds up from: response tokens ("token-mean", ``batch_num_tokens``), sequences
    ("seq-mean-*", ``global_batch_size``), or, with no global count (one rank), the
    local one ``agg_loss`` used (non-empty sequences).
    """
    tokens, nonempty, rows = counts
    dp_size = info.get("dp_size") or 1
    if mode == ROW_MEAN:
        return value, rows
    if mode == TOKEN_MODE:
        count, total = tokens, info.get("batch_num_tokens")
    elif mode in SEQUENCE_MODES:
        total = info.get("global_batch_size")
        count = nonempty if total is None else rows
    else:
        return None
    if total is None:  # agg_loss normalised by the local count: value is the local mean
        return value, count
    scale = float(total) / float(dp_size)
    return value * scale / count.clamp(min=1.0), count


def log_micro_batch(
    tracker: Tracker,
    metrics: Mapping[str, Any],
    data: Any,
    *,
    loss_agg_mode: str,
    pg_loss_agg: str | None = None,
    suffix: str = "",
    rows: int | None = None,
) -> None:
    """Log one micro-batch's verl metrics with their true weights into ``tracker``.

    ``pg_loss_agg`` is how ``actor/pg_loss`` is aggregated when that is not
    ``loss_agg_mode`` (``PG_LOSS_AGG``). ``suffix`` is appended to every name
    (``"/<source>"`` for one data source's part); ``rows``, when given, is the number
    of sequences the metrics stand for (a source's rows, whose response mask alone does
    not tell empty rows from other sources').
    """
    names = [name for name in metrics if name in KINDS]
    if suffix:  # a part of the rows, selected by the response mask
        row_mean_loss = pg_loss_agg == ROW_MEAN
        names = [
            name
            for name in names
            if name in MASK_WEIGHTED and not (row_mean_loss and name == "actor/pg_loss")
        ]
    if not names:
        return
    counts = response_counts(data)
    if rows is not None:
        counts = (
            *counts[:2],
            torch.tensor(float(rows), dtype=torch.float64, device=counts[0].device),
        )
    tokens = counts[0]
    info = {key: _non_tensor(data, key) for key in ("dp_size", "batch_num_tokens")}
    info["global_batch_size"] = _non_tensor(data, "global_batch_size")
    kept = _kept_tokens(metrics, tokens)
    for name in names:
        value = scalar(metrics[name]).to(tokens.device)
        if name in TOKEN_MEANS:
            weight = kept if name in POLICY_TOKEN_MEANS else tokens
            tracker.mean(name + suffix, value, weight=weight)
        elif name in ROW_MEANS:
            tracker.mean(name + suffix, value, weight=counts[2])
        elif name in MAXIMA:
            tracker.max(name + suffix, value)
        elif name in MINIMA:
            tracker.min(name + suffix, value)
        else:
            mode = pg_loss_agg if name == "actor/pg_loss" and pg_loss_agg else loss_agg_mode
            share = loss_share(value, mode=mode, counts=counts, info=info)
            if share is not None:
                tracker.mean(name + suffix, *share)


def _kept_tokens(metrics: Mapping[str, Any], tokens: torch.Tensor) -> torch.Tensor:
    """The response tokens the policy loss's token means cover: all of them, or, when
    ``bypass_mode``'s rejection sampling masked some, the rest (its reported masked
    share is over the response tokens)."""
    rejected = metrics.get(RS_MASKED_FRACTION)
    if rejected is None:
        return tokens
    return tokens * (1.0 - scalar(rejected).to(tokens.device))


def _non_tensor(data: Any, key: str) -> Any:
    try:
        value = data[key]
    except KeyError:
        return None
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


class RecordingLoss:
    """A verl loss function that also logs its micro-batch's metrics into a Tracker.

    Calls the wrapped function unchanged (same loss, same gradients, same returned
    metrics), then logs. Picklable, so worker groups can ship it like the original.

    Args:
        loss_fn: ``functools.partial(ppo_loss | value_loss, config=...)``.
        tracker: where the metrics go (the worker's step tracker).
    """

    def __init__(self, loss_fn: Callable[..., Any], tracker: Tracker) -> None:
        config = getattr(loss_fn, "keywords", {}).get("config")
        mode = getattr(config, "loss_agg_mode", None)
        if not isinstance(mode, str):
            raise ValueError(
                "RecordingLoss: the loss function must be a functools.partial with a "
                f"config=... that has loss_agg_mode; got {loss_fn!r}"
            )
        self.loss_fn = loss_fn
        self.tracker = tracker
        self.loss_agg_mode = mode
        self.config = config
        self.is_policy_loss = getattr(loss_fn, "func", None) is _policy_loss()

    def __call__(self, model_output: Any, data: Any, dp_group: Any = None) -> tuple[Any, Any]:
        loss, metrics = self.loss_fn(model_output=model_output, data=data, dp_group=dp_group)
        self._log(self.tracker, metrics, data)
        if detail.enabled():
            self._log_detail(model_output, data, dp_group, metrics)
        return loss, metrics

    def _log_detail(
        self, model_output: Any, data: Any, dp_group: Any, metrics: Mapping[str, Any]
    ) -> None:
        """The opt-in extras (``rlmetrics.integrations.verl.detail``): the micro-batch's
        metrics per data source, and (actor) its tokens' entropy, ratio and KL sketches."""
        detail.log_per_source(
            self.tracker,
            self.loss_fn,
            self._log,
            model_output,
            data,
            dp_group,
            metrics,
        )
        if self.is_policy_loss:
            detail.log_token_quantiles(self.tracker, model_output, data, self.config)

    def _log(self, tracker: Tracker, metrics: Mapping[str, Any], data: Any, **where: Any) -> None:
        """``log_micro_batch`` with this loss's aggregation (``where``: a source's
        ``suffix`` and ``rows``). The mode is read at each call, as ``ppo_loss`` reads it."""
        mode = policy_loss_mode(self.config) if self.is_policy_loss else None
        log_micro_batch(
            tracker,
            metrics,
            data,
            loss_agg_mode=self.loss_agg_mode,
            pg_loss_agg=PG_LOSS_AGG.get(mode) if mode else None,
            **where,
        )


def policy_loss_mode(config: Any) -> str:
    """The actor config's ``policy_loss.loss_mode`` (verl's default: "vanilla")."""
    policy_loss = getattr(config, "policy_loss", None)
    mode = getattr(policy_loss, "loss_mode", None) if policy_loss is not None else None
    return mode if isinstance(mode, str) else "vanilla"


def _policy_loss() -> Any:
    """verl's ``ppo_loss`` (imported here: this module is importable without verl)."""
    from verl.workers.utils.losses import ppo_loss

    return ppo_loss
