"""SkyRL's real FSDP workers on gloo ranks: the tiny model, the batch, the configs, and
the function each spawned rank runs (``tests/_support/gloo_ranks.run_ranks``).

One launch per world size runs every split of that size, for SkyRL's own worker and the
exact one, on the same weights: the optimizer's learning rate is 1e-30 (its steps leave
every float32 weight as it was), so each split sees the model the reference saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

VOCAB = 128  # SkyRL's padding micro-batches draw token ids from randint(0, 100)
PROMPT = 3
RESPONSE = 8  # the padded response width (num_actions)
# 35 response tokens over 8 sequences. With 2 ranks and a 16-token budget, rank 0's
# half (prompt + response: 9, 9, 9, 5 tokens) packs into 3 micro-batches and rank 1's
# (3, 5, 4, 6) into 2, so SkyRL gives rank 1 a padding micro-batch.
RESPONSE_LENGTHS = (8, 7, 6, 4, 1, 2, 3, 4)
LR = 1e-30  # nonzero (the scheduler's warmup shows in lr) yet no float32 weight moves
WARMUP = 4
EPS_CLIP = 0.2
KL_COEF = 0.1


def build_model_dir(path: Path) -> Path:
    """A tiny Llama (tied embeddings: SkyRL then loads it without meta tensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    return path


STEP_LENGTHS = (*RESPONSE_LENGTHS, 2, 1, 3, 1, 2, 2, 1, 1)
"""The step of several mini-batches: two of 8 sequences, 35 and 13 response tokens."""
MINI_BATCH = 8
EPOCHS = 2


def make_batch(lengths: tuple[int, ...] = RESPONSE_LENGTHS, seed: int = 1) -> dict[str, Any]:
    """The training batch as plain tensors: left-padded prompts, right-padded responses
    of the given lengths, old/base log-probs near the model's, advantages of both signs."""
    generator = torch.Generator().manual_seed(seed)
    num_sequences = len(lengths)
    lengths = torch.tensor(lengths)
    columns = torch.arange(RESPONSE)
    response_mask = (columns[None, :] < lengths[:, None]).to(torch.int64)
    prompt_lengths = torch.tensor([1 + i % PROMPT for i in range(num_sequences)])
    prompt_mask = torch.arange(PROMPT)[None, :] >= PROMPT - prompt_lengths[:, None]
    prompt_mask = prompt_mask.to(torch.int64)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    sequences = torch.randint(0, VOCAB, (num_sequences, PROMPT + RESPONSE), generator=generator)
    sequences = sequences * attention_mask
    shape = (num_sequences, RESPONSE)
    old = -4.85 + 0.4 * torch.randn(shape, generator=generator)
    base = -4.85 + 0.4 * torch.randn(shape, generator=generator)
    advantages = torch.randn((num_sequences, 1), generator=generator).expand(shape).clone()
    sign = torch.where(torch.rand(shape, generator=generator) < 0.5, -1.0, 1.0)
    return {
        "sequences": sequences,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "loss_mask": response_mask.clone(),
        "action_log_probs": old * response_mask,
        "base_action_log_probs": base * response_mask,
        "advantages": advantages * response_mask,
        # old values 0.6 to 1.2 away from the tiny critic's (about 0.1): every token's
        # value is clipped, so values_clipfrac compares two distinct squares per token
        # (an unclipped token's two squares are equal up to float rounding)
        "values": (0.1 + sign * (0.6 + 0.6 * torch.rand(shape, generator=generator)))
        * response_mask,
        "returns": torch.randn(shape, generator=generator) * response_mask,
    }


@dataclass(frozen=True)
class Split:
    """How each rank runs its share of a mini-batch."""

    name: str
    micro_batch: int = 1
    token_budget: int = -1


def make_config(model_dir: Path) -> Any:
    """SkyRL's TrainerConfig for the tiny model on the CPU (float32 throughout)."""
    from skyrl.train.config.config import MixedPrecisionConfig, TrainerConfig

    trainer = TrainerConfig()
    trainer.flash_attn = False
    trainer.remove_microbatch_padding = False  # padding removal needs flash-attention-2
    trainer.gradient_checkpointing = False
    trainer.bf16 = False
    trainer.algorithm.temperature = 1.0
    trainer.algorithm.policy_loss_type = "regular"
    trainer.algorithm.loss_reduction = "token_mean"
    trainer.algorithm.eps_clip_low = EPS_CLIP
    trainer.algorithm.eps_clip_high = EPS_CLIP
    trainer.algorithm.use_kl_loss = True
    trainer.algorithm.kl_loss_coef = KL_COEF
    trainer.algorithm.kl_estimator_type = "k3"
    trainer.algorithm.value_clip = 0.2
    precision = MixedPrecisionConfig(param_dtype="fp32", reduce_dtype="fp32", buffer_dtype="fp32")
    for role in (trainer.policy, trainer.critic):
        role.model.path = str(model_dir)
        role.fsdp_config.mixed_precision = precision
        role.optimizer_config.lr = LR
        role.optimizer_config.num_warmup_steps = WARMUP
    return trainer


SPLITS = {
    1: [Split("1 rank, 1 micro-batch", micro_batch=8)],
    2: [
        Split("2 ranks, micro-batch 1", micro_batch=1),
        Split("2 ranks, micro-batch 2", micro_batch=2),
        Split("2 ranks, micro-batch 4", micro_batch=4),
        Split("2 ranks, 16-token budget", token_budget=16),
    ],
}
"""The splits of the issue's table, by world size (one launch per world size)."""

STEP_SPLIT = Split("2 ranks, micro-batch 2", micro_batch=2)
"""The split of the step of several mini-batches and epochs."""


def normalized(batch: dict[str, Any], loss_reduction: str, mini_batch: int) -> dict[str, Any]:
    """The batch with its advantages scaled per mini-batch as SkyRL's trainer scales them
    before a step (``apply_loss_reduction_to_advantages_minibatch``)."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import (
        apply_loss_reduction_to_advantages_minibatch,
    )

    scaled = torch.zeros_like(batch["advantages"])
    for start in range(0, len(scaled), mini_batch):
        rows = slice(start, start + mini_batch)
        scaled[rows] = apply_loss_reduction_to_advantages_minibatch(
            batch["advantages"][rows], batch["loss_mask"][rows], loss_reduction, 1, RESPONSE
        )
    return {**batch, "advantages": scaled}


def shard(batch: dict[str, Any], rows: slice) -> Any:
    """One rank's rows of a mini-batch as SkyRL's TrainingInputBatch (the trainer hands
    each data-parallel rank a contiguous chunk)."""
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

    part = TrainingInputBatch({key: value[rows] for key, value in batch.items()})
    part.metadata = {"response_length": RESPONSE}
    return part


def _workers(cfg: Any, model_dir: Path, rank: int, world_size: int) -> dict[str, Any]:
    """SkyRL's FSDP policy and critic workers and the exact ones, each initialised by
    SkyRL's own init_model. The process group exists already (gloo, made by
    gloo_ranks): SkyRL's init_worker_process_group keeps it."""
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import (
        FSDPCriticWorkerBase,
        FSDPPolicyWorkerBase,
    )

    from rlmetrics.integrations.skyrl import ExactFSDPCriticWorkerBase, ExactFSDPPolicyWorkerBase

    classes = {
        ("policy", "plain"): FSDPPolicyWorkerBase,
        ("policy", "exact"): ExactFSDPPolicyWorkerBase,
        ("critic", "plain"): FSDPCriticWorkerBase,
        ("critic", "exact"): ExactFSDPCriticWorkerBase,
    }
    workers = {}
    for key, cls in classes.items():
        worker = cls(
            cfg=cfg, world_size=world_size, rank=rank, local_rank=0, master_addr="127.0.0.1",
            master_port=0, sequence_parallel_size=1,
        )  # fmt: skip
        worker.init_worker_process_group()
        worker.init_model(str(model_dir), num_training_steps=100)
        workers[key] = worker
    return workers


def _update(worker: Any, part: Any) -> dict[str, Any]:
    """One mini-batch: SkyRL's forward_backward then optim_step, as its trainer calls
    them; the metrics dict with the gradient norm."""
    metrics = dict(worker.forward_backward(part).metrics)
    metrics["grad_norm"] = worker.optim_step()
    return metrics


def _reference_outputs(workers: dict[str, Any], batches: dict[str, Any]) -> dict[str, Any]:
    """Per-token model outputs of each whole batch in one forward pass (no gradient):
    the policy's log-probs and entropies, the critic's values."""
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

    out = {}
    policy, critic = workers["policy", "plain"], workers["critic", "plain"]
    for name, batch in batches.items():
        with torch.no_grad():
            log_probs, output = policy.model(
                batch["sequences"], RESPONSE, attention_mask=batch["attention_mask"],
                temperature=1.0, return_output=True, compute_entropy=True,
            )  # fmt: skip
            part = TrainingInputBatch({k: batch[k] for k in ("sequences", "attention_mask")})
            part.metadata = {"response_length": RESPONSE}
            values = critic._forward_micro_batch(part)["output"]
        entropy = output["entropy"][:, -RESPONSE - 1 : -1]
        out[name] = {
            "log_probs": log_probs.double().numpy(),
            "entropy": entropy.double().numpy(),
            "values": values.double().numpy(),
        }
    return out


def run_rank(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    """Everything one rank of a launch runs (``gloo_ranks.run_ranks``): every split of
    its world size for both workers of both roles; on 1 rank, the reference forward
    passes; on 2 ranks, the step of several mini-batches with SkyRL's policy worker."""
    import cpu_skyrl

    cpu_skyrl.install()  # before this process imports SkyRL
    cfg = make_config(Path(model_dir))
    workers = _workers(cfg, Path(model_dir), rank, world_size)
    batch = normalized(make_batch(), cfg.algorithm.loss_reduction, len(RESPONSE_LENGTHS))
    per_rank = len(RESPONSE_LENGTHS) // world_size
    part = shard(batch, slice(rank * per_rank, (rank + 1) * per_rank))
    results: dict[str, Any] = {"splits": {}, "states": {}}
    for split in SPLITS[world_size]:
        cfg.micro_train_batch_size_per_gpu = split.micro_batch
        cfg.max_tokens_per_microbatch = split.token_budget
        for (role, kind), worker in workers.items():
            results["splits"][split.name, role, kind] = _update(worker, part)
            if kind == "exact":  # each split is a training step of its own
                results["states"][split.name, role] = worker.take_step_metrics_state()
    if world_size == 1:
        step_batch = make_batch(STEP_LENGTHS, seed=2)
        batches = {"split": make_batch(), "step": step_batch}
        results["reference"] = _reference_outputs(workers, batches)
    else:
        results["plain_step"] = _run_step(cfg, workers["policy", "plain"], rank, world_size)
    return results


def step_config(cfg: Any) -> None:
    """The step of several mini-batches: STEP_SPLIT, no KL loss (the trainer test then
    needs no reference model)."""
    cfg.micro_train_batch_size_per_gpu = STEP_SPLIT.micro_batch
    cfg.max_tokens_per_microbatch = STEP_SPLIT.token_budget
    cfg.algorithm.use_kl_loss = False
    cfg.update_epochs_per_batch = EPOCHS


def _run_step(cfg: Any, worker: Any, rank: int, world_size: int) -> list[dict[str, Any]]:
    """A training step as SkyRL's trainer runs it (``_execute_training_step``): EPOCHS
    passes over the mini-batches of STEP_LENGTHS, an optimizer step after each.
    Returns the mini-batch dicts, in order."""
    step_config(cfg)
    batch = normalized(make_batch(STEP_LENGTHS, seed=2), cfg.algorithm.loss_reduction, MINI_BATCH)
    per_rank = MINI_BATCH // world_size
    dicts = []
    for _epoch in range(EPOCHS):
        for start in range(0, len(STEP_LENGTHS), MINI_BATCH):
            first = start + rank * per_rank
            dicts.append(_update(worker, shard(batch, slice(first, first + per_rank))))
    return dicts


def launch(world_size: int, model_dir: Path) -> dict[int, dict[str, Any]]:
    """One launch of ``world_size`` gloo ranks running ``run_rank``: rank -> results."""
    import gloo_ranks

    outcome = gloo_ranks.run_ranks(
        run_rank, world_size, str(model_dir), timeout=400, pg_timeout=300
    )
    return dict(enumerate(gloo_ranks.ok_results(outcome)))


def trainer_step(model_dir: Path) -> dict[str, float]:
    """The step of several mini-batches through ``ExactRayPPOTrainer`` on Ray: its own
    ``build_models`` (given SkyRL's worker classes, as ``BasePPOExp`` gives them) starts
    two exact policy workers as Ray actors (CPU shims: ``cpu_skyrl.install`` as Ray's
    worker setup hook), then SkyRL's ``_execute_training_step`` with the exact merge.
    Ray runs in this process (``local_ray``) with two logical GPUs for the actors."""
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import (
        CriticWorker,
        PolicyWorker,
        RefWorker,
    )
    from skyrl.train.config.config import SkyRLTrainConfig

    from rlmetrics.integrations.skyrl import ExactRayPPOTrainer

    cfg = SkyRLTrainConfig()
    cfg.trainer = make_config(model_dir)
    step_config(cfg.trainer)
    cfg.trainer.placement.colocate_all = False
    cfg.trainer.placement.policy_num_gpus_per_node = 2
    cfg.trainer.critic.model.path = None
    tokenizer = type("Tokenizer", (), {"pad_token_id": 0})()  # build_models reads only this
    trainer = ExactRayPPOTrainer(
        cfg=cfg, tracker=None, tokenizer=tokenizer, train_dataset=None,
        inference_engine_client=None, generator=None,
    )  # fmt: skip
    trainer.build_models(PolicyWorker, CriticWorker, RefWorker)
    data = TrainingInputBatch(make_batch(STEP_LENGTHS, seed=2))
    boundaries = [(start, start + MINI_BATCH) for start in range(0, len(STEP_LENGTHS), MINI_BATCH)]
    data.metadata = {"response_length": RESPONSE, "policy_mini_batch_boundaries": boundaries}
    return trainer._execute_training_step("policy", data)
