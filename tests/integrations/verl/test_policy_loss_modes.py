"""Every policy-loss mode verl 0.9.1 registers, through verl's own ``ppo_loss``, split many ways.

For each mode (``actor.policy_loss.loss_mode``) one batch of 8 sequences goes through
verl's ``ppo_loss`` as verl's FSDP engine feeds it: the rows dealt to ranks as verl's
dispatch deals them, each rank's share cut into mini-batches and then micro-batches
by verl's ``prepare_micro_batches`` (fixed sizes or a token budget), with the global
counts the engine sets (``dp_size``, ``batch_num_tokens``, ``global_batch_size``).
The model is replaced by fixed per-token log-probs and entropies (``model_output``),
so every split sees the same numbers and only the split changes; ranks are simulated
in this one process (their trackers merge as a gloo group's ``compute()`` merges them,
tested elsewhere). The same micro-batch metrics then go two ways:

* rlmetrics: ``RecordingLoss`` logs them into one Tracker per rank, merged;
* verl alone: verl's own ``append_to_dict``, ``Metric.aggregate_dp`` and the driver's
  ``reduce_metrics``, as ``TrainingWorker.train_mini_batch`` and the trainer apply them.

Each metric a mode emits is either equal, on every split, to numpy over the whole batch
(``verl_loss_modes``), or one of those the mode decides per micro-batch by design
(``PER_MICRO_BATCH``: checked as the token-weighted mean of what was applied), or
listed in ``VERL_OWN`` (left to verl, as docs/verl.md says). verl's own values drift.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import os
from functools import partial
from typing import Any

import pytest
import torch
from scenarios import BATCH, make_batch, trainer_config

import verl_loss_modes
from rlmetrics import Tracker
from verl_formulas import agg_loss, kl_penalty

MODES = (
    "vanilla",
    "dppo_tv",
    "dppo_kl",
    "gspo",
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "dro",
    "cispo",
    "bypass_mode",
)
"""verl 0.9.1's ``POLICY_LOSS_REGISTRY`` (checked against the installed verl)."""

RS = {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.6_1.6"}
"""``bypass_mode`` with rejection sampling: tokens whose ratio leaves [0.6, 1.6] are
dropped from the loss."""

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    **{mode: (mode, {}) for mode in MODES},
    "gspo": ("gspo", {"loss_agg_mode": "seq-mean-token-mean"}),  # GSPO's recommended mode
    "dro": ("dro", {"dro_beta": 0.5}),  # verl requires a beta > 0
    "bypass_mode/reinforce": ("bypass_mode", {"loss_type": "reinforce"}),
    "bypass_mode/rs": ("bypass_mode", RS),
}
"""Each registered mode with verl's defaults, and the settings that change which
metrics a mode reports (name: (loss_mode, overrides))."""

SPLITS: dict[str, dict[str, Any]] = {
    "whole": {"ranks": 1, "micro_batch_size_per_gpu": BATCH},
    "micro1": {"ranks": 1, "micro_batch_size_per_gpu": 1},
    "dynamic16": {"ranks": 1, "max_token_len_per_gpu": 16},
    "2ranks_micro2": {"ranks": 2, "micro_batch_size_per_gpu": 2},
    "2ranks_dynamic24": {"ranks": 2, "max_token_len_per_gpu": 24},
    "2ranks_2minibatches": {"ranks": 2, "micro_batch_size_per_gpu": 1, "mini_batches": 2},
}
"""Ranks, micro-batches (fixed size, or a token budget) and mini-batches per split."""

PER_MICRO_BATCH = {
    "clip_cov": ("actor/pg_clipfrac", "actor/pg_loss"),
    "kl_cov": ("actor/pg_loss",),
}
"""Metrics of a loss that picks its tokens per micro-batch (clip_cov: a share of the
micro-batch's tokens by covariance with the micro-batch's own means, at random; kl_cov:
the micro-batch's top tokens): what the step applied depends on the split by design."""

VERL_OWN = {"bypass_mode/rs": "rollout_corr/rollout_rs_token_k1_"}
"""Metrics left to verl, by prefix (docs/verl.md says why): the statistics of each
rejection-sampling option (here ``token_k1``: 15 of them)."""

CONSTANTS = ("kl_coef",)
"""Configuration values verl logs each micro-batch (the same on every split)."""

TOLERANCE = 1e-6  # float32 inputs, float64 reference
DRIFT = 1e-3


def _inputs(seed: int = 3) -> dict[str, torch.Tensor]:
    """The batch (``scenarios.make_batch``'s rows, masks and advantages) with old and
    current log-probs of probabilities between 0.02 and 0.9 (so the probability-based
    modes clip too) and per-token entropies: what the model's forward would give."""
    batch = make_batch()
    gen = torch.Generator().manual_seed(seed)
    shape = batch["response_mask"].shape
    old = torch.log(0.02 + 0.88 * torch.rand(shape, generator=gen))
    batch["old_log_probs"] = old
    batch["current_log_probs"] = (old + 0.5 * torch.randn(shape, generator=gen)).clamp(max=-1e-3)
    batch["current_entropy"] = 4.0 * torch.rand(shape, generator=gen)
    return batch


@functools.cache
def _trainer_config() -> Any:
    """The suite's CPU trainer config (``scenarios.trainer_config``), loaded once."""
    return trainer_config("unused")


@functools.cache
def _actor_config(variant: str) -> Any:
    """verl's ``ActorConfig`` of the variant's mode; for ``bypass_mode``, the
    algorithm's ``rollout_correction`` (with the variant's overrides) copied into the
    policy loss's, as verl's driver does (``apply_bypass_mode``)."""
    from omegaconf import OmegaConf, open_dict
    from verl.utils.config import omega_conf_to_dataclass

    mode, overrides = VARIANTS[variant]
    config = copy.deepcopy(_trainer_config())
    actor = config.actor_rollout_ref.actor
    overrides = dict(overrides)
    with open_dict(config):
        actor.policy_loss.loss_mode = mode
        actor.loss_agg_mode = overrides.pop("loss_agg_mode", actor.loss_agg_mode)
        actor.policy_loss.dro_beta = overrides.pop("dro_beta", actor.policy_loss.dro_beta)
        if mode == "bypass_mode":
            correction = OmegaConf.to_container(config.algorithm.rollout_correction)
            actor.policy_loss.rollout_correction = {**correction, **overrides}
    return omega_conf_to_dataclass(actor)


def _model_output(micro: Any) -> dict[str, torch.Tensor]:
    """What verl's forward gives ``ppo_loss``: per-token log-probs and entropies of the
    whole sequences (no padding, jagged), shifted by one as the engine's are, so verl's
    ``no_padding_2_padding`` reads the response's values back."""
    offsets = micro["input_ids"].offsets()
    prompt_len = micro["prompts"].shape[1]
    prompt_lens = micro["attention_mask"][:, :prompt_len].sum(-1)
    response_lens = micro["attention_mask"][:, prompt_len:].sum(-1)
    out = {}
    for key, field in (("log_probs", "current_log_probs"), ("entropy", "current_entropy")):
        values = torch.zeros(int(offsets[-1]))
        for row, start in enumerate(offsets[:-1].tolist()):
            first = start + int(prompt_lens[row]) - 1
            values[first : first + int(response_lens[row])] = micro[field][
                row, : int(response_lens[row])
            ]
        out[key] = torch.nested.nested_tensor_from_jagged(values, offsets)
    return out


def _rank_mini_batches(batch: Any, split: dict[str, Any]) -> list[list[Any]]:
    """[mini-batch][rank] -> that rank's rows: verl's dispatch gives each rank a
    contiguous share, and the worker cuts its share into mini-batches in order."""
    ranks, minis = split["ranks"], split.get("mini_batches", 1)
    share = BATCH // ranks
    size = share // minis
    return [
        [batch[r * share + k * size : r * share + (k + 1) * size] for r in range(ranks)]
        for k in range(minis)
    ]


def _micro_batches(parts: list[Any], split: dict[str, Any]) -> list[list[Any]]:
    """Each rank's micro-batches of one mini-batch, as verl's engine makes them:
    ``left_right_2_no_padding``, the global counts, ``prepare_micro_batches`` (the same
    number of micro-batches on every rank, as the engine's all-reduce makes it)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches
    from verl.workers.utils.padding import left_right_2_no_padding

    tokens = int(sum(part["response_mask"].sum() for part in parts))
    dynamic = "max_token_len_per_gpu" in split
    datas = []
    for part in parts:
        data = left_right_2_no_padding(part.clone())
        tu.assign_non_tensor(
            data,
            use_dynamic_bsz=dynamic,
            global_batch_size=part.batch_size[0] * len(parts),
            batch_num_tokens=tokens,
            dp_size=len(parts),
        )
        if dynamic:
            tu.assign_non_tensor(data, max_token_len_per_gpu=split["max_token_len_per_gpu"])
        else:
            size = min(split["micro_batch_size_per_gpu"], part.batch_size[0])
            tu.assign_non_tensor(data, micro_batch_size_per_gpu=size)
        datas.append(data)
    counts = [len(prepare_micro_batches(d, dp_group=None)[0]) for d in datas]
    return [
        prepare_micro_batches(d, dp_group=None, min_num_micro_batch=max(counts))[0] for d in datas
    ]


def run_split(variant: str, split_name: str) -> dict[str, Any]:
    """One variant on one split: rlmetrics' merged values, verl's logged values, and
    per micro-batch verl's values with its response tokens and its ``agg_loss`` scale
    (``batch_num_tokens / dp_size``)."""
    from verl.utils.metric import Metric, reduce_metrics
    from verl.utils.py_functional import append_to_dict
    from verl.workers.utils.losses import ppo_loss

    from rlmetrics.integrations.verl.losses import RecordingLoss, response_counts

    split = SPLITS[split_name]
    loss_fn = partial(ppo_loss, config=_actor_config(variant))
    trackers = [Tracker() for _ in range(split["ranks"])]
    logged: dict[str, Any] = {}
    micro_values: list[tuple[dict[str, Any], float, float]] = []
    torch.manual_seed(0)  # clip_cov picks among its candidates at random
    for parts in _rank_mini_batches(_inputs(), split):
        gathered: dict[str, list] = {}  # allgather_dict_into_dict over the ranks
        for tracker, micro_batches in zip(trackers, _micro_batches(parts, split), strict=True):
            recording = RecordingLoss(loss_fn, tracker)
            per_rank: dict[str, Any] = {}  # postprocess_batch_func's append_to_dict
            for micro in micro_batches:
                _, metrics = recording(_model_output(micro), micro)
                append_to_dict(per_rank, metrics)
                tokens = float(response_counts(micro)[0])
                scale = micro["batch_num_tokens"] / micro["dp_size"]  # agg_loss's token-mean
                micro_values.append(({k: _float(v) for k, v in metrics.items()}, tokens, scale))
            for key, value in per_rank.items():
                gathered.setdefault(key, []).append(value)
        output = {  # TrainingWorker.train_mini_batch
            key: Metric.aggregate_dp(val)
            if isinstance(val[0], Metric)
            else list(itertools.chain.from_iterable(val))
            for key, val in gathered.items()
        }
        append_to_dict(logged, output)
    merged = trackers[0]
    for tracker in trackers[1:]:
        merged.merge(tracker.state())
    return {
        "exact": merged.compute(),
        "verl": {k: float(v) for k, v in reduce_metrics(logged).items()},
        "micro": micro_values,
    }


def _float(value: Any) -> float:
    """A micro-batch's metric (a ``Metric`` of one value, or a float) as a float."""
    values = getattr(value, "values", None)
    return float(values[0] if isinstance(values, list) else value)


def whole_batch(variant: str) -> dict[str, float]:
    """numpy over the whole batch: the mode's metrics (``verl_loss_modes``) and the
    entropy and KL losses (``verl_formulas``), in the variant's aggregation mode."""
    mode, overrides = VARIANTS[variant]
    config = _actor_config(variant)
    b = {k: v.double().numpy() for k, v in _inputs().items() if k != "responses"}
    m = b["response_mask"].astype(bool)
    old, logp, adv = b["old_log_probs"], b["current_log_probs"], b["advantages"]
    cfg = {
        "low": config.clip_ratio_low,
        "high": config.clip_ratio_high,
        "c": config.clip_ratio_c,
        "mode": config.loss_agg_mode,
        "tau_pos": config.tau_pos,
        "tau_neg": config.tau_neg,
        "dro_beta": config.policy_loss.dro_beta,
        **overrides,
    }
    if variant == "bypass_mode/rs":  # the loss sees the kept tokens, normalised by all
        kept = m & ~verl_loss_modes.rejected_by_token_k1(old, logp, m, 0.6, 1.6)
        out = verl_loss_modes.vanilla(old, logp, adv, kept, cfg)
        out["actor/pg_loss"] *= kept.sum() / m.sum()
        out |= verl_loss_modes.off_policy(logp, old, m)
        out["rollout_corr/rollout_rs_masked_fraction"] = (m & ~kept).sum() / m.sum()
        out["rollout_corr/rollout_rs_seq_masked_fraction"] = (m & ~kept).any(-1).mean()
    else:
        out = verl_loss_modes.WHOLE_BATCH[mode](old, logp, adv, m, cfg)
    out["actor/entropy_loss"] = agg_loss(b["current_entropy"], m, cfg["mode"], eps=1e-8)
    kl = kl_penalty(logp, b["ref_log_prob"], config.kl_loss_type)
    out["kl_loss"] = agg_loss(kl, m, cfg["mode"], eps=1e-8)
    return {k: float(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    """Every variant on every split (no model, one process); also written as JSON to
    $RLMETRICS_VERL_RESULTS_DIR when set, with numpy's values (what docs/verl.md quotes)."""
    out = {variant: {name: run_split(variant, name) for name in SPLITS} for variant in VARIANTS}
    folder = os.environ.get("RLMETRICS_VERL_RESULTS_DIR")
    if folder:
        dump = {v: {"numpy": whole_batch(v), "splits": out[v]} for v in VARIANTS}
        with open(os.path.join(folder, "policy_loss_modes.json"), "w") as f:
            json.dump(dump, f, indent=1, sort_keys=True)
    return out


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= TOLERANCE * max(1.0, abs(want))


def test_the_modes_are_the_installed_verls() -> None:
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    assert tuple(POLICY_LOSS_REGISTRY) == MODES


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_metric_is_the_whole_batchs_or_listed(runs: dict, variant: str) -> None:
    """On every split, every metric the mode emits is numpy's whole-batch value, one of
    the mode's per-micro-batch choices, or listed as verl's own; nothing else."""
    truth = whole_batch(variant)
    mode = VARIANTS[variant][0]
    per_micro = set(PER_MICRO_BATCH.get(mode, ()))
    for split, run in runs[variant].items():
        emitted = {key for metrics, _, _ in run["micro"] for key in metrics}
        prefix = VERL_OWN.get(variant)
        own = {k for k in emitted if prefix and k.startswith(prefix)} | set(CONSTANTS)
        assert set(run["exact"]) == emitted - own, (split, sorted(emitted ^ set(run["exact"])))
        assert set(truth) == emitted - own - per_micro, (split, sorted(emitted ^ set(truth)))
        far = {
            key: (run["exact"][key], want)
            for key, want in truth.items()
            if not _close(run["exact"][key], want)
        }
        assert not far, (split, far)


@pytest.mark.parametrize("mode", PER_MICRO_BATCH)
def test_a_per_micro_batch_choice_is_reported_as_applied(runs: dict, mode: str) -> None:
    """clip_cov's clip fraction and loss, kl_cov's loss: on every split, the step's
    token mean of what each micro-batch applied (from verl's per-micro-batch values:
    a token mean weighs by the micro-batch's tokens; a ``pg_loss`` is the micro-batch's
    loss sum over ``batch_num_tokens / dp_size``). What the step applies itself moves
    with the split (the mode, not the logging)."""
    for split, run in runs[mode].items():
        tokens = sum(count for _, count, _ in run["micro"])
        for key in PER_MICRO_BATCH[mode]:
            weight = 1 if key == "actor/pg_loss" else 0  # scale or tokens
            applied = sum(m[key] * (s if weight else n) for m, n, s in run["micro"]) / tokens
            assert _close(run["exact"][key], applied), (split, key, run["exact"][key], applied)
    key = PER_MICRO_BATCH[mode][0]
    values = [run["exact"][key] for run in runs[mode].values()]
    assert max(values) - min(values) > DRIFT, (mode, key, values)


@pytest.mark.parametrize("variant", VARIANTS)
def test_without_rlmetrics_verls_values_drift(runs: dict, variant: str) -> None:
    """verl's own logged values of the same micro-batches move with the split (its
    mean of micro-batch means, its mean over mini-batches): the test above can fail."""
    truth = whole_batch(variant)
    drift = {
        key: max(abs(run["verl"][key] - want) for run in runs[variant].values())
        for key, want in truth.items()
    }
    assert max(drift.values()) > DRIFT, drift
