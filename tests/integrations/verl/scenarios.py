"""Real verl 0.9.1 actor and critic updates on the CPU, one batch, many splits.

A run builds verl's ``ActorRolloutRefWorker(role="actor")`` (and a critic
``TrainingWorker``) around a tiny random Qwen2, then sends the same batch through
``update_actor`` / ``train_mini_batch`` once per split and reduces the returned
metrics the way verl's driver does (``rename_dict`` + ``reduce_metrics``). The
learning rate is 0, so every split sees the same weights and reports the metrics of
the same forward pass: only the split differs.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch
from cpu_verl import setup_cpu

BATCH = 8
PROMPT_LEN = 4
RESPONSE_LEN = 8
VOCAB = 64
SPLITS: dict[str, dict[str, Any]] = {
    "whole": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": BATCH},
    "micro4": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 4},
    "micro2": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2},
    "micro1": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 1},
    "dynamic16": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 16},
    "dynamic24": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 24},
    "2minibatches": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2, "mini_batches": 2},
}
"""Micro-batch settings per split name (per rank; 'whole' is the whole rank batch).
'2minibatches' makes two optimizer steps of half the batch each (weights unchanged at
lr 0): the step's metrics cover both, so they equal the whole batch's too, except
grad_norm (each optimizer step has its own gradient)."""

SINGLE_STEP_ONLY = ("actor/grad_norm", "critic/grad_norm")
"""Metrics of one optimizer step: compared on the one-mini-batch splits only."""

FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
"""fp32 compute everywhere, so splits differ only by float32 rounding."""

STRATEGIES = ("fsdp2", "fsdp")
"""verl's FSDP engines: FSDP2, and FSDP1 (``strategy: fsdp``, verl 0.9.1's default).
Both are ``FSDPEngineWithLMHead`` (and its value-head subclass), wrapped differently."""

ACTOR_METRICS = (
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/pg_clipfrac_lower",
    "actor/pg_loss",
    "actor/entropy_loss",
    "actor/kl_loss",
    "actor/grad_norm",
    "actor/lr",
)
CRITIC_METRICS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm")


def make_models(path: str) -> None:
    """A tiny random Qwen2 (fp32), saved where verl loads models from: the policy under
    ``path/actor``, a value model (one-label token classifier) under ``path/critic``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    Qwen2ForCausalLM(config).save_pretrained(os.path.join(path, "actor"))
    config.num_labels = 1
    Qwen2ForTokenClassification(config).save_pretrained(os.path.join(path, "critic"))


def trainer_config(model_path: str, lr: float = 0.0, strategy: str = "fsdp2") -> Any:
    """verl's generated PPO trainer config, set up for a CPU run of ``model_path`` with
    the FSDP ``strategy`` (the actor's, which the reference policy follows)."""
    from importlib.resources import files

    from omegaconf import OmegaConf, open_dict

    yaml = files("verl.trainer.config") / "_generated_ppo_trainer.yaml"
    config = OmegaConf.load(str(yaml))
    ref = config.actor_rollout_ref
    with open_dict(config):
        ref.model.path = model_path
        ref.model.use_remove_padding = False
        ref.model.enable_gradient_checkpointing = False
        ref.model.override_config = {"attn_implementation": "eager"}
        ref.model.load_tokenizer = False
        actor = ref.actor
        for part in (actor, ref.ref):  # the trained policy and the reference policy
            part.strategy = strategy
            part.use_torch_compile = False
            part.fsdp_config.use_torch_compile = False
            part.fsdp_config.strategy = strategy
            part.fsdp_config.dtype = "float32"
            part.fsdp_config.model_dtype = "fp32"
            part.fsdp_config.mixed_precision = FP32
        ref.ref.log_prob_micro_batch_size_per_gpu = BATCH
        actor.optim.lr = lr
        actor.ppo_micro_batch_size_per_gpu = BATCH
        ref.rollout.log_prob_micro_batch_size_per_gpu = BATCH
        actor.entropy_coeff = 0.01
        actor.calculate_entropy = True
        actor.use_kl_loss = True
        actor.kl_loss_type = "low_var_kl"
        actor.clip_ratio_c = 3.0
    return config


def make_batch(seed: int = 1, rows: int = BATCH) -> Any:
    """``rows`` sequences (left-padded prompts, right-padded responses of different
    lengths) with old and reference log-probs and advantages, as verl's driver holds
    them before ``_update_actor``."""
    from tensordict import TensorDict

    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(2, PROMPT_LEN + 1, (rows,), generator=gen)
    response_lens = torch.randint(1, RESPONSE_LEN + 1, (rows,), generator=gen)
    input_ids = torch.randint(0, VOCAB, (rows, PROMPT_LEN + RESPONSE_LEN), generator=gen)
    positions = torch.arange(PROMPT_LEN + RESPONSE_LEN)
    prompt_mask = positions[None, :PROMPT_LEN] >= (PROMPT_LEN - prompt_lens)[:, None]
    response_mask = positions[None, :RESPONSE_LEN] < response_lens[:, None]
    attention_mask = torch.cat((prompt_mask, response_mask), dim=1).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    shape = (rows, RESPONSE_LEN)
    return TensorDict(
        {
            "input_ids": input_ids,
            "prompts": input_ids[:, :PROMPT_LEN],
            "responses": input_ids[:, PROMPT_LEN:],
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask.long(),
            "old_log_probs": -4.2 + 1.0 * torch.randn(shape, generator=gen),
            "ref_log_prob": -4.2 + 0.5 * torch.randn(shape, generator=gen),
            "advantages": torch.randn(shape, generator=gen),
            "values": 0.3 * torch.randn(shape, generator=gen),
            "returns": torch.randn(shape, generator=gen),
        },
        batch_size=[rows],
    )


def rank_slice(batch: Any, rank: int, world_size: int) -> Any:
    """This rank's rows, as verl's dispatch gives them (contiguous chunks, in order)."""
    rows = batch.batch_size[0] // world_size
    return batch[rank * rows : (rank + 1) * rows]


def update_input(batch: Any, split: dict[str, Any], world_size: int) -> Any:
    """The TensorDict a worker's ``update_actor`` / ``train_mini_batch`` receives."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    data = left_right_2_no_padding(batch.clone())
    rows = batch.batch_size[0]
    split = dict(split)
    if "micro_batch_size_per_gpu" in split:  # "whole" is the rank's whole share
        split["micro_batch_size_per_gpu"] = min(split["micro_batch_size_per_gpu"], rows)
    mini_batch = rows * world_size // split.pop("mini_batches", 1)
    tu.assign_non_tensor(
        data,
        calculate_entropy=True,
        global_batch_size=mini_batch,  # as verl's driver: the mini-batch's sequences
        mini_batch_size=mini_batch,
        epochs=1,
        seed=42,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
        temperature=1.0,
        **split,
    )
    return data


def driver_reduce(output: Any, prefix: str) -> dict[str, float]:
    """What verl's driver logs from a worker's update output."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import reduce_metrics
    from verl.utils.py_functional import rename_dict

    metrics = rename_dict(dict(tu.get(output, "metrics")), prefix)
    return {k: float(v) for k, v in reduce_metrics(metrics).items()}


def build_actor(model_path: str, lr: float = 0.0, strategy: str = "fsdp2") -> Any:
    from verl.workers.engine_workers import ActorRolloutRefWorker

    config = trainer_config(model_path, lr, strategy)
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor")
    worker.init_model()
    return worker


def set_critic(config: Any, model_path: str, strategy: str = "fsdp2") -> None:
    """Point verl's trainer config's critic at the value model in ``model_path``, set up
    for the CPU as the actor is (``trainer_config``), with the FSDP ``strategy``."""
    from omegaconf import open_dict

    critic = config.critic
    with open_dict(config):
        critic.strategy = strategy
        critic.model.path = model_path
        critic.model.use_remove_padding = False
        critic.model.enable_gradient_checkpointing = False
        critic.model.override_config = {"attn_implementation": "eager"}
        critic.model.load_tokenizer = False
        critic.fsdp.strategy = strategy
        critic.fsdp.use_torch_compile = False
        critic.fsdp.dtype = "float32"
        critic.fsdp.model_dtype = "fp32"
        critic.fsdp.mixed_precision = FP32
        critic.optim.lr = 0.0
        critic.ppo_micro_batch_size_per_gpu = BATCH
        critic.ppo_mini_batch_size = BATCH


def critic_worker_config(config: Any) -> tuple[Any, Any]:
    """The critic's ``TrainingWorkerConfig`` and ``CriticConfig``, made from the trainer
    config as ``RayPPOTrainer.init_workers`` makes them."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers import engine_workers

    critic_config = omega_conf_to_dataclass(config.critic)
    critic_config.engine.max_token_len_per_gpu = critic_config.ppo_max_token_len_per_gpu
    critic_config.engine.infer_max_token_len_per_gpu = critic_config.ppo_infer_max_token_len_per_gpu
    worker_config = engine_workers.TrainingWorkerConfig(
        model_type="value_model",
        model_config=critic_config.model,
        engine_config=critic_config.engine,
        optimizer_config=critic_config.optim,
        checkpoint_config=critic_config.checkpoint,
    )
    return worker_config, critic_config


def build_critic(model_path: str, strategy: str = "fsdp2") -> Any:
    """verl's critic as its trainer builds it: the TrainingWorker class looked up at
    build time in ``verl.workers.engine_workers``, given ``value_loss``."""
    from verl.workers import engine_workers
    from verl.workers.utils.losses import value_loss

    config = trainer_config(model_path, strategy=strategy)
    set_critic(config, model_path, strategy)
    worker_config, critic_config = critic_worker_config(config)
    worker = engine_workers.TrainingWorker(config=worker_config)
    worker.reset()
    worker.set_loss_fn(partial(value_loss, config=critic_config))
    return worker


def run_splits(
    model_path: str, rank: int, world_size: int, exact: bool, strategy: str = "fsdp2"
) -> dict[str, Any]:
    """Actor and critic metrics for every split, with the integration on or off, on
    the FSDP ``strategy``."""
    import rlmetrics.integrations.verl as integration

    integration.enable() if exact else integration.disable()
    batch = rank_slice(make_batch(), rank, world_size)
    out: dict[str, Any] = {"actor": {}, "critic": {}}
    actor = build_actor(os.path.join(model_path, "actor"), strategy=strategy)
    for name, split in SPLITS.items():
        output = actor.update_actor(update_input(batch, split, world_size))
        out["actor"][name] = driver_reduce(output, "actor/")
    critic = build_critic(os.path.join(model_path, "critic"), strategy)
    for name, split in SPLITS.items():
        output = critic.train_mini_batch(update_input(batch, split, world_size))
        out["critic"][name] = driver_reduce(output, "critic/")
    return out


def init_rank(rank: int, world_size: int, port: int) -> None:
    """The environment verl's Worker reads, and the gloo group it then finds."""
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        VERL_PLATFORM="cpu",
    )
    setup_cpu()
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )


def lr_steps(model_path: str, exact: bool, steps: int = 2) -> list[float]:
    """The ``actor/lr`` verl's driver logs over ``steps`` updates with a 4-step warmup
    (the lr a step used is 0, 1/4, 2/4... of the peak)."""
    import rlmetrics.integrations.verl as integration

    integration.enable() if exact else integration.disable()
    from omegaconf import open_dict
    from verl.workers.engine_workers import ActorRolloutRefWorker

    config = trainer_config(os.path.join(model_path, "actor"), lr=PEAK_LR)
    with open_dict(config):
        config.actor_rollout_ref.actor.optim.lr_warmup_steps = 4
        config.actor_rollout_ref.actor.optim.total_training_steps = 10
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor")
    worker.init_model()
    batch = make_batch()
    logged = []
    for _ in range(steps):
        output = worker.update_actor(update_input(batch, SPLITS["micro4"], 1))
        logged.append(driver_reduce(output, "actor/")["actor/lr"])
    return logged


PEAK_LR = 1e-3


def collect(rank: int, world_size: int, port: int, model_path: str) -> dict[str, Any]:
    """Everything the tests check, from one rank (run under ``gloo_ranks.run_ranks``,
    which has created the gloo group)."""
    init_rank(rank, world_size, port)
    import sys

    out: dict[str, Any] = {
        "plugin_loaded_by_import_verl": "rlmetrics.integrations.verl" in sys.modules,
    }
    for strategy in STRATEGIES:
        out[strategy] = {
            "exact": run_splits(model_path, rank, world_size, exact=True, strategy=strategy),
            "verl": run_splits(model_path, rank, world_size, exact=False, strategy=strategy),
        }
    if world_size == 1:
        out["lr_exact"] = lr_steps(model_path, exact=True)
        out["lr_verl"] = lr_steps(model_path, exact=False)
    return out


def worker_facts(worker: Any) -> dict[str, Any]:
    """What a colocated Ray worker process (verl's ``WorkerDict``, holding ``actor`` and
    ``critic``) reports about itself: whether rlmetrics' integration was imported in it,
    and the classes verl built there for the actor's update and for the critic. Run in
    the worker by the driver (``__ray_call__``); imports nothing of rlmetrics."""
    import sys

    from verl.plugin.platform import get_platform

    inner = worker.worker_dict

    def qualified(cls: type) -> str:
        return f"{cls.__module__}.{cls.__qualname__}"

    return {
        "integration_imported": "rlmetrics.integrations.verl" in sys.modules,
        "actor_update_class": qualified(type(inner["actor"].actor)),
        "critic_class": qualified(type(inner["critic"])),
        "platform": get_platform().device_name,
        "plugins_policy": os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto"),
        "pid": os.getpid(),
    }
