"""The opt-in extras of the verl integration: per data source, token quantiles, timing.

One switch, the environment variable ``RLMETRICS_VERL_DETAIL`` (``1`` on; unset, empty
or ``0`` off), read by every worker at each update, so it is set where the workers
start (exported before Ray starts, or in Ray's ``runtime_env``; see docs/verl.md).
With it off the integration logs exactly what it logs without this module. With it on,
``ExactTrainingWorker`` and ``RecordingLoss`` also log, into the same step tracker and
so the same packed collective:

* **per data source** (when the batch carries ``data_source``, as verl's RL datasets
  do): every loss metric the integration makes exact, again for each source's rows
  alone, as ``<key>/<source>``. Each source's value is verl's own loss function
  evaluated on the micro-batch with the response mask restricted to that source's rows
  (the same forward pass, no gradient), weighted as the whole micro-batch's value is;
* **token quantiles** (actor): the sketch (``quantile`` kind) of every response token's
  entropy, importance ratio and, with ``use_kl_loss``, KL penalty;
* **timing**: each rank's time in the engine's ``train_batch`` calls of the step, as a
  ``rank_time`` metric (the slowest rank's time and which rank), and the step's MFU
  from the global token count over that slowest time.

Every rank names every known source's metrics at every update, with or without a row
of that source (``declare_sources``; a source no rank held this update is left out of
the result), so the set of names, and with it the collectives, is the same from update
to update. The known sources are those of ``RLMETRICS_VERL_SOURCES`` (comma-separated,
read at each update like the switch) and those earlier updates reported: without the
variable, the first update where a source appears, after the first update, costs one
schema agreement (two small gathers and the reduce again), once per source.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from rlmetrics.integrations._labels import declare
from rlmetrics.tracker import Tracker

SWITCH = "RLMETRICS_VERL_DETAIL"
"""The environment variable that turns the extras on (``1``) in a verl process."""

SOURCES_VARIABLE = "RLMETRICS_VERL_SOURCES"
"""The environment variable naming every data source of the run (``gsm8k,math``)."""

SOURCE_KEY = "data_source"
"""The batch field holding each sequence's data source (verl's RL datasets' name)."""

LOG_RATIO_CLAMP = 20.0
"""verl clamps log(ratio) to ±20 before exponentiating (``compute_policy_loss_vanilla``)."""

UPDATE_TIME = "update_time_s"
"""The rank-time metric of an update, under the role: ``actor/update_time_s``."""

TOKEN_QUANTILES = {
    "entropy": "actor/token_entropy",
    "ratio": "actor/importance_ratio",
    "kl": "actor/token_kl",
}
"""Names of the per-token distributions the actor reports (keys: ``name/p50`` ...)."""


def enabled() -> bool:
    """Whether ``RLMETRICS_VERL_DETAIL`` turns the extras on in this process."""
    return os.environ.get(SWITCH, "").strip().lower() not in ("", "0", "false", "no", "off")


def configured_sources() -> set[str]:
    """The sources ``RLMETRICS_VERL_SOURCES`` names in this process (comma-separated)."""
    return {part.strip() for part in os.environ.get(SOURCES_VARIABLE, "").split(",")} - {""}


def declare_sources(tracker: Tracker, names: Iterable[str], sources: Iterable[str]) -> None:
    """Name ``<name>/<source>`` (a ``mean``, as ``log_micro_batch`` logs them) for every
    name and source, with no element: every rank's update then has the same names,
    whichever sources its rows hold (``rlmetrics.integrations._labels``)."""
    declare(tracker, [(name, "mean") for name in names], sorted(sources))


def reported_sources(results: Mapping[str, float], names: Iterable[str]) -> set[str]:
    """The sources whose ``<name>/<source>`` keys ``results`` holds (the same on every
    rank: a merged update's keys)."""
    prefixes = [name + "/" for name in names]
    return {key[len(prefix) :] for key in results for prefix in prefixes if key.startswith(prefix)}


def row_sources(data: Any) -> np.ndarray | None:
    """Each row's data source as text (a host array), or None when the batch has none."""
    if SOURCE_KEY not in data.keys():  # noqa: SIM118 (a TensorDict refuses `in`)
        return None
    value = data[SOURCE_KEY]
    labels = value.tolist() if hasattr(value, "tolist") else list(value)
    return np.asarray([str(label) for label in labels], dtype=object)


def restrict_to_rows(data: Any, keep: torch.Tensor) -> Any:
    """A shallow copy of the micro-batch ``data`` whose ``response_mask`` keeps only the
    rows where ``keep`` (a (B,) bool tensor) is True; everything else is shared."""
    mask = data["response_mask"]
    if mask.is_nested:
        offsets = mask.offsets()
        lengths = offsets.diff()
        rows = torch.repeat_interleave(torch.arange(len(lengths), device=offsets.device), lengths)
        values = mask.values() * keep.to(mask.device)[rows.to(mask.device)].to(mask.dtype)
        # the row lengths' bounds, as the mask has them: without them TensorDict's
        # to_padded_tensor (verl's value_loss) pads to the total length of all rows
        restricted = torch.nested.nested_tensor_from_jagged(
            values, offsets, min_seqlen=int(lengths.min()), max_seqlen=int(lengths.max())
        )
    else:
        restricted = mask * keep.to(mask.device)[:, None].to(mask.dtype)
    part = data.copy()
    part["response_mask"] = restricted
    return part


def log_per_source(
    tracker: Tracker,
    loss_fn: Callable[..., Any],
    log: Callable[..., None],
    model_output: Any,
    data: Any,
    dp_group: Any,
    metrics: Mapping[str, Any] | None = None,
) -> None:
    """Log the micro-batch's loss metrics once per data source, as ``<key>/<source>``.

    ``metrics``, the loss function's metrics for the whole micro-batch, are logged as
    they are when the micro-batch holds one source (no second evaluation).

    ``log(tracker, metrics, data, suffix=..., rows=...)`` is the integration's own
    ``log_micro_batch`` with a name suffix and the source's row count: each source's
    value carries the weight it stands for, as the whole micro-batch's does.
    """
    sources = row_sources(data)
    if sources is None:
        return
    present = sorted(set(sources.tolist()))
    if len(present) == 1 and metrics is not None:  # one source: the micro-batch's own values
        log(tracker, metrics, data, suffix=f"/{present[0]}")
        return
    for source in present:
        keep = torch.as_tensor(sources == source)
        part = restrict_to_rows(data, keep)
        with torch.no_grad():
            _, metrics = loss_fn(model_output=model_output, data=part, dp_group=dp_group)
        log(tracker, metrics, part, suffix=f"/{source}", rows=int(keep.sum()))


def log_token_quantiles(
    tracker: Tracker, model_output: Mapping[str, Any], data: Any, config: Any
) -> None:
    """Sketch every response token's entropy, importance ratio and (with ``use_kl_loss``)
    KL penalty, as verl's ``ppo_loss`` computes them from the same forward pass."""
    from verl.trainer.ppo.core_algos import kl_penalty
    from verl.workers.utils.padding import no_padding_2_padding

    fields = ["response_mask", "old_log_probs"]
    use_kl = bool(getattr(config, "use_kl_loss", False)) and "ref_log_prob" in data.keys()  # noqa: SIM118
    if use_kl:
        fields.append("ref_log_prob")
    padded = data.select(*fields).to_padded_tensor()
    mask = padded["response_mask"].to(torch.bool)
    with torch.no_grad():
        log_prob = no_padding_2_padding(model_output["log_probs"], data).detach()
        log_ratio = (log_prob - padded["old_log_probs"]).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        tracker.quantile(TOKEN_QUANTILES["ratio"], torch.exp(log_ratio), mask=mask)
        entropy = model_output.get("entropy", None)
        if entropy is not None:
            entropy = no_padding_2_padding(entropy, data).detach()
            tracker.quantile(TOKEN_QUANTILES["entropy"], entropy, mask=mask)
        if use_kl:
            kl = kl_penalty(log_prob, padded["ref_log_prob"], config.kl_loss_type)
            tracker.quantile(TOKEN_QUANTILES["kl"], kl.detach(), mask=mask)
