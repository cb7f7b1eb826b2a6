"""The update step: log-probs, advantages, and the mini-/micro-batch optimisation loop.

Every rank runs the same loop over its shard of each mini-batch. The loss of a
micro-batch is scaled by the mini-batch's *global* token/sequence counts (one small
all_reduce per mini-batch, ``rl.global_counts``) times the world size; gradients are
summed over micro-batches, then all-reduced (sum, then divide by D, as DDP does), so
each optimizer step follows the gradient of the whole mini-batch however it was split.
Metrics go into the step's Tracker with their meaning, never with that scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rlmetrics import rl
from rlmetrics.tracker import Tracker
from rlmetrics.trainer import extras
from rlmetrics.trainer.config import AlgoConfig, MetricsConfig
from rlmetrics.trainer.extras import SourceCounts
from rlmetrics.trainer.model import TinyGPT, token_log_probs
from rlmetrics.trainer.rollout import Sequences, response_mask, select

LossFn = Callable[
    [Sequences, rl.BatchCounts, SourceCounts | None], tuple[Tensor, list[rl.MetricUpdate]]
]
"""(micro-batch, the mini-batch's global counts, per data source or None) -> (loss, updates)."""


@dataclass
class Learner:
    """A model with its AdamW optimizer and warmup-cosine schedule."""

    name: str  # metric prefix: "actor" or "critic"
    model: TinyGPT
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR


def warmup_cosine(warmup: int, total: int, floor: float) -> Callable[[int], float]:
    """lr multiplier of step s: linear warmup to 1, then cosine down to ``floor``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_learner(name: str, model: TinyGPT, lr: float, cfg: AlgoConfig, steps: int) -> Learner:
    """AdamW + schedule over ``steps`` training steps; gradients start as zeros."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # a rank with no rows still joins the all-reduce
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
    lr_lambda = warmup_cosine(cfg.warmup_steps, steps, cfg.min_lr_ratio)
    return Learner(name, model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda))


# -- partition ------------------------------------------------------------------------
def micro_batches(rows: Tensor, num_tokens: Tensor, cfg: AlgoConfig) -> list[Tensor]:
    """``rows`` cut into micro-batches: by size, by a token budget (greedy, in order; a
    sequence over the budget goes alone), or all in one."""
    if cfg.micro_batch_size is not None:
        return list(rows.split(cfg.micro_batch_size))
    if cfg.max_tokens_per_micro_batch is None:
        return [rows] if len(rows) else []
    out: list[list[int]] = []
    used = cfg.max_tokens_per_micro_batch + 1
    for row, size in zip(rows.tolist(), num_tokens[rows].tolist(), strict=True):
        if used + size > cfg.max_tokens_per_micro_batch:
            out.append([])
            used = 0
        out[-1].append(row)
        used += size
    return [torch.tensor(mb, dtype=torch.long) for mb in out]


def piece(shard: Sequences, rows: Tensor, device: torch.device) -> Sequences:
    """Rows of the shard, trimmed to their longest sequence, with their response mask."""
    mb = select(shard, rows)
    width = int((mb["prompt_lengths"] + mb["response_lengths"]).max())
    mb = {k: v[:, :width] if k == "tokens" else v for k, v in mb.items()}
    mb = {k: v[:, : width - 1] if v.dim() == 2 and k != "tokens" else v for k, v in mb.items()}
    mb["mask"] = response_mask(mb)
    return {k: v.to(device) for k, v in mb.items()}


# -- forward passes -----------------------------------------------------------------
def policy_logits(actor: TinyGPT, mb: Sequences, temperature: float) -> Tensor:
    """Logits (B, T-1, V) predicting ``tokens[:, 1:]``, divided by the temperature."""
    return actor(mb["tokens"][:, :-1]) / temperature


@torch.no_grad()
def infer(
    fn: Callable[[Sequences], Tensor],
    shard: Sequences,
    minis: list[Tensor],
    cfg: AlgoConfig,
    device: Any,
) -> Tensor:
    """``fn`` over the shard, as (B, T-1, ...) float64 on the CPU.

    Runs on exactly the micro-batches the first epoch trains on, so the first epoch's
    ratio is exactly 1 and its clipped values are exactly the old ones (no ties that
    rounding could break one way or the other).
    """
    width = shard["tokens"].size(1) - 1
    out: Tensor | None = None
    num_tokens = shard["prompt_lengths"] + shard["response_lengths"]
    for rows in minis:
        for mb_rows in micro_batches(rows, num_tokens, cfg):
            values = fn(piece(shard, mb_rows, device)).double().cpu()
            if out is None:
                out = values.new_zeros(len(shard["tokens"]), width, *values.shape[2:])
            out[mb_rows, : values.size(1)] = values
    return torch.zeros(len(shard["tokens"]), width, dtype=torch.float64) if out is None else out


def sampled_log_probs(model: TinyGPT, cfg: AlgoConfig) -> Callable[[Sequences], Tensor]:
    """mb -> log-probs of the sampled tokens under ``model``."""
    return lambda mb: token_log_probs(
        policy_logits(model, mb, cfg.temperature), mb["tokens"][:, 1:]
    )


def log_probs_and_entropy(model: TinyGPT, cfg: AlgoConfig) -> Callable[[Sequences], Tensor]:
    """mb -> (B, T, 2): log-probs of the sampled tokens and the policy's entropy."""

    def fn(mb: Sequences) -> Tensor:
        logits = policy_logits(model, mb, cfg.temperature)
        logp = token_log_probs(logits, mb["tokens"][:, 1:])
        return torch.stack((logp, rl.entropy_from_logits(logits)), dim=-1)

    return fn


# -- advantages -----------------------------------------------------------------------
def global_whiten(x: Tensor, mask: Tensor, world_size: int, group: Any, device: Any) -> Tensor:
    """(x - mean) / std over every rank's valid tokens (two small all_reduces on device)."""

    def total(values: list[Tensor]) -> Tensor:
        t = torch.stack(values).double().to(device)
        if world_size > 1:
            dist.all_reduce(t, group=group)
        return t.cpu()

    n, s = total([mask.sum(), torch.where(mask, x, 0.0).sum()])
    dev = torch.where(mask, x - s / n.clamp_min(1), 0.0)
    (sq,) = total([dev.square().sum()])
    return torch.where(mask, dev * torch.rsqrt(sq / (n - 1).clamp_min(1) + 1e-8), 0.0)


def ppo_advantages(
    shard: Sequences, cfg: AlgoConfig, world_size: int, group: Any, device: Any
) -> None:
    """GAE on each sequence (the score as the last token's reward), whitened globally."""
    mask = response_mask(shard)
    last = (shard["prompt_lengths"] + shard["response_lengths"] - 2).clamp_min(0)
    rewards = torch.zeros_like(shard["values"])
    has_response = shard["response_lengths"] > 0
    rows = torch.arange(len(rewards))[has_response]
    rewards[rows, last[has_response]] = shard["scores"][has_response]
    adv, returns = rl.gae(rewards, shard["values"], mask, gamma=cfg.gamma, lam=cfg.lam)
    shard["advantages"] = global_whiten(adv, mask, world_size, group, device)
    shard["returns"] = returns


# -- losses ---------------------------------------------------------------------------
def named(updates: list[rl.MetricUpdate], name: str) -> rl.MetricUpdate:
    """The update called ``name``."""
    return next(u for u in updates if u.name == name)


def actor_objective(
    logp: Tensor,
    entropy: Tensor,
    mb: Sequences,
    mask: Tensor,
    counts: rl.BatchCounts,
    cfg: AlgoConfig,
) -> tuple[Tensor, list[rl.MetricUpdate]]:
    """The policy objective over the tokens of ``mask``: clipped PPO/GRPO + KL - entropy
    bonus, and its metric updates (``counts``: the global counts ``mask`` stands for)."""
    common: dict[str, Any] = {"counts": counts, "agg": cfg.loss_agg}
    pg = rl.ppo_policy_loss(
        logp,
        mb["old_log_probs"],
        mb["advantages"],
        mask,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        clip_ratio_c=cfg.clip_ratio_c,
        **common,
    )
    ent = rl.entropy_loss(entropy, mask, **common)
    loss, updates = pg.loss - cfg.entropy_coef * ent.loss, pg.updates + ent.updates
    terms = [
        (1.0, named(pg.updates, "actor/pg_loss")),
        (-cfg.entropy_coef, named(ent.updates, "actor/entropy_loss")),
    ]
    if cfg.kl_coef:
        kl = rl.kl_loss(logp, mb["ref_log_probs"], mask, estimator=cfg.kl_type, **common)
        loss, updates = loss + cfg.kl_coef * kl.loss, updates + kl.updates
        terms.append((cfg.kl_coef, named(kl.updates, "actor/kl_loss")))
    return loss, [*updates, rl.loss_update("actor/loss", terms)]


def actor_loss(actor: TinyGPT, cfg: AlgoConfig, extra: MetricsConfig | None = None) -> LossFn:
    """The policy objective of a micro-batch: clipped PPO/GRPO + KL - entropy bonus.

    Given per-source counts (``optimize(..., per_source=True)``), the same objective
    again over each data source's rows (no gradient, the same forward pass), as
    ``<key>/<source>``; with ``extra.token_quantiles``, the sketches of the tokens'
    entropy, ratio and KL; with ``extra.naive``, the micro-batch's own clip fraction and
    KL (``extras.naive_means``).
    """
    extra = extra or MetricsConfig()

    def loss_fn(
        mb: Sequences, counts: rl.BatchCounts, sources: SourceCounts | None
    ) -> tuple[Tensor, list[rl.MetricUpdate]]:
        logits = policy_logits(actor, mb, cfg.temperature)
        logp = token_log_probs(logits, mb["tokens"][:, 1:])
        mask = mb["mask"]
        entropy = rl.entropy_from_logits(logits if cfg.entropy_coef else logits.detach())
        loss, updates = actor_objective(logp, entropy, mb, mask, counts, cfg)
        if sources is not None:
            with torch.no_grad():
                updates += extras.per_source(
                    sources,
                    mb,
                    mask,
                    lambda part, c: actor_objective(logp, entropy, mb, part, c, cfg)[1],
                )
        if extra.token_quantiles:
            ref = mb["ref_log_probs"] if cfg.kl_coef else None
            updates += extras.token_quantiles(
                logp, mb["old_log_probs"], entropy, mask, ref, cfg.kl_type
            )
        if extra.naive:
            updates += extras.naive_means(updates)
        return loss, updates

    return loss_fn


def critic_objective(
    values: Tensor, mb: Sequences, mask: Tensor, counts: rl.BatchCounts, cfg: AlgoConfig
) -> tuple[Tensor, list[rl.MetricUpdate]]:
    """The clipped value loss over the tokens of ``mask``, and its metric updates."""
    out = rl.value_loss(
        values,
        mb["values"],
        mb["returns"],
        mask,
        counts=counts,
        cliprange_value=cfg.vf_clip,
        agg=cfg.loss_agg,
    )
    vf = named(out.updates, "critic/vf_loss")  # critic/loss: verl's name for it too
    return out.loss, [*out.updates, rl.MetricUpdate("critic/loss", "mean", vf.value, vf.weight)]


def critic_loss(critic: TinyGPT, cfg: AlgoConfig) -> LossFn:
    """The clipped value loss of a micro-batch (and per data source, when asked)."""

    def loss_fn(
        mb: Sequences, counts: rl.BatchCounts, sources: SourceCounts | None
    ) -> tuple[Tensor, list[rl.MetricUpdate]]:
        values = critic(mb["tokens"][:, :-1])
        loss, updates = critic_objective(values, mb, mb["mask"], counts, cfg)
        if sources is not None:
            with torch.no_grad():
                updates += extras.per_source(
                    sources,
                    mb,
                    mb["mask"],
                    lambda part, c: critic_objective(values, mb, part, c, cfg)[1],
                )
        return loss, updates

    return loss_fn


# -- the optimisation loop ------------------------------------------------------------
def all_reduce_grads(params: Sequence[Tensor], world_size: int, group: Any) -> None:
    """Average gradients over ranks: one packed all_reduce(SUM), then divide by D."""
    if world_size == 1:
        return
    flat = torch.cat([_grad(p).reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    flat /= world_size
    offset = 0
    for p in params:
        _grad(p).copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def _grad(param: Tensor) -> Tensor:
    """``param``'s gradient, which the backward pass gave every parameter."""
    if param.grad is None:
        raise RuntimeError("all_reduce_grads: a parameter has no gradient (no backward pass?)")
    return param.grad


def optimizer_step(
    learner: Learner, cfg: AlgoConfig, tracker: Tracker, world_size: int, group: Any
) -> None:
    """Reduce gradients, clip, log the norm, step, zero the gradients."""
    params = list(learner.model.parameters())
    all_reduce_grads(params, world_size, group)
    norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
    rl.log_updates(tracker, rl.grad_norm_updates(norm, f"{learner.name}/grad_norm"))
    learner.opt.step()
    learner.opt.zero_grad(set_to_none=False)


def optimize(
    learner: Learner,
    loss_fn: LossFn,
    shard: Sequences,
    minis: list[Tensor],
    cfg: AlgoConfig,
    tracker: Tracker,
    *,
    world_size: int,
    group: Any = None,
    per_source: bool = False,
) -> None:
    """Epochs x mini-batches of optimizer steps over this rank's shard.

    Args:
        minis: the shard's rows of each mini-batch (positions in ``shard``; may be empty).
        per_source: count each data source's tokens too, in the same all_reduce as the
            mini-batch's counts, and hand them to ``loss_fn``.
    """
    device = next(learner.model.parameters()).device
    num_tokens = shard["prompt_lengths"] + shard["response_lengths"]
    mask = response_mask(shard)
    sources = None
    for _ in range(cfg.epochs):
        for rows in minis:
            if per_source:
                counts, sources = extras.global_source_counts(
                    mask[rows].to(device), shard["source"][rows], group
                )
            else:
                counts = rl.global_counts(mask[rows].to(device), group)
            for mb_rows in micro_batches(rows, num_tokens, cfg):
                present = None if sources is None else sources.present_in(shard["source"][mb_rows])
                loss, updates = loss_fn(piece(shard, mb_rows, device), counts, present)
                loss.backward()
                rl.log_updates(tracker, updates)
            optimizer_step(learner, cfg, tracker, world_size, group)
    # the lr these updates used: read before the scheduler moves on to the next step's
    rl.log_updates(tracker, [rl.lr_update(learner.opt, f"{learner.name}/lr")])
    learner.sched.step()
    if device.type == "cuda":  # so that the caller's stage timer sees the finished work
        torch.cuda.synchronize(device)
