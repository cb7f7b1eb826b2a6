"""Frozen, keyword-only config dataclasses; every field documents its flag.

``rlmetrics.cli`` turns each field into ``--field-name`` with its ``help`` metadata, so
the command line and these defaults never drift apart. ``TrainConfig`` groups the rest.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

TASKS = ("reverse", "copy")
DTYPES = ("float32", "float64")
ALGOS = ("grpo", "ppo")
KL_TYPES = ("kl", "k1", "abs", "mse", "low_var_kl", "k1+", "k3+", "low_var_kl+", "abs+")
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean")
LAUNCHERS = ("spawn", "ray")
METRICS_PATHS = ("collective", "driver")  # where the Ray launcher merges metrics
DEVICE_FORM = re.compile(r"cpu|cuda(:\d+)?")


def opt(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with a default and the help text of its CLI flag."""
    return field(default=default, metadata={"help": help, **kwargs})


SEED_MAX = 2**32 - 1  # seeds are in [0, SEED_MAX]: numpy, torch and python all take them


class ConfigError(ValueError):
    """A config value out of its range; ``field`` names it (the CLI names its flag)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def check(ok: bool, name: str, value: Any, need: str) -> None:
    """Raise ConfigError naming the field, the value and what it needs."""
    if not ok:
        raise ConfigError(f"{name} must be {need}, got {value!r}", name)


def number_need(
    value: Any,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    open_low: bool = False,
    integer: bool = False,
) -> str | None:
    """None when ``value`` is a finite number (an int when ``integer``) in
    ``[low, high]`` (``(low, high]`` when ``open_low``), else what it needs, e.g.
    "a finite number >= 0". The one range check of every numeric config field and
    command-line flag.

    NaN fails every comparison and would slip through a plain ``x >= low``; so does
    inf through ``x > 0``. Both are refused here.
    """
    kind = int if integer else int | float
    number = isinstance(value, kind) and not isinstance(value, bool)
    finite = number and (integer or math.isfinite(value))
    above = finite and (value > low if open_low else value >= low)
    if above and value <= high:
        return None
    what = "an integer" if integer else "a finite number"
    bounds = []
    if math.isfinite(low):
        bounds.append(f"> {low:g}" if open_low else f">= {low:g}")
    if math.isfinite(high):
        bounds.append(f"<= {high:g}" if not integer else f"<= {high}")
    return " and ".join([f"{what} {bounds[0]}" if bounds else what, *bounds[1:]])


def check_number(
    obj: Any,
    name: str,
    low: float,
    high: float = math.inf,
    *,
    open_low: bool = False,
    integer: bool = False,
) -> None:
    """Raise ConfigError naming the field unless it is a finite number in its range
    (``number_need``)."""
    value = getattr(obj, name)
    need = number_need(value, low, high, open_low=open_low, integer=integer)
    if need is not None:
        check(False, name, value, need)


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskConfig:
    """The built-in verifiable task (see ``task.py``)."""

    task: str = opt(
        "reverse", "reverse: answer the prompt backwards; copy: repeat it", choices=TASKS
    )
    num_symbols: int = opt(5, "number of distinct symbols in prompts")
    min_prompt_len: int = opt(1, "shortest prompt (symbols)")
    max_prompt_len: int = opt(5, "longest prompt (symbols)")
    end_bonus: float = opt(0.3, "share of the reward for ending at the right place")
    source_split: int = opt(
        2,
        "prompts of up to this many symbols come from data source 'short', longer ones from "
        "'long' (metrics per source: <name>/short, <name>/long)",
    )

    def __post_init__(self) -> None:
        check(self.task in TASKS, "task", self.task, f"one of {TASKS}")
        check(self.num_symbols >= 2, "num_symbols", self.num_symbols, ">= 2")
        check(self.min_prompt_len >= 1, "min_prompt_len", self.min_prompt_len, ">= 1")
        check(
            self.max_prompt_len >= self.min_prompt_len,
            "max_prompt_len",
            self.max_prompt_len,
            ">= min_prompt_len",
        )
        check_number(self, "end_bonus", 0.0, 1.0)
        check(self.source_split >= 0, "source_split", self.source_split, ">= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The tiny causal transformer (actor, reference and critic share it)."""

    n_layer: int = opt(2, "transformer blocks")
    n_head: int = opt(4, "attention heads")
    n_embd: int = opt(128, "embedding width (a multiple of n_head)")
    dtype: str = opt("float32", "parameter and compute dtype", choices=DTYPES)

    def __post_init__(self) -> None:
        check(self.n_layer >= 1, "n_layer", self.n_layer, ">= 1")
        check(self.n_head >= 1, "n_head", self.n_head, ">= 1")
        check(self.n_embd >= 1, "n_embd", self.n_embd, ">= 1")
        check(self.n_embd % self.n_head == 0, "n_embd", self.n_embd, "a multiple of n_head")
        check(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")


@dataclass(frozen=True, kw_only=True, slots=True)
class AlgoConfig:
    """The RL algorithm, its batch partition and its optimiser."""

    algo: str = opt("grpo", "grpo (groups of n samples) or ppo (a critic and GAE)", choices=ALGOS)
    num_prompts: int = opt(
        32, "prompts per step (a batch is num_prompts * samples_per_prompt sequences)", metavar="P"
    )
    samples_per_prompt: int = opt(8, "samples per prompt (GRPO's group size n)", metavar="N")
    mini_batches: int = opt(4, "optimizer steps per epoch (the batch is cut in K)", metavar="K")
    epochs: int = opt(1, "passes over the batch per step (PPO epochs)", metavar="E")
    micro_batch_size: int | None = opt(None, "sequences per micro-batch (None: all)", metavar="M")
    max_tokens_per_micro_batch: int | None = opt(
        None, "token budget per micro-batch (prompt + response tokens)", metavar="T"
    )
    lr: float = opt(1.5e-3, "peak learning rate (actor)")
    critic_lr: float = opt(1e-2, "peak learning rate (critic, ppo)")
    warmup_steps: int = opt(5, "linear warmup steps")
    min_lr_ratio: float = opt(0.1, "cosine decay floor, as a fraction of lr")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    max_grad_norm: float = opt(1.0, "gradient clipping threshold")
    clip_low: float = opt(0.2, "PPO ratio clip below 1")
    clip_high: float = opt(0.28, "PPO ratio clip above 1")
    clip_ratio_c: float = opt(3.0, "dual-clip bound c for negative advantages (> 1; verl's 3)")
    kl_coef: float = opt(0.001, "KL loss coefficient (0 skips the reference model)")
    kl_type: str = opt("low_var_kl", "KL estimator", choices=KL_TYPES)
    entropy_coef: float = opt(0.0, "entropy bonus coefficient")
    loss_agg: str = opt("token-mean", "loss aggregation mode (rlmetrics.rl)", choices=AGG_MODES)
    temperature: float = opt(1.0, "sampling temperature")
    gamma: float = opt(1.0, "GAE discount (ppo)")
    lam: float = opt(1.0, "GAE lambda (ppo)")
    vf_clip: float = opt(0.5, "value clip range (ppo)")

    def __post_init__(self) -> None:
        check(self.algo in ALGOS, "algo", self.algo, f"one of {ALGOS}")
        for name in ("num_prompts", "samples_per_prompt", "mini_batches", "epochs"):
            check(getattr(self, name) >= 1, name, getattr(self, name), ">= 1")
        n = self.samples_per_prompt
        check(self.algo != "grpo" or n >= 2, "samples_per_prompt", n, ">= 2 with grpo")
        if self.micro_batch_size is not None and self.max_tokens_per_micro_batch is not None:
            raise ValueError("micro_batch_size and max_tokens_per_micro_batch are exclusive")
        for name in ("micro_batch_size", "max_tokens_per_micro_batch"):
            value = getattr(self, name)
            check(value is None or value >= 1, name, value, ">= 1 or None")
        num_seqs = self.num_prompts * n
        check(self.mini_batches <= num_seqs, "mini_batches", self.mini_batches, "<= batch size")
        check(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, ">= 0")
        check(self.kl_type in KL_TYPES, "kl_type", self.kl_type, f"one of {KL_TYPES}")
        check(self.loss_agg in AGG_MODES, "loss_agg", self.loss_agg, f"one of {AGG_MODES}")
        self._check_numbers()

    def _check_numbers(self) -> None:
        """Every float field finite and in its range (NaN and inf named, never trained on)."""
        for name in ("lr", "critic_lr", "max_grad_norm", "temperature", "vf_clip"):
            check_number(self, name, 0.0, open_low=True)
        for name in ("weight_decay", "clip_low", "clip_high", "kl_coef", "entropy_coef"):
            check_number(self, name, 0.0)
        for name in ("min_lr_ratio", "gamma", "lam"):
            check_number(self, name, 0.0, 1.0)
        check_number(self, "clip_ratio_c", 1.0, open_low=True)

    @property
    def num_seqs(self) -> int:
        """Sequences per step."""
        return self.num_prompts * self.samples_per_prompt


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """The run: length, ranks, seed, logging."""

    steps: int = opt(60, "training steps")
    dp: int = opt(2, "data-parallel ranks (spawn launcher; torchrun sets its own)", metavar="D")
    seed: int = opt(
        0, "seed of the model init and of every step's rollout, in [0, 2**32 - 1]", metavar="S"
    )
    device: str | None = opt(
        None,
        "where the models and their micro-batches live: cpu, cuda (local rank r on GPU r "
        "mod the GPU count) or cuda:N (None: the CPU; under torchrun, the local GPU when "
        "CUDA is available)",
        metavar="DEV",
    )
    run_dir: str = opt("runs/demo", "folder for the run's logs", metavar="DIR")
    metrics_jsonl: str | None = opt(
        None, "JSONL file, one line per step (None: RUN_DIR/metrics.jsonl)", metavar="PATH"
    )
    loggers: str = opt(
        "console,jsonl",
        "comma-separated: console,jsonl,tensorboard,wandb,mlflow",
        metavar="LIST",
        aliases=("--logger",),
    )
    log_every: int = opt(0, "print a table of every metric every k steps (0: never)")
    progress: bool = opt(True, "print a progress line per step (reward, clip fraction, ...)")
    timeout: float = opt(120.0, "seconds before a missing rank raises in a metrics sync")
    checkpoint_every: int = opt(
        0, "save RUN_DIR/checkpoint.pt every k steps and at the last (0: never)", metavar="K"
    )
    resume: bool = opt(False, "continue from RUN_DIR/checkpoint.pt if there is one")
    resume_from: str | None = opt(
        None, "continue from this checkpoint (a file, or a run dir holding one)", metavar="PATH"
    )

    def __post_init__(self) -> None:
        check(self.steps >= 1, "steps", self.steps, ">= 1")
        check(self.dp >= 1, "dp", self.dp, ">= 1")
        check_number(self, "seed", 0, SEED_MAX, integer=True)
        check(
            self.device is None or bool(DEVICE_FORM.fullmatch(str(self.device))),
            "device",
            self.device,
            "cpu, cuda or cuda:N",
        )
        check(self.log_every >= 0, "log_every", self.log_every, ">= 0")
        from rlmetrics.loggers import parse_backends  # raises ValueError naming a bad one

        parse_backends(self.loggers)
        check_number(self, "timeout", 0.0, open_low=True)
        check(self.checkpoint_every >= 0, "checkpoint_every", self.checkpoint_every, ">= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class MetricsConfig:
    """Opt-in metrics: the switches of the verl and TRL integrations, and the naive
    values the demo shows (all off by default)."""

    per_source: bool = opt(
        False,
        "also report every update metric (actor: losses, clip fractions, ppo_kl, entropy, "
        "kl_loss; critic: vf_loss, vf_clipfrac, vpred_mean) per data source as "
        "<key>/<source> (verl's RLMETRICS_VERL_DETAIL, TRL's by_column)",
    )
    token_quantiles: bool = opt(
        False,
        "report p50, p90, p99, max, min, mean and std of every update token's entropy, "
        "importance ratio and (with a KL loss) KL: actor/token_entropy/*, "
        "actor/importance_ratio/*, actor/token_kl/* (a quantile sketch)",
    )
    update_timing: bool = opt(
        False,
        "report {actor,critic}/update_time_s (the slowest rank's update time, with /mean, "
        "/min, /slowest_rank) and make perf/mfu/{actor,critic} the whole step's FLOPs over "
        "that time (not a mean of per-rank ratios)",
    )
    naive: bool = opt(
        False,
        "also report naive/actor/pg_clipfrac and naive/actor/ppo_kl: the mean of "
        "micro-batch means that a per-micro-batch logger reports (it changes with the "
        "partition), to compare with the exact values (on in rlmetrics demo)",
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Everything a rank needs to train."""

    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    run: RunConfig = field(default_factory=RunConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        for name, kind in SECTIONS.items():
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise TypeError(f"TrainConfig.{name} must be a {kind.__name__}, got {value!r}")


SECTIONS: dict[str, type] = {
    "task": TaskConfig,
    "model": ModelConfig,
    "algo": AlgoConfig,
    "run": RunConfig,
    "metrics": MetricsConfig,
}
