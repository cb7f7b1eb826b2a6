"""The per-rank training loop: rollout, log-probs, advantages, updates, one metrics sync.

``train(config, rank, world_size)`` is a plain function: the spawn launcher, torchrun
and a Ray actor all call it once per rank, after the process group is initialised.
Every rank computes ``tracker.compute(group)`` once per step and gets the same dict;
rank 0 writes it to the loggers.
"""

from __future__ import annotations

import itertools
import time
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch

from rlmetrics import rl
from rlmetrics.tracker import Tracker
from rlmetrics.trainer import checkpoint, extras, perf
from rlmetrics.trainer.config import TrainConfig
from rlmetrics.trainer.model import build_models
from rlmetrics.trainer.rank import Rank
from rlmetrics.trainer.report import Reporter
from rlmetrics.trainer.rollout import (
    Sequences,
    add_scores,
    response_mask,
    rollout,
    select,
    shard_indices,
)
from rlmetrics.trainer.task import SOURCES, Task
from rlmetrics.trainer.update import (
    Learner,
    actor_loss,
    build_learner,
    critic_loss,
    infer,
    log_probs_and_entropy,
    optimize,
    ppo_advantages,
    sampled_log_probs,
)


def setup(cfg: TrainConfig, rank: int, world_size: int, group: Any, device: Any) -> Rank:
    """Build the task, the models (identical on every rank) and their optimizers."""
    task = Task(cfg.task)
    is_ppo = cfg.algo.algo == "ppo"
    actor, ref, critic = build_models(
        cfg.model, task.vocab_size, task.block_size, critic=is_ppo, seed=cfg.run.seed
    )
    device = torch.device(device or "cpu")
    steps = cfg.run.steps
    actor_learner = build_learner("actor", actor.to(device), cfg.algo.lr, cfg.algo, steps)
    critic_learner = None
    if critic is not None:
        critic_learner = build_learner(
            "critic", critic.to(device), cfg.algo.critic_lr, cfg.algo, steps
        )
    return Rank(
        cfg, rank, world_size, group, device, task, actor_learner, ref.to(device), critic_learner
    )


def my_shard(r: Rank, batch: Sequences) -> tuple[Sequences, list[torch.Tensor]]:
    """This rank's rows of the batch, and its rows of each mini-batch (shard positions)."""
    rows = shard_indices(len(batch["tokens"]), r.cfg.algo.mini_batches, r.rank, r.world_size)
    shard = select(batch, torch.cat(rows))
    bounds = torch.tensor([0] + [len(x) for x in rows]).cumsum(0).tolist()
    return shard, [torch.arange(a, b) for a, b in itertools.pairwise(bounds)]


def num_tokens(batch: Sequences) -> float:
    """Prompt + response tokens of the (whole) batch: the per-token timings' divisor."""
    return float((batch["prompt_lengths"] + batch["response_lengths"]).sum())


def stage_timer(r: Rank, tracker: Tracker, stage: str, **options: Any) -> Any:
    """``timing_s/<stage>`` for this rank of the data-parallel group (rank-aware: the
    slowest rank's time, the mean, which rank; see rlmetrics.timing)."""
    return rl.timer(tracker, stage, rank=r.rank, world_size=r.world_size, **options)


def prepare(r: Rank, batch: Sequences, tracker: Tracker) -> tuple[Sequences, list[torch.Tensor]]:
    """Advantages, old and reference log-probs (and values) of this rank's shard; the
    entropy of the old policy (verl's ``actor/entropy``, aggregated like the loss)."""
    algo, tokens = r.cfg.algo, {"num_tokens": num_tokens(batch)}
    if algo.algo == "grpo":  # group statistics need the whole batch: every rank has it
        with stage_timer(r, tracker, "adv", **tokens):
            batch["advantages"] = rl.grpo_advantages(
                batch["scores"], batch["group"], response_mask(batch)
            )
            batch["returns"] = batch["advantages"]  # as verl's GRPO estimator returns
    shard, minis = my_shard(r, batch)
    with stage_timer(r, tracker, "old_log_prob", **tokens):
        start = time.perf_counter()
        both = infer(log_probs_and_entropy(r.actor.model, algo), shard, minis, algo, r.device)
        seconds = time.perf_counter() - start
    shard["old_log_probs"] = both[..., 0]
    mask = response_mask(shard)
    rl.log_updates(
        tracker,
        [
            rl.entropy_metric(both[..., 1], mask, algo.loss_agg),
            perf.mfu_update("actor_infer", learner_flops(r, r.actor, shard) / 3, seconds, r.device),
        ],
    )
    if r.cfg.metrics.per_source:  # actor/entropy/<source>: the same metric over its rows
        for s in sorted(set(shard["source"].tolist())):
            part = mask & (shard["source"] == s)[:, None]
            entropy = rl.entropy_metric(both[..., 1], part, algo.loss_agg)
            rl.log_updates(tracker, [replace(entropy, name=f"{entropy.name}/{SOURCES[s]}")])
    if algo.kl_coef:
        with stage_timer(r, tracker, "ref", **tokens):
            shard["ref_log_probs"] = infer(
                sampled_log_probs(r.ref, algo), shard, minis, algo, r.device
            )
    if r.critic is not None:
        with stage_timer(r, tracker, "values", **tokens):
            critic = r.critic.model
            values = infer(lambda mb: critic(mb["tokens"][:, :-1]), shard, minis, algo, r.device)
            shard["values"] = values * mask
        with stage_timer(r, tracker, "adv", **tokens):
            ppo_advantages(shard, algo, r.world_size, r.group, r.device)
    return shard, minis


def learner_flops(r: Rank, learner: Learner, shard: Sequences, passes: int = 1) -> float:
    """Training FLOPs of ``passes`` forward+backward passes of ``learner`` over the shard."""
    lens = shard["prompt_lengths"] + shard["response_lengths"] - 1  # the model's input
    model = r.cfg.model
    flops = perf.model_flops(learner.model, lens, n_layer=model.n_layer, n_embd=model.n_embd)
    return passes * flops


def log_batch(r: Rank, shard: Sequences, tracker: Tracker) -> None:
    """Rollout metrics of this rank's rows: scores, advantages, returns, lengths; the
    mean score, response length and advantage per data source too."""
    mask = response_mask(shard)
    prompt_mask = torch.arange(r.task.max_prompt_tokens)[None, :] < shard["prompt_lengths"][:, None]
    rl.log_updates(
        tracker,
        rl.batch_metrics(
            mask,
            scores=shard["scores"],
            rewards=shard["scores"],
            advantages=shard["advantages"],
            returns=shard["returns"],
            values=shard.get("values"),
            prompt_mask=prompt_mask,
            max_response_length=r.task.max_response_len,
            max_prompt_length=r.task.max_prompt_tokens,
        ),
    )
    # per data source (``by=``: each source's rows under <name>/<source>, exact on any split)
    by, names, lengths = shard["source"], dict(enumerate(SOURCES)), shard["response_lengths"]
    tracker.mean("critic/score/mean", shard["scores"], lengths > 0, by=by, labels=names)
    tracker.mean("response_length/mean", lengths.double(), by=by, labels=names)
    tracker.mean("critic/advantages/mean", shard["advantages"], mask, by=by, labels=names)


def update(
    r: Rank,
    learner: Learner,
    loss: Any,
    shard: Sequences,
    minis: list,
    tracker: Tracker,
    total_tokens: float,
) -> None:
    """One learner's update stage, timed, with its MFU and memory metrics.

    With ``update_timing``, also ``<name>/update_time_s`` (rank-aware: the slowest
    rank's) and the exact MFU (``extras.finish``) in place of the mean of per-rank ones.
    """
    algo, name, extra = r.cfg.algo, learner.name, r.cfg.metrics
    with stage_timer(r, tracker, f"update_{name}", num_tokens=total_tokens):
        start = time.perf_counter()
        optimize(
            learner,
            loss,
            shard,
            minis,
            algo,
            tracker,
            world_size=r.world_size,
            group=r.group,
            per_source=extra.per_source,
        )
        seconds = time.perf_counter() - start
    flops = learner_flops(r, learner, shard, passes=algo.epochs)
    if extra.update_timing:
        tracker.elapsed(
            f"{name}/{extras.UPDATE_TIME}", seconds, rank=r.rank, world_size=r.world_size
        )
        peak = perf.peak_flops(r.device)
        mfu = extras.ideal_seconds(name, flops, peak, r.world_size)
    else:
        mfu = perf.mfu_update(name, flops, seconds, r.device)
    rl.log_updates(tracker, [mfu, *perf.memory_updates(name, r.device)])


def log_step(r: Rank, step: int, tracker: Tracker) -> None:
    """One step's work on this rank, its metrics logged into ``tracker`` (no metrics sync).

    A Ray actor calls this, then either ``tracker.compute(group)`` or ``tracker.state()``.
    """
    algo, start = r.cfg.algo, time.perf_counter()
    with stage_timer(r, tracker, "gen") as gen:
        batch = rollout(
            r.actor.model,
            r.task,
            num_prompts=algo.num_prompts,
            n=algo.samples_per_prompt,
            temperature=algo.temperature,
            seed=r.cfg.run.seed,
            step=step,
        )
        gen.num_tokens = float(batch["response_lengths"].sum())  # verl: response tokens
    total_tokens = num_tokens(batch)
    with stage_timer(r, tracker, "reward", num_tokens=total_tokens):
        add_scores(r.task, batch)
    shard, minis = prepare(r, batch, tracker)
    log_batch(r, shard, tracker)
    if r.critic is not None:
        update(r, r.critic, critic_loss(r.critic.model, algo), shard, minis, tracker, total_tokens)
    actor = actor_loss(r.actor.model, algo, r.cfg.metrics)
    update(r, r.actor, actor, shard, minis, tracker, total_tokens)
    rl.log_updates(
        tracker,
        [
            rl.kl_coef_update(algo.kl_coef),
            rl.MetricUpdate("training/global_step", "last", step),
            rl.MetricUpdate("training/epoch", "last", 0),  # prompts are drawn afresh each step
        ],
    )
    seconds, where = time.perf_counter() - start, {"rank": r.rank, "world_size": r.world_size}
    tracker.elapsed("timing_s/step", seconds, **where)
    tracker.max("perf/time_per_step", seconds)
    my_tokens = (shard["prompt_lengths"] + shard["response_lengths"]).sum().double()
    rl.log_updates(tracker, rl.perf_updates(my_tokens, seconds, **where))


def train_step(r: Rank, step: int, tracker: Tracker) -> dict[str, float]:
    """One step on this rank; returns the step's metrics, merged over all ranks."""
    log_step(r, step, tracker)
    start = time.perf_counter()
    metrics = extras.finish(tracker.compute(group=r.group, timeout=r.cfg.run.timeout))
    metrics["timing_s/metrics"] = time.perf_counter() - start  # this rank's sync, after it
    return metrics


def train(
    config: TrainConfig,
    rank: int = 0,
    world_size: int = 1,
    *,
    group: Any = None,
    device: Any = None,
    report: bool | None = None,
) -> list[dict[str, float]]:
    """Train on this rank (the process group, if any, is already initialised).

    Args:
        config: the run's config (the same on every rank).
        rank, world_size: this rank in the data-parallel group.
        group: the data-parallel process group (None: the default group, if any).
        device: where the models live (default: the CPU).
        report: write logs and a progress line per step (default: on rank 0 only).

    Returns:
        the metrics of every step this call ran (the same on every rank); a resumed
        run starts after its checkpoint's step.
    """
    r = setup(config, rank, world_size, group, device)
    tracker = Tracker()
    resumed = checkpoint.maybe_resume(r, tracker)  # every rank loads the same checkpoint
    done = 0 if resumed is None else resumed["step"]
    history: list[dict[str, float]] = []
    show = rank == 0 if report is None else report
    logger_state = resumed and resumed["loggers"]
    with (
        Reporter(config, resume_step=done, logger_state=logger_state) if show else nullcontext()
    ) as reporter:
        for step in range(done + 1, config.run.steps + 1):
            metrics = train_step(r, step, tracker)
            history.append(metrics)
            if reporter is not None:
                reporter.log(step, metrics)
            with (
                stage_timer(r, tracker, "save_checkpoint")
                if checkpoint.due(r, step)
                else nullcontext()
            ):
                checkpoint.maybe_save(r, step, tracker, reporter)  # rank 0, after the log
            checkpoint.maybe_crash_for_test(r, step)
    return history
