"""PPO/GRPO losses and batch metrics that log their true weights.

Two promises (the contract of docs/concepts.md):

1. The loss a helper returns is scaled for backward with the mini-batch's *global*
   token and sequence counts and with the gradient reduction's ``1/dp_size`` undone, so
   the micro-batch gradients summed on each rank and averaged over ranks (as DDP/FSDP
   do) equal the gradient of the whole mini-batch on one rank.
2. The metric updates a helper returns carry their meaning (a kind and a weight), never
   that scale, so merging micro-batches, ranks, mini-batches and epochs through a
   ``Tracker`` gives the whole-batch value, however the batch was split.

Helpers are pure (STYLE rule 14): tensors in, ``LossOutput(loss, updates)`` out; they
never log or sync. ``log_updates`` puts updates into a tracker.

Entry points:

* counts: ``global_counts(mask, group=None)`` -> ``BatchCounts`` (one all_reduce per
  mini-batch; no-op without a process group).
* losses (-> ``LossOutput``): ``ppo_policy_loss`` (asymmetric and dual clip, rollout
  importance weights), ``kl_loss``, ``entropy_loss``, ``value_loss``.
* per-token helpers: ``kl_estimate`` (kl/k1, abs, mse/k2, low_var_kl/k3, and their
  straight-through ``+`` forms), ``entropy_from_logits``, ``kl_penalty_rewards`` (KL as
  an in-reward penalty).
* advantages (whole batch, before splitting): ``grpo_advantages`` (std normalisation
  optional: ``norm_by_std=False`` is Dr.GRPO), ``gae``, ``masked_whiten``.
* metric updates (-> list of ``MetricUpdate``): ``batch_metrics``, ``grad_norm_updates``,
  ``lr_update``, ``kl_coef_update``, ``perf_updates``, ``entropy_metric`` (verl's
  ``actor/entropy``), ``loss_update`` (``actor/loss``: a sum of objectives); ``timer``
  logs ``timing_s/<stage>`` (rank-aware: ``rlmetrics.timing``); ``log_updates(tracker,
  updates)`` applies updates.
* aggregation modes (``agg=``): ``AGG_MODES`` = token-mean, token-sum,
  seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm (needs
  ``norm_constant``).
* your own per-token loss ``l``: ``aggregate(l, mask, counts, agg)`` is the loss for
  backward, ``objective_update(name, l, mask, counts, agg)`` its metric;
  ``token_mean(name, values, mask)`` logs a per-token mean.

One training step (every rank runs the same code)::

    tracker = Tracker()
    for epoch in range(num_epochs):
        for mini in split(batch, num_mini_batches):  # one optimizer step each
            counts = rl.global_counts(mini["response_mask"], group=dp_group)
            for mb in split(mini, micro_batch_size):  # or by a token budget
                logits, values = model(mb)  # logp: log-probs of the sampled tokens
                logp = gather_log_probs(logits, mb["responses"])
                pg = rl.ppo_policy_loss(logp, mb["old_log_probs"], mb["advantages"],
                                        mb["response_mask"], counts=counts, agg="token-mean")
                kl = rl.kl_loss(logp, mb["ref_log_probs"], mb["response_mask"], counts=counts)
                (pg.loss + kl_coef * kl.loss).backward()  # summed over mbs: exact grad
                rl.log_updates(tracker, pg.updates + kl.updates)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            rl.log_updates(tracker, rl.grad_norm_updates(grad_norm) + [rl.lr_update(opt)])
            opt.step(); opt.zero_grad()
    scheduler.step()  # after lr_update: actor/lr is the lr these updates used
    metrics = tracker.compute(group=dp_group)  # one packed sync for everything

Loss metrics (``actor/pg_loss``, ``actor/kl_loss``, ``actor/entropy_loss``,
``critic/vf_loss``) are each mini-batch's objective, averaged over the step's optimizer
steps. Fractions and means marked "per token" (``actor/pg_clipfrac``, ``actor/ppo_kl``,
``actor/entropy_token_mean``, ...) are token-weighted over all the step's tokens. See
docs/rl.md for the scaling derivation, the metric table (kind and weight of every
name) and every deliberate difference from verl.
"""

from rlmetrics.rl.advantages import gae, grpo_advantages, masked_whiten
from rlmetrics.rl.aggregate import AGG_MODES, aggregate, loss_update, objective_update
from rlmetrics.rl.batch import batch_metrics
from rlmetrics.rl.counts import BatchCounts, global_counts
from rlmetrics.rl.entropy import entropy_from_logits, entropy_loss, entropy_metric
from rlmetrics.rl.explained_var import ExplainedVar, ensure_registered, explained_var_update
from rlmetrics.rl.kl import KL_ESTIMATORS, kl_coef_update, kl_estimate, kl_loss, kl_penalty_rewards
from rlmetrics.rl.optim import grad_norm_updates, lr_update
from rlmetrics.rl.policy import ppo_policy_loss, ppo_token_losses
from rlmetrics.rl.timing import perf_updates, timer
from rlmetrics.rl.types import LossOutput
from rlmetrics.rl.updates import MetricUpdate, log_updates, token_mean
from rlmetrics.rl.value import value_loss

ensure_registered()

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "BatchCounts",
    "ExplainedVar",
    "LossOutput",
    "MetricUpdate",
    "aggregate",
    "batch_metrics",
    "entropy_from_logits",
    "entropy_loss",
    "entropy_metric",
    "explained_var_update",
    "gae",
    "global_counts",
    "grad_norm_updates",
    "grpo_advantages",
    "kl_coef_update",
    "kl_estimate",
    "kl_loss",
    "kl_penalty_rewards",
    "log_updates",
    "loss_update",
    "lr_update",
    "masked_whiten",
    "objective_update",
    "perf_updates",
    "ppo_policy_loss",
    "ppo_token_losses",
    "timer",
    "token_mean",
    "value_loss",
]
