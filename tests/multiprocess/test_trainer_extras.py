"""The reference trainer's opt-in metrics (``MetricsConfig``, trainer/extras.py).

One launch of 2 gloo ranks trains a tiny float64 run (GRPO, then PPO) with the switches
off, on, and off again. The batch of 4 prompts x 2 samples is cut into 2 mini-batches
of 2 rows per rank and trained for 2 epochs, so at step 1 one rank holds no row of one
data source (asserted). The ranks record, without changing anything, the tensors every
update objective saw (``actor_objective``/``critic_objective`` wrapped); the parent then
computes each per-source metric and token quantile with numpy over the whole batch
(both ranks' rows) and compares. Collectives are counted per step in each run.
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rlmetrics.trainer import AlgoConfig, ModelConfig, RunConfig, TaskConfig, TrainConfig
from rlmetrics.trainer import update as update_module
from rlmetrics.trainer.config import MetricsConfig
from rlmetrics.trainer.model import build_models
from rlmetrics.trainer.perf import CPU_PEAK_FLOPS, model_flops
from rlmetrics.trainer.task import SOURCES, Task

from gloo_ranks import count_collectives, ok_results, run_ranks

train_module = importlib.import_module(
    "rlmetrics.trainer.train"
)  # the package's `train` is the function
ALL_ON = MetricsConfig(per_source=True, token_quantiles=True, update_timing=True)
MEASURED = ("timing_s/", "timing_per_token_ms/", "perf/", "actor/perf/", "critic/perf/")
STEPS = 3
ALPHA = 0.01  # the default quantile sketch's relative error (docs/quantiles.md)
UNDERFLOW = 5e-10  # its absolute error below 1e-9
ACTOR_PER_SOURCE = ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
                    "actor/ppo_kl", "actor/entropy_loss", "actor/entropy_token_mean",
                    "actor/kl_loss", "actor/loss", "actor/entropy")  # fmt: skip
CRITIC_PER_SOURCE = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/loss")
QUANTILE_NAMES = ("actor/token_entropy", "actor/importance_ratio", "actor/token_kl")
STATS = ("p50", "p90", "p99", "max", "min", "mean", "std")
TIMING = ("actor/update_time_s", "critic/update_time_s")


def config(algo: str, metrics: MetricsConfig) -> TrainConfig:
    """4 prompts x 2 samples (float64), 2 mini-batches, 2 epochs, micro-batches of 1."""
    return TrainConfig(
        task=TaskConfig(num_symbols=3, max_prompt_len=4, source_split=2),
        model=ModelConfig(n_layer=1, n_head=2, n_embd=16, dtype="float64"),
        algo=AlgoConfig(
            algo=algo,
            num_prompts=4,
            samples_per_prompt=2,
            mini_batches=2,
            epochs=2,
            micro_batch_size=1,
            warmup_steps=1,
            clip_low=0.05,
            clip_high=0.05,
            lr=0.05,
            critic_lr=0.05,
            kl_coef=0.1,
        ),
        run=RunConfig(steps=STEPS, seed=1, progress=False, loggers="", log_every=0),
        metrics=metrics,
    )


def host(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().cpu().numpy()


class Recorder:
    """Wraps the update objectives and ``train_step`` to record what they saw: for each
    call on the whole micro-batch (not the per-source re-evaluations), its tensors and
    the optimizer step it belongs to; per training step, the collectives it made."""

    def __init__(self, patch: pytest.MonkeyPatch) -> None:
        self.calls: list[dict[str, Any]] = []
        self.collectives: list[int] = []
        self.step = 0
        self.counts_seen: dict[str, tuple[int, Any]] = {}
        self.live = count_collectives(patch)
        for name in ("actor_objective", "critic_objective"):
            patch.setattr(update_module, name, self.wrap(name, getattr(update_module, name)))
        patch.setattr(train_module, "train_step", self.wrap_step(train_module.train_step))

    def wrap_step(self, original: Any) -> Any:
        def train_step(r: Any, step: int, tracker: Any) -> dict[str, float]:
            self.step = step
            before = self.live["n"]
            out = original(r, step, tracker)
            self.collectives.append(self.live["n"] - before)
            return out

        return train_step

    def wrap(self, name: str, original: Any) -> Any:
        """``actor_objective(logp, entropy, mb, mask, counts, cfg)`` or
        ``critic_objective(values, mb, mask, counts, cfg)``, recording its inputs."""
        actor = name == "actor_objective"

        def objective(*args: Any) -> Any:
            mb, mask, counts = args[2:5] if actor else args[1:4]
            if mask is mb["mask"]:  # the whole micro-batch, not one source's part
                index, last = self.counts_seen.get(name, (-1, None))
                if counts is not last:  # a new mini-batch (new global counts)
                    index, last = index + 1, counts
                    self.counts_seen[name] = index, last
                lengths = mb["prompt_lengths"] + mb["response_lengths"] - 1  # model input
                row = {"who": name, "step": self.step, "opt_step": index, "mask": host(mask),
                       "source": host(mb["source"]), "seq_len": host(lengths)}  # fmt: skip
                if actor:
                    row |= {"logp": host(args[0]), "entropy": host(args[1]),
                            "old": host(mb["old_log_probs"]), "adv": host(mb["advantages"]),
                            "ref": host(mb["ref_log_probs"])}  # fmt: skip
                else:
                    row |= {"values": host(args[0]), "old_values": host(mb["values"]),
                            "returns": host(mb["returns"])}  # fmt: skip
                self.calls.append(row)
            return original(*args)

        return objective


def runs_on_each_rank(rank: int, world: int) -> dict[str, Any]:
    """Per algo: the switches off, on, off again, each with what it recorded."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for algo in ("grpo", "ppo"):
        for label, metrics in (("off", MetricsConfig()), ("on", ALL_ON), ("off2", MetricsConfig())):
            group = dist.new_group([0, 1])
            with pytest.MonkeyPatch.context() as patch:
                rec = Recorder(patch)
                history = train_module.train(config(algo, metrics), rank, world, group=group,
                                             report=False)  # fmt: skip
            out[algo, label] = {"history": history, "calls": rec.calls,
                                "collectives": rec.collectives}  # fmt: skip
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return ok_results(run_ranks(runs_on_each_rank, 2, timeout=300))


def measured(key: str) -> bool:
    return key.startswith(MEASURED) or key.startswith(TIMING)


def invariant(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not measured(k)}


# -- numpy over the whole batch ---------------------------------------------------------
def cat(rows: list[dict], key: str) -> np.ndarray:
    """``key`` of the records, (B, T) ones padded to the widest, stacked by rows."""
    arrays = [r[key] for r in rows]
    if arrays[0].ndim == 1:
        return np.concatenate(arrays)
    width = max(a.shape[1] for a in arrays)
    return np.concatenate([np.pad(a, ((0, 0), (0, width - a.shape[1]))) for a in arrays])


def actor_tokens(rows: list[dict], cfg: AlgoConfig) -> dict[str, np.ndarray]:
    """Per-token quantities of the actor's loss terms for the records' tokens (numpy)."""
    logp, old, adv, ref = (cat(rows, k) for k in ("logp", "old", "adv", "ref"))
    log_ratio = np.clip(logp - old, -20, 20)
    ratio = np.exp(log_ratio)
    unclipped = -adv * ratio
    clipped_term = -adv * np.clip(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
    loss = np.maximum(unclipped, clipped_term)
    dual = -adv * cfg.clip_ratio_c
    lower = (loss > dual) & (adv < 0)
    loss = np.where(adv < 0, np.minimum(loss, dual), loss)
    neg = np.clip(ref - logp, -20, 20)  # low_var_kl (k3) at d = logp - ref
    kl = np.clip(np.exp(neg) - neg - 1, -10, 10)
    return {"pg_loss": loss, "pg_clipfrac": (clipped_term > unclipped) * 1.0,
            "pg_clipfrac_lower": lower * 1.0, "ppo_kl": -log_ratio, "ratio": ratio,
            "entropy": cat(rows, "entropy"), "kl": kl}  # fmt: skip


def critic_tokens(rows: list[dict], cfg: AlgoConfig) -> dict[str, np.ndarray]:
    v, old, ret = (cat(rows, k) for k in ("values", "old_values", "returns"))
    moved = v - old
    outside = np.abs(moved) > cfg.vf_clip
    vc = np.where(outside, old + np.clip(moved, -cfg.vf_clip, cfg.vf_clip), v)
    unclipped, clipped = (v - ret) ** 2, (vc - ret) ** 2
    return {"vf_loss": 0.5 * np.maximum(unclipped, clipped),
            "vf_clipfrac": (outside & (clipped > unclipped)) * 1.0, "vpred": v}  # fmt: skip


def source_mask(rows: list[dict], source: int) -> np.ndarray:
    return cat(rows, "mask").astype(bool) & (cat(rows, "source") == source)[:, None]


def per_source_expected(calls: list[dict], step: int, cfg: AlgoConfig) -> dict[str, float]:
    """Each per-source update metric of ``step`` from numpy over both ranks' records:
    token means over every update token of the source; objectives (token-mean mode) as
    the mean over optimizer steps of the source's token mean in that step."""
    out: dict[str, float] = {}
    for who in ("actor_objective", "critic_objective"):
        rows = [c for c in calls if c["who"] == who and c["step"] == step]
        if not rows:
            continue
        tokens = (actor_tokens if who == "actor_objective" else critic_tokens)(rows, cfg)
        opt_steps = np.concatenate([np.full(len(r["source"]), r["opt_step"]) for r in rows])
        for s, source in enumerate(SOURCES):
            mask = source_mask(rows, s)
            if not mask.any():
                continue

            def token_mean(x: np.ndarray, m: np.ndarray = mask) -> float:
                return float(x[m].mean())

            def objective(x: np.ndarray, m: np.ndarray = mask, k: np.ndarray = opt_steps) -> float:
                steps = [i for i in np.unique(k) if m[k == i].any()]
                return float(np.mean([x[m & (k == i)[:, None]].mean() for i in steps]))

            if who == "actor_objective":
                pg, ent, kl = (objective(tokens[k]) for k in ("pg_loss", "entropy", "kl"))
                values = {"actor/pg_loss": pg, "actor/entropy_loss": ent, "actor/kl_loss": kl,
                          "actor/loss": pg - cfg.entropy_coef * ent + cfg.kl_coef * kl,
                          "actor/entropy_token_mean": token_mean(tokens["entropy"])}  # fmt: skip
                for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
                    values[f"actor/{k}"] = token_mean(tokens[k])
            else:
                vf = objective(tokens["vf_loss"])
                values = {"critic/vf_loss": vf, "critic/loss": vf,
                          "critic/vf_clipfrac": token_mean(tokens["vf_clipfrac"]),
                          "critic/vpred_mean": token_mean(tokens["vpred"])}  # fmt: skip
            out |= {f"{name}/{source}": value for name, value in values.items()}
    return out


def quantiles_expected(calls: list[dict], step: int) -> dict[str, np.ndarray]:
    """Every update token of ``step``, both ranks: entropy, ratio, KL."""
    rows = [c for c in calls if c["who"] == "actor_objective" and c["step"] == step]
    tokens = actor_tokens(rows, AlgoConfig())
    mask = cat(rows, "mask").astype(bool)
    return {name: tokens[k][mask] for name, k in zip(QUANTILE_NAMES, ("entropy", "ratio", "kl"),
                                                      strict=True)}  # fmt: skip


def both_ranks_calls(ranks: list[dict], key: tuple) -> list[dict]:
    return [call for rank in ranks for call in rank[key]["calls"]]


# -- the tests --------------------------------------------------------------------------
def test_one_rank_holds_no_row_of_a_source(ranks) -> None:
    """At step 1 some rank's update saw one source only, while the batch held both."""
    for algo in ("grpo", "ppo"):
        seen = [{int(s) for c in rank[algo, "on"]["calls"] if c["step"] == 1
                 for s in c["source"]} for rank in ranks]  # fmt: skip
        assert set().union(*seen) == {0, 1}, seen
        assert any(len(s) == 1 for s in seen), seen


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_every_per_source_value_equals_numpy_over_the_whole_batch(ranks, algo) -> None:
    cfg = config(algo, ALL_ON).algo
    calls = both_ranks_calls(ranks, (algo, "on"))
    names = ACTOR_PER_SOURCE + (CRITIC_PER_SOURCE if algo == "ppo" else ())
    for step, got in enumerate(ranks[0][algo, "on"]["history"], start=1):
        want = per_source_expected(calls, step, cfg)
        assert want, step
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (step, key)
        for name in names:  # every per-source key is there, none unexpected
            reported = {k for k in got if k.startswith(f"{name}/") and k.rsplit("/", 1)[1]
                        in SOURCES}  # fmt: skip
            assert reported == {k for k in want if k.startswith(f"{name}/")} or (
                name == "actor/entropy"), (step, name, reported)  # fmt: skip
        entropy = [got[f"actor/entropy/{s}"] for s in SOURCES if f"actor/entropy/{s}" in got]
        assert entropy and min(entropy) - 1e-12 <= got["actor/entropy"] <= max(entropy) + 1e-12


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_old_policy_entropy_per_source_is_the_token_weighted_part(ranks, algo) -> None:
    """actor/entropy (token-mean) is the whole batch's mean; its per-source values
    weighted by each source's response tokens (one epoch's records) give it back."""
    calls = both_ranks_calls(ranks, (algo, "on"))
    for step, got in enumerate(ranks[0][algo, "on"]["history"], start=1):
        rows = [c for c in calls if c["who"] == "actor_objective" and c["step"] == step]
        start = min(c["opt_step"] for c in rows)
        first_epoch = [c for c in rows if c["opt_step"] < start + 2]  # 2 mini-batches each
        counts = {s: source_mask(first_epoch, i).sum() for i, s in enumerate(SOURCES)}
        parts = sum(n * got[f"actor/entropy/{s}"] for s, n in counts.items() if n)
        assert parts / sum(counts.values()) == pytest.approx(got["actor/entropy"], rel=1e-12)


def test_token_quantiles_are_within_the_sketch_bound(ranks) -> None:
    calls = both_ranks_calls(ranks, ("grpo", "on"))
    for step, got in enumerate(ranks[0]["grpo", "on"]["history"], start=1):
        for name, tokens in quantiles_expected(calls, step).items():
            assert got[f"{name}/max"] == pytest.approx(tokens.max(), rel=1e-12)
            assert got[f"{name}/min"] == pytest.approx(tokens.min(), rel=1e-12, abs=1e-300)
            assert got[f"{name}/mean"] == pytest.approx(tokens.mean(), rel=1e-9, abs=1e-12)
            for q in (0.5, 0.9, 0.99):
                true = np.quantile(tokens, q, method="lower")
                estimate = got[f"{name}/p{round(q * 100)}"]
                assert abs(estimate - true) <= ALPHA * abs(true) + UNDERFLOW, (step, name, q)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_update_time_is_the_slowest_rank_and_mfu_the_whole_step_over_it(ranks, algo) -> None:
    cfg = config(algo, ALL_ON)
    calls = both_ranks_calls(ranks, (algo, "on"))
    learners = ("actor", "critic") if algo == "ppo" else ("actor",)
    for step, got in enumerate(ranks[0][algo, "on"]["history"], start=1):
        for learner in learners:
            name = f"{learner}/update_time_s"
            assert got[f"{name}/min"] <= got[f"{name}/mean"] <= got[name]
            assert got[f"{name}/slowest_rank"] in (0, 1)
            who = f"{learner}_objective"
            rows = [c for c in calls if c["who"] == who and c["step"] == step]
            lens = torch.from_numpy(cat(rows, "seq_len"))  # every pass: epochs x the batch
            task = Task(cfg.task)
            actor, _, critic = build_models(cfg.model, task.vocab_size, task.block_size,
                                            critic=algo == "ppo", seed=0)  # fmt: skip
            net = actor if learner == "actor" else critic
            flops = model_flops(net, lens, n_layer=cfg.model.n_layer, n_embd=cfg.model.n_embd)
            want = flops / got[name] / CPU_PEAK_FLOPS / 2
            assert got[f"perf/mfu/{learner}"] == pytest.approx(want, rel=1e-12), (step, learner)
        assert not any(k.startswith("perf/_") for k in got)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_keys_and_values_agree_on_both_ranks(ranks, algo) -> None:
    for label in ("off", "on"):
        h0, h1 = (rank[algo, label]["history"] for rank in ranks)
        for m0, m1 in zip(h0, h1, strict=True):
            assert set(m0) == set(m1)
            assert invariant(m0) == invariant(m1)
            synced = [k for k in m0 if k.startswith((*TIMING, "perf/mfu/actor", "perf/mfu/critic"))]
            if label == "on":  # the slowest rank's time and the MFU over it: one number
                assert all(m0[k] == m1[k] for k in synced), synced


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_off_logs_exactly_the_keys_and_values_without_the_switch(ranks, algo) -> None:
    """Off, then on, then off again: the off runs agree with each other, and the on run
    has every off key with the same value (the measurements aside) plus its own keys."""
    off, on, off2 = (ranks[0][algo, label]["history"] for label in ("off", "on", "off2"))
    added_prefixes = tuple(f"{n}/" for n in ACTOR_PER_SOURCE + CRITIC_PER_SOURCE
                           + QUANTILE_NAMES) + TIMING  # fmt: skip
    for a, b, c in zip(off, on, off2, strict=True):
        assert set(a) == set(c) and invariant(a) == invariant(c)
        added = set(b) - set(a)
        assert added and all(k.startswith(added_prefixes) for k in added), sorted(added)
        assert not any(k.rsplit("/", 1)[-1] in STATS and k.startswith(QUANTILE_NAMES) for k in a)
        assert set(a) <= set(b)
        assert {k: v for k, v in invariant(b).items() if k in a} == invariant(a)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_collectives_per_step_are_the_same_with_the_switches_on(ranks, algo) -> None:
    for rank in ranks:
        off, on = rank[algo, "off"]["collectives"], rank[algo, "on"]["collectives"]
        assert len(off) == STEPS and off == on, (off, on)


def test_default_config_has_every_switch_off() -> None:
    assert TrainConfig().metrics == MetricsConfig()
    assert replace(ALL_ON, per_source=False, token_quantiles=False, update_timing=False) == (
        MetricsConfig()
    )


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_off_runs_none_of_the_extras(algo, monkeypatch) -> None:
    """Off, the trainer takes today's path: no extra is evaluated, nothing is hidden in
    the sync (``finish`` finds nothing to pop), the counts come from rl.global_counts."""
    from rlmetrics.trainer import extras

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("an opt-in metric ran with every switch off")

    for name in ("global_source_counts", "per_source", "token_quantiles", "ideal_seconds"):
        monkeypatch.setattr(extras, name, refuse)
    real_finish = extras.finish

    def finish(metrics: dict[str, float]) -> dict[str, float]:
        before = dict(metrics)
        assert real_finish(metrics) == before
        return metrics

    monkeypatch.setattr(extras, "finish", finish)
    history = train_module.train(replace(config(algo, MetricsConfig()), run=RunConfig(
        steps=2, seed=1, progress=False, loggers="", log_every=0)), report=False)  # fmt: skip
    assert len(history) == 2 and "actor/pg_clipfrac" in history[0]
