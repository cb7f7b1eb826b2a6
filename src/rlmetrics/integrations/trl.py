"""``ExactGRPOTrainer``: TRL's GRPOTrainer whose logged metrics do not depend on the split.

Switch by changing one import and one class name::

    from rlmetrics.integrations.trl import ExactGRPOTrainer  # was: from trl import GRPOTrainer
    trainer = ExactGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), ...)

Same constructor, same logged keys. TRL appends one cross-rank value per metric per
micro-batch (a gather and a host sync each) and logs the plain mean of those values over
the logging window, so micro-batches holding different numbers of tokens weigh the same,
and its ``clip_ratio/low_min``/``high_max`` are means of per-micro-batch extremes. Here
each micro-batch logs its per-token (or per-sequence, per-completion) values with their
true weights into an rlmetrics ``Tracker`` without waiting on the device, and ``log()``
merges the window across processes in one packed sync: every key then has the value one
process would log with the whole window in one micro-batch (see ``trl_loss`` and
``trl_rollout`` for each key's meaning). ``step_time`` is the slowest process's mean
seconds per optimizer step.

The hooks override private methods of ``trl==1.16.0`` (``_compute_loss``,
``_calculate_rewards``, ``_generate``, ``_generate_and_score_completions``,
``_log_metric``, ``log``); another TRL version is refused rather than trusted. Every
loss type and loss term of TRL 1.16 trains as in ``GRPOTrainer`` (the MoE load-balancing
loss, the entropy bonus, fixed or adaptive, the high-entropy token mask, the off-policy
sequence mask, either reward aggregation); vLLM generation is refused.

``extra_metrics=ExtraMetrics(...)`` (off by default) adds keys TRL does not have:
per value of a dataset column (``by_column``), quantiles of per-token quantities
(``token_quantiles``), tokens per second over the slowest process
(``tokens_per_second``). See docs/trl.md.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlmetrics.integrations._labels import DeclaringLabels
from rlmetrics.integrations._pins import refuse_untested
from rlmetrics.integrations.trl_loss import (
    TOKEN_QUANTILE_STATS,
    TOKEN_SUM_LOSS_TYPES,
    LossConfig,
    Normalizer,
    aggregate_loss,
    finish_loss,
    finish_token_quantiles,
    importance_ratio,
    kl_k3,
    log_extra_loss_terms,
    log_policy_metrics,
    log_token_quantiles,
    per_token_policy_loss,
)
from rlmetrics.integrations.trl_rollout import (
    finish_results,
    log_completions,
    log_rewards,
    zero_std_groups,
    zero_std_normalized_sum,
)
from rlmetrics.tracker import LogTarget, Tracker

try:
    import trl
    from trl import GRPOTrainer
except ImportError as err:  # pragma: no cover - exercised without trl installed
    raise ImportError(
        "rlmetrics.integrations.trl needs TRL 1.16.0, an optional extra: "
        "pip install 'rlmetrics[trl]' (or pip install trl==1.16.0)"
    ) from err

TESTED_TRL_VERSIONS = ("1.16.0",)

# TRL's keys that this trainer computes itself (TRL's own values are dropped)
OWNED_KEYS = frozenset(
    {
        "entropy",
        "kl",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_max",
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "step_time",
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "completions/mean_terminated_length",
        "completions/min_terminated_length",
        "completions/max_terminated_length",
    }
)
# multimodal inputs the forward pass takes, passed through as TRL passes them
_FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
BNPO_WARNING = (
    "ExactGRPOTrainer: loss_type='bnpo' averages the token means of micro-batches, so its "
    "loss and gradient depend on per_device_train_batch_size x gradient_accumulation_steps "
    "x processes; the logged `loss` is that split-dependent value (every other metric is "
    "split-invariant). loss_type='dapo' is the split-invariant token mean."
)
# the other loss terms TRL 1.16 computes per micro-batch, so that the objective (and the
# keys that report it) depends on the split: setting -> (why, the keys)
SPLIT_DEPENDENT_TERMS = {
    "router_aux_loss_coef": (
        "the MoE load-balancing loss is computed per micro-batch (a product of two means "
        "over its tokens, not a mean of per-token values)",
        "`aux_loss` and `loss`",
    ),
    "top_entropy_quantile": (
        "the entropy threshold is a quantile over one micro-batch's tokens (of every process)",
        "`policy_loss` and `loss`",
    ),
    "entropy_coef": ("the entropy bonus is one micro-batch's token mean", "`loss`"),
}


# the generation batch's key that carries each completion's label to the micro-batches
# (TRL shuffles and splits lists along with the tensors)
LABELS_KEY = "rlmetrics_by_column"


# tokens_per_second's hidden parts: the window's tokens (each micro-batch's attention
# mask, summed on its device at the fold), summed over processes, and the slowest
# process's seconds: a sum and a max in the packed sync, nothing read before it
WINDOW_TOKENS = "tokens_per_second/_tokens"
SLOWEST_SECONDS = "tokens_per_second/_slowest_seconds"


@dataclass(frozen=True, kw_only=True)
class ExtraMetrics:
    """Metrics ``ExactGRPOTrainer`` adds to TRL's keys, each exact like the rest and
    carried in the same packed sync (``ExactGRPOTrainer(..., extra_metrics=...)``).
    Every field is off by default; with all off (or ``extra_metrics=None``) no key or
    value changes.

    Attributes:
        by_column: a dataset column (for example ``"data_source"``): rewards, completion
            lengths, entropy, KL and clip ratios are also reported per value of the
            column as ``<key>/<value>`` (the value as ``str``). A process that holds no
            completion of some value reports the same keys as the others. The column's
            values in the train and eval datasets are read once, at construction, and
            every process names every value at every step, so a value that first turns
            up at a later step costs no extra collective (an ``IterableDataset`` has no
            values to read: there such a step agrees the names once).
        token_quantiles: ``entropy/{p50,p90,p99,max}``,
            ``importance_ratio/{p50,p90,p99,max}`` and, with ``beta > 0``,
            ``kl/{p50,p90,p99,max}`` over the window's completion tokens, from quantile
            sketches (within relative error 0.01; max exact; docs/quantiles.md).
        tokens_per_second: beside ``step_time``, ``tokens_per_second/total``: the
            tokens (prompt and completion) every process's training steps processed in
            the window, over the slowest process's time in them; ``tokens_per_second``:
            that divided by the number of processes (per process, as verl's
            ``perf/throughput``).
    """

    by_column: str | None = None
    token_quantiles: bool = False
    tokens_per_second: bool = False


def check_trl_version(version: str) -> None:
    """Refuse a TRL version these hooks were not tested against.

    Raises:
        RuntimeError: naming the installed and the tested versions.
    """
    otherwise = "use trl.GRPOTrainer (the private hooks these use may have changed)"
    refuse_untested("trl", "trl", version, TESTED_TRL_VERSIONS, otherwise)


def dataset_labels(datasets: Sequence[Any], column: str) -> list[str] | None:
    """The distinct values of ``column`` (as ``str``, sorted) over ``datasets`` (each a
    ``datasets.Dataset``, a dict of them as ``eval_dataset`` may be, a sized sequence of
    rows, or None), or None when one of them cannot be listed (an ``IterableDataset``).

    Raises:
        KeyError: a dataset lacks the column (naming it).
    """
    values: set[str] = set()
    queue = list(datasets)
    while queue:
        dataset = queue.pop()
        if dataset is None:
            continue
        if isinstance(dataset, dict):
            queue.extend(dataset.values())
            continue
        names = getattr(dataset, "column_names", None)
        if names is not None and hasattr(dataset, "unique"):
            if column not in names:
                raise KeyError(
                    f"ExtraMetrics(by_column={column!r}): the dataset has no column {column!r} "
                    f"(its columns: {sorted(names)})"
                )
            values.update(str(value) for value in dataset.unique(column))
        elif hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
            values.update(column_labels([dataset[i] for i in range(len(dataset))], column))
        else:
            return None
    return sorted(values)


# the settings this trainer refuses, and why
UNSUPPORTED = {
    "use_vllm": (
        "vLLM's importance-sampling correction of the loss and its sampling/* metrics are "
        "not implemented: vLLM does not run on the CPU, where these hooks are tested"
    ),
}


def _unsupported(trainer: Any) -> dict[str, str]:
    """The settings in effect whose loss terms or metrics this trainer does not
    implement, each with the reason."""
    checks = {"use_vllm": trainer.use_vllm}
    return {name: UNSUPPORTED[name] for name, bad in checks.items() if bad}


def split_dependence_warning(trainer: Any) -> str | None:
    """The warning for the loss terms in effect that TRL computes per micro-batch (None
    when there are none): the objective, and the keys that report it, then depend on
    the split, in ``GRPOTrainer`` as here."""
    in_effect = {
        "router_aux_loss_coef": trainer.aux_loss_enabled,
        "top_entropy_quantile": trainer.top_entropy_quantile < 1.0,
        "entropy_coef": trainer._entropy_bonus_enabled,
    }
    terms = [SPLIT_DEPENDENT_TERMS[name] for name, on in in_effect.items() if on]
    if not terms:
        return None
    why = "; ".join(f"{reason} ({keys})" for reason, keys in terms)
    return (
        f"ExactGRPOTrainer: as in trl.GRPOTrainer, {why}: the loss and its gradient depend "
        "on per_device_train_batch_size x gradient_accumulation_steps x processes, and "
        "those keys log that split-dependent value, exactly (every other metric is "
        "split-invariant for the same weights)."
    )


def column_labels(
    inputs: Sequence[dict[str, Any]], column: str, reserved: Sequence[str] = ()
) -> list[str]:
    """Each completion's label: its dataset row's value of ``column``, as ``str``.

    Raises:
        KeyError: a row lacks the column (naming it and the columns there are).
        ValueError: a value is one of ``reserved`` (the token quantiles' key parts,
            which ``entropy/<value>`` would clash with).
    """
    labels = []
    for row in inputs:
        if column not in row:
            raise KeyError(
                f"ExtraMetrics(by_column={column!r}): the dataset has no column {column!r} "
                f"(a row has {sorted(row)})"
            )
        labels.append(str(row[column]))
    clashing = set(labels) & set(reserved)
    if clashing:
        raise ValueError(
            f"ExtraMetrics: values {sorted(clashing)} of column {column!r} would give keys "
            "that token_quantiles reports (entropy/p50, ...); rename them"
        )
    return labels


class ExactGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` with exact, partition-invariant logged metrics.

    Takes exactly ``GRPOTrainer``'s arguments and trains identically (the loss is
    computed the same way); only what is logged changes, and how it is synced.
    ``extra_metrics`` (keyword, default None) adds the keys ``ExtraMetrics`` describes.

    Raises:
        RuntimeError: the installed TRL is not a tested version.
        ValueError: a setting whose loss or metrics this trainer does not implement
            (vLLM generation), with the reason.
    """

    # the adaptive entropy controller's state, which GRPOTrainer sets up (and checkpoints)
    entropy_coef: float
    _last_world_entropy: float
    _entropy_window_stats: torch.Tensor | None

    def __init__(
        self, *args: Any, extra_metrics: ExtraMetrics | None = None, **kwargs: Any
    ) -> None:
        check_trl_version(trl.__version__)
        super().__init__(*args, **kwargs)
        unsupported = _unsupported(self)
        if unsupported:
            reasons = "; ".join(f"{name}: {why}" for name, why in unsupported.items())
            raise ValueError(
                f"ExactGRPOTrainer does not implement these GRPOConfig settings: {reasons}. "
                "Use trl.GRPOTrainer for them"
            )
        self._loss_config = LossConfig(
            loss_type=self.loss_type,
            beta=self.beta,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            delta=self.args.delta,
            importance_sampling_level=self.importance_sampling_level,
            use_bias_correction_kl=self.args.use_bias_correction_kl,
            max_completion_length=self.max_completion_length,
            sapo_temperature_pos=self.args.sapo_temperature_pos,
            sapo_temperature_neg=self.args.sapo_temperature_neg,
        )
        if self.loss_type == "bnpo":
            warnings.warn(BNPO_WARNING, stacklevel=2)
        split_dependence = split_dependence_warning(self)
        if split_dependence is not None:
            warnings.warn(split_dependence, stacklevel=2)
        self.extra_metrics = extra_metrics or ExtraMetrics()
        self.exact_trackers = {"train": Tracker(), "eval": Tracker()}
        self._labelled_logs: dict[str, LogTarget] = dict(self.exact_trackers)
        column = self.extra_metrics.by_column
        if column is not None:
            datasets = (self.train_dataset, self.eval_dataset)
            labels = dataset_labels(datasets, column)
            if labels is not None:
                reserved = TOKEN_QUANTILE_STATS if self.extra_metrics.token_quantiles else ()
                column_labels([{column: label} for label in labels], column, reserved)
                self._labelled_logs = {
                    mode: DeclaringLabels(tracker, labels)
                    for mode, tracker in self.exact_trackers.items()
                }
        self._scored_rewards: torch.Tensor | None = None
        self._generation_labels: list[str] | None = None
        self._window_seconds = 0.0
        self._window_steps = 0

    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    def _labelled_log(self, mode: str) -> LogTarget:
        """Where the metrics logged per value of ``by_column`` go: the mode's tracker,
        through a view that names every value of the datasets' column at every call
        (``rlmetrics.integrations._labels``) when those values are known."""
        return self._labelled_logs[mode]

    # -- the loss, one micro-batch --------------------------------------------------
    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        """TRL's loss for this micro-batch, logging its metrics with true weights."""
        mode, config = self._mode(), self._loss_config
        completion_mask = inputs["completion_mask"]
        mask = completion_mask * inputs["tool_mask"] if "tool_mask" in inputs else completion_mask
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            inputs["completion_ids"].size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in _FORWARD_KEYS},
        )
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        old = inputs.get("old_per_token_logps")
        old = per_token_logps.detach() if old is None else old
        # TRL's own masks and weights (its gathers and formulas, so training is TRL's)
        keep, entropy_mask = self._loss_masks(
            inputs, entropies, mask, advantages, per_token_logps, old
        )
        gamma_weights = None
        if config.loss_type == "vespo":
            gamma_weights = self.get_gamma_weights(
                advantages=advantages,
                log_ratio_per_token=per_token_logps - old,
                mask=mask,
                importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
                k_pos=self.args.vespo_k_pos,
                lambda_pos=self.args.vespo_lambda_pos,
                k_neg=self.args.vespo_k_neg,
                lambda_neg=self.args.vespo_lambda_neg,
            )
        ratio = importance_ratio(per_token_logps, old, mask, config.importance_sampling_level)
        per_token_kl = None
        if config.beta != 0.0:
            per_token_kl = kl_k3(inputs["ref_per_token_logps"], per_token_logps)
            if config.use_bias_correction_kl:
                per_token_kl = per_token_kl * ratio
        per_token_loss = per_token_policy_loss(
            ratio,
            advantages,
            config,
            per_token_kl,
            per_token_logps=per_token_logps,
            gamma_weights=gamma_weights,
            keep=keep,
        )
        log = self.exact_trackers[mode]
        loss = aggregate_loss(per_token_loss, mask, config, self._normalizer(mode, inputs), log)
        steps = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        bonus = None
        if self._entropy_bonus_enabled:
            effective = mask if entropy_mask is None else mask * entropy_mask
            coefficient = self._entropy_coefficient()
            micro_mean = (entropies * effective).sum() / effective.sum().clamp(min=1.0)
            loss = loss - coefficient * (micro_mean / steps)
            bonus = coefficient * micro_mean
            if mode == "train":
                self._update_adaptive_entropy(entropies, effective)
                if self.accelerator.sync_gradients:  # the coefficient after the step, as TRL
                    log.last("entropy_coef", self.entropy_coef)
        if aux_loss is not None:  # the MoE load-balancing loss, scaled as TRL scales it
            loss = loss + self.router_aux_loss_coef * aux_loss / steps
        log_extra_loss_terms(log, entropy_bonus=bonus, aux_loss=aux_loss)
        log_policy_metrics(
            self._labelled_log(mode),
            mask=mask,
            entropies=entropies,
            ratio=ratio,
            advantages=advantages,
            per_token_kl=per_token_kl,
            config=config,
            gamma_weights=gamma_weights,
            by=inputs.get(LABELS_KEY),
        )
        if self.extra_metrics.tokens_per_second and mode == "train":
            log.sum(WINDOW_TOKENS, attention_mask)  # its elements' sum: the tokens
        if self.extra_metrics.token_quantiles:
            log_token_quantiles(
                log, mask=mask, entropies=entropies, ratio=ratio, per_token_kl=per_token_kl
            )
        return loss

    def _loss_masks(
        self,
        inputs: dict[str, Any],
        entropies: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor,
        per_token_logps: torch.Tensor,
        old_per_token_logps: torch.Tensor,
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The masks TRL multiplies the per-token loss by, in its order (the off-policy
        sequence mask, the high-entropy token mask), and the entropy mask alone (the
        entropy bonus acts on its tokens)."""
        keep = []
        if self.off_policy_mask_threshold is not None:
            keep.append(
                self.get_off_policy_mask(
                    advantages=advantages,
                    per_token_logps=per_token_logps,
                    sampling_per_token_logps=inputs.get(
                        "sampling_per_token_logps", old_per_token_logps
                    ),
                    mask=mask,
                    off_policy_threshold=self.off_policy_mask_threshold,
                )
            )
        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(
                entropies, mask, 1 - self.top_entropy_quantile
            )
            keep.append(entropy_mask)
        return keep, entropy_mask

    def _entropy_coefficient(self) -> float:
        """The coefficient this step's entropy bonus applies: ``entropy_coef``, or, under
        adaptive control, that only while the last step's entropy was at or below the
        target (TRL's gate)."""
        if not self.use_adaptive_entropy:
            return float(self.entropy_coef)
        gate_open = self._last_world_entropy <= self.args.entropy_target
        return float(self.entropy_coef) if gate_open else 0.0

    def _update_adaptive_entropy(self, entropies: torch.Tensor, effective: torch.Tensor) -> None:
        """TRL's adaptive entropy controller: sum the step's entropy over the tokens the
        bonus acts on, and at the step's end move ``entropy_coef`` by ``entropy_coef_delta``
        towards keeping the entropy (all processes' token mean) at ``entropy_target``.
        That mean is one reduce and one host read per optimizer step: the controller
        needs it before the next step, in GRPOTrainer as here."""
        if not self.use_adaptive_entropy:
            return
        stats = torch.stack([(entropies * effective).sum(), effective.sum()]).detach()
        window = self._entropy_window_stats
        window = stats if window is None else window + stats
        self._entropy_window_stats = window
        if not self.accelerator.sync_gradients:
            return
        totals = self.accelerator.reduce(window, reduction="sum")
        world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
        args, coef = self.args, float(self.entropy_coef)
        if world_entropy <= args.entropy_target:
            self.entropy_coef = min(coef + args.entropy_coef_delta, args.entropy_coef_max)
        else:
            self.entropy_coef = max(coef - args.entropy_coef_delta, args.entropy_coef_min)
        self._last_world_entropy = world_entropy
        self._entropy_window_stats = None

    def _normalizer(self, mode: str, inputs: dict[str, Any]) -> Normalizer:
        steps = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if self.loss_type not in TOKEN_SUM_LOSS_TYPES:
            return Normalizer(accumulation_steps=steps)
        tokens = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":  # one optimizer step's share of the generation batch
            tokens = tokens * steps / self.args.steps_per_generation
        return Normalizer(accumulation_steps=steps, dapo_tokens=tokens)

    # -- generation and rewards, once per generation batch --------------------------
    def _generate(self, prompts: list) -> tuple:
        output = super()._generate(prompts)
        _, completion_ids, tool_mask = output[:3]
        log_completions(
            self._labelled_log(self._mode()),
            completion_ids=completion_ids,
            tool_mask=tool_mask,
            stop_ids=[*self.eos_token_ids, self._tokenizer.pad_token_id],
            by=self._generation_labels,
        )
        return output

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, ids: Any) -> Any:
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, ids)
        self._scored_rewards = rewards_per_func  # every process's rows, in process order
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        column = self.extra_metrics.by_column
        reserved = TOKEN_QUANTILE_STATS if self.extra_metrics.token_quantiles else ()
        labels = None if column is None else column_labels(inputs, column, reserved)
        self._generation_labels = labels
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._generation_labels = None
        rewards_per_func, self._scored_rewards = self._scored_rewards, None
        if rewards_per_func is not None:
            self._log_rewards(rewards_per_func, len(inputs), labels)
        if labels is not None:
            output[LABELS_KEY] = labels
        return output

    def _log_rewards(
        self, rewards_per_func: torch.Tensor, num_local: int, labels: Sequence[str] | None
    ) -> None:
        mode = self._mode()
        weights = self.reward_weights.to(rewards_per_func.device)
        scored = ~torch.isnan(rewards_per_func).all(dim=1)
        rewards = torch.where(scored, (rewards_per_func * weights).nansum(dim=1), torch.nan)
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        if self.multi_objective_aggregation == "normalize_then_sum":
            is_std_zero = zero_std_normalized_sum(rewards_per_func, weights, num_generations)
        else:
            is_std_zero = zero_std_groups(rewards, num_generations, self.scale_rewards)
        start = self.accelerator.process_index * num_local
        local = slice(start, start + num_local)
        log_rewards(
            self._labelled_log(mode),
            rewards_per_func=rewards_per_func[local],
            reward_weights=weights,
            func_names=self.reward_func_names,
            is_std_zero=is_std_zero[local],
            by=labels,
        )

    def _log_metric(self, name: str, value: float) -> None:
        """A reward function's ``log_metric``: a mean over every call in the window, on
        every process (TRL's meaning), without TRL's gather per name."""
        self.exact_trackers[self._mode()].mean(name, value)

    # -- timing and logging ----------------------------------------------------------
    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        start = time.perf_counter()
        output = super().training_step(model, inputs, num_items_in_batch)
        self._window_seconds += time.perf_counter() - start
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._window_steps += 1
        return output

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Merge the window's metrics across processes (one packed sync) and log them
        under TRL's keys, in place of TRL's means of per-micro-batch values."""
        mode = self._mode()
        tracker = self.exact_trackers[mode]
        if mode == "train" and self._window_steps:
            tracker.max("step_time", self._window_seconds / self._window_steps)
            if self.extra_metrics.tokens_per_second:
                tracker.max(SLOWEST_SECONDS, self._window_seconds)
            self._window_seconds, self._window_steps = 0.0, 0
        results = finish_token_quantiles(finish_results(tracker.compute()))
        results = finish_loss(results, aux_loss_coef=self.router_aux_loss_coef)
        tokens, seconds = results.pop(WINDOW_TOKENS, None), results.pop(SLOWEST_SECONDS, None)
        if tokens is not None and seconds:
            results["tokens_per_second/total"] = tokens / seconds
            results["tokens_per_second"] = tokens / seconds / self.accelerator.num_processes
        trl_metrics = self._metrics[mode]
        for key in [key for key in trl_metrics if key in OWNED_KEYS or key in results]:
            del trl_metrics[key]
        if mode == "train" and "loss" in results:
            logs["loss"] = results.pop("loss")
        for key, value in results.items():
            trl_metrics[key] = [value]
        super().log(logs, start_time)


__all__ = [
    "BNPO_WARNING",
    "TESTED_TRL_VERSIONS",
    "ExactGRPOTrainer",
    "ExtraMetrics",
    "check_trl_version",
]
