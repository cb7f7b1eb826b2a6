"""rlmetrics.rl against verl's formulas (tests/_support/verl_formulas.py, numpy), difference by
difference.

Every rlmetrics.rl function runs over random float64 batches with ragged masks, holes,
fully masked rows and aborted (empty) responses, split by ``assert_partition_invariant``
over 1/2/4 simulated ranks, micro-batch sizes and token budgets; its whole-batch value
must equal verl's formula to ~1e-12 with verl's stabilising epsilons set to 0. Where
rlmetrics differs on purpose, the difference is named in DIFFERENCES with its reason,
and a test below shows it where it is claimed (and only there).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import verl_formulas as verl
from rlmetrics import Tracker, rl
from rlmetrics.testing import assert_partition_invariant

RTOL = 1e-12
CLIP = {"clip_low": 0.2, "clip_high": 0.28, "clip_ratio_c": 3.0}
VERL_CLIP = {"low": 0.2, "high": 0.28, "c": 3.0}
B, T, V = 9, 6, 5

DIFFERENCES = {
    "masked_mean_eps": "verl divides masked means by count + 1e-8 (pg_clipfrac, ppo_kl, "
    "vf_clipfrac, vpred_mean, the per-sequence mean of seq-mean-token-mean, whitening); "
    "rlmetrics reports the exact ratio, so a metric does not move with the token count",
    "explained_var_eps": "verl reports 1 - Var(R - V) / (Var(R) + 1e-5), which is far from "
    "the explained variance when returns are small; rlmetrics reports the exact ratio (NaN "
    "when Var(R) = 0)",
    "empty_metrics": "verl's masked mean of no tokens is 0 and its score metrics of an "
    "all-aborted batch NaN; rlmetrics leaves an empty metric out (DESIGN: never a fake 0)",
    "micro_batch_means": "verl averages per-token fractions (pg_clipfrac, ppo_kl, "
    "pg_clipfrac_lower, vf_clipfrac) as means of micro-batch means; rlmetrics weighs every "
    "token once, so the value does not depend on the split (equal for one micro-batch)",
    "reward_kl_penalty": "verl's actor/reward_kl_penalty is the mean over rows of each "
    "row's token mean (an empty row counts as 0); rlmetrics keeps the token mean over all "
    "valid tokens, which merges exactly over any split",
    "dual_clip_default": "verl always applies the dual clip (c = 3 unless set); "
    "rlmetrics.rl.ppo_policy_loss applies it when clip_ratio_c is given (the reference "
    "trainer passes 3, verl's default)",
    "norm_constant_required": "seq-mean-token-sum-norm: verl's default constant is the "
    "padded width of the micro-batch, which changes with the split; rlmetrics requires a "
    "fixed norm_constant",
    "gae_outside_mask": "verl's GAE leaves the carried advantage at masked positions; "
    "rlmetrics writes 0 there (valid tokens agree)",
    "whiten_few_tokens": "masked_whiten over fewer than two valid tokens: verl raises, "
    "rlmetrics gives 0 (or the mean with shift_mean=False)",
    "clip_ratio_ge": "response_length/clip_ratio: verl tests length == the padded width; "
    "rlmetrics tests length >= the configured maximum (the padded width changes with the "
    "split); equal when the maximum is the padded width",
    "throughput_slowest_rank": "perf/throughput: verl divides all tokens by the driver's "
    "step time × GPUs; rlmetrics by the slowest rank's step time × ranks (the driver's "
    "time also holds its own work between the ranks' steps)",
}


def make_batch(seed: int, b: int = B, t: int = T) -> dict[str, torch.Tensor]:
    """Ragged masks with holes, a fully masked row and an aborted (empty) response."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, t + 1, b)
    lengths[0], lengths[-1] = 0, t
    mask = (np.arange(t)[None, :] < lengths[:, None]) & (rng.random((b, t)) > 0.15)
    mask[1] = False
    plengths = rng.integers(0, 4, b)
    token_scores = np.zeros((b, t))
    last = np.maximum(lengths - 1, 0)
    token_scores[np.arange(b), last] = np.where(lengths > 0, rng.normal(size=b), 0.0)
    arr = {
        "mask": mask,
        "prompt_mask": np.arange(3)[None, :] < plengths[:, None],
        "logp": rng.normal(-1.5, 0.5, (b, t)),
        "old": rng.normal(-1.5, 0.5, (b, t)),
        "ref": rng.normal(-1.5, 0.7, (b, t)),
        "adv": rng.normal(0, 1, (b, t)) * 2,
        "logits": rng.normal(0, 2, (b, t, V)),
        "v": rng.normal(0, 1, (b, t)),
        "v_old": rng.normal(0, 1, (b, t)),
        "ret": rng.normal(0, 1, (b, t)),
        "token_scores": token_scores,
        "token_rewards": token_scores - 0.1 * rng.random((b, t)) * mask,
    }
    if b > 2 and t > 1:  # two log-ratios beyond the ±20 clamp
        arr["old"][2, :2] = arr["logp"][2, :2] + np.array([25.0, -25.0])
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arr.items()}


def np_batch(batch: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in batch.items()}


def assert_equal(got: dict, want: dict, rtol: float = RTOL, label: str = "") -> None:
    assert set(want) <= set(got), (label, set(want) - set(got))
    for key, value in want.items():
        a = got[key]
        ok = (math.isnan(a) and math.isnan(value)) or abs(a - value) <= rtol * max(1, abs(value))
        assert ok, f"{label} {key}: rlmetrics {a!r}, verl {value!r}"


# -- losses and their metrics ---------------------------------------------------------------
def named(updates: list[rl.MetricUpdate], name: str) -> rl.MetricUpdate:
    return next(u for u in updates if u.name == name)


def log_losses(piece, tracker: Tracker, agg: str, estimator: str) -> None:
    kw = {"counts": piece.counts, "agg": agg, "norm_constant": float(T)}
    m = piece["mask"]
    pg = rl.ppo_policy_loss(piece["logp"], piece["old"], piece["adv"], m, **CLIP, **kw)
    kl = rl.kl_loss(piece["logp"], piece["ref"], m, estimator=estimator, **kw)
    ent_tok = rl.entropy_from_logits(piece["logits"])
    ent = rl.entropy_loss(ent_tok, m, **kw)
    vf = rl.value_loss(piece["v"], piece["v_old"], piece["ret"], m, cliprange_value=0.3, **kw)
    terms = [(1.0, named(pg.updates, "actor/pg_loss")), (0.1, named(kl.updates, "actor/kl_loss")),
             (-0.01, named(ent.updates, "actor/entropy_loss"))]  # fmt: skip
    rl.log_updates(tracker, [*pg.updates, *kl.updates, *ent.updates, *vf.updates,
                             rl.loss_update("actor/loss", terms),
                             rl.entropy_metric(ent_tok, m, agg, float(T))])  # fmt: skip


def verl_losses(b: dict, agg: str, estimator: str, eps: float) -> dict:
    """verl's metrics of the whole batch as one mini-batch and one micro-batch."""
    m = b["mask"]
    pg = verl.policy_loss(b["old"], b["logp"], b["adv"], m, **VERL_CLIP, mode=agg, eps=eps)
    kl = verl.agg_loss(verl.kl_penalty(b["logp"], b["ref"], estimator), m, agg, eps=eps)
    ent = verl.agg_loss(verl.entropy(b["logits"]), m, agg, eps=eps)
    vf = verl.value_loss(b["v"], b["v_old"], b["ret"], m, clip=0.3, mode=agg, eps=eps)
    loss = pg["actor/pg_loss"] - 0.01 * ent + 0.1 * kl
    extra = {"actor/kl_loss": kl, "actor/entropy_loss": ent, "actor/entropy": ent}
    return {**pg, **vf, **extra, "actor/loss": loss}


@pytest.mark.parametrize(
    ("agg", "estimator"),
    [("token-mean", "low_var_kl"), ("token-sum", "k3+"), ("seq-mean-token-sum", "kl"),
     ("seq-mean-token-mean", "abs+"), ("seq-mean-token-sum-norm", "k1+")],
)  # fmt: skip
def test_losses_equal_verl_under_every_split(agg: str, estimator: str) -> None:
    batch = make_batch(seed=len(agg))
    got = assert_partition_invariant(
        lambda piece, tracker: log_losses(piece, tracker, agg, estimator), batch, mask_key="mask"
    )
    assert_equal(got, verl_losses(np_batch(batch), agg, estimator, eps=0.0), label=agg)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), b=st.integers(2, 7), t=st.integers(1, 7),
       agg=st.sampled_from(rl.AGG_MODES), estimator=st.sampled_from(rl.KL_ESTIMATORS))  # fmt: skip
def test_random_shapes_equal_verl_on_one_piece(seed, b, t, agg, estimator) -> None:
    batch = make_batch(seed, b, t)
    if not batch["mask"].any():
        return
    tracker = Tracker()
    kw = {"counts": None, "agg": agg, "norm_constant": float(t)}
    m = batch["mask"]
    pg = rl.ppo_policy_loss(batch["logp"], batch["old"], batch["adv"], m, **CLIP, **kw)
    kl = rl.kl_loss(batch["logp"], batch["ref"], m, estimator=estimator, **kw)
    ent = rl.entropy_metric(rl.entropy_from_logits(batch["logits"]), m, agg, float(t))
    rl.log_updates(tracker, [*pg.updates, *kl.updates, ent])
    b_np = np_batch(batch)
    want = verl_losses(b_np, agg, estimator, eps=0.0)
    names = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower",
             "actor/kl_loss", "actor/entropy")  # fmt: skip
    want = {k: want[k] for k in names}
    assert_equal(tracker.compute(), want, label=f"{agg} {estimator}")


# -- advantages -------------------------------------------------------------------------------
def test_grpo_equals_verl_with_groups_of_one() -> None:
    rng = np.random.default_rng(0)
    scores = rng.normal(size=12)
    index = np.array([0, 0, 1, 2, 2, 2, 3, 4, 4, 5, 6, 6])  # groups 1, 3 and 5 have one
    mask = make_batch(1, 12)["mask"]
    for norm in (True, False):
        got = rl.grpo_advantages(torch.from_numpy(scores), torch.from_numpy(index), mask,
                                 norm_by_std=norm).numpy()  # fmt: skip
        want = verl.grpo(scores, index, mask.numpy(), norm_by_std=norm)
        np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)
    zero = rl.grpo_advantages(torch.from_numpy(scores), index.tolist(), singleton="zero")
    assert (zero[[2, 6, 9]] == 0).all()  # the option, not the default


def test_gae_and_whitening_equal_verl_on_valid_tokens() -> None:
    b = np_batch(make_batch(3))
    m = b["mask"]
    for gamma, lam in ((1.0, 1.0), (0.9, 0.95)):
        adv, ret = rl.gae(*(torch.from_numpy(b[k]) for k in ("token_rewards", "v", "mask")),
                          gamma=gamma, lam=lam)  # fmt: skip
        want_adv, want_ret = verl.gae(b["token_rewards"], b["v"], m, gamma, lam)
        np.testing.assert_allclose(adv.numpy()[m], want_adv[m], rtol=1e-13)
        np.testing.assert_allclose(ret.numpy()[m], want_ret[m], rtol=1e-13)
        white = rl.masked_whiten(adv, torch.from_numpy(m)).numpy()
        np.testing.assert_allclose(white[m], verl.masked_whiten(want_adv, m, eps=0)[m],
                                   rtol=1e-11, atol=1e-13)  # fmt: skip


def test_kl_estimators_equal_verl_including_minus_inf() -> None:
    b = np_batch(make_batch(4))
    logp, ref = b["logp"].copy(), b["ref"]
    logp[0, 0] = -np.inf
    for name in rl.KL_ESTIMATORS:
        got = rl.kl_estimate(torch.from_numpy(logp), torch.from_numpy(ref), name).numpy()
        np.testing.assert_allclose(got, verl.kl_penalty(logp, ref, name), rtol=1e-14)
    assert rl.kl_estimate(torch.tensor(-math.inf), torch.tensor(-1.0), "low_var_kl") == 10.0


@pytest.mark.parametrize("name", ["k1+", "k3+", "low_var_kl+", "abs+", "kl+"])
def test_straight_through_estimators_have_k2_gradients(name: str) -> None:
    logp = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(3, 4, dtype=torch.float64)
    rl.kl_estimate(logp, ref, name).sum().backward()
    torch.testing.assert_close(logp.grad, (logp - ref).detach(), rtol=1e-15, atol=0)


def test_entropy_equals_verl() -> None:
    logits = torch.from_numpy(np.random.default_rng(5).normal(0, 3, (4, 7, 11)))
    np.testing.assert_allclose(rl.entropy_from_logits(logits).numpy(),
                               verl.entropy(logits.numpy()), rtol=1e-13)  # fmt: skip


# -- batch metrics ------------------------------------------------------------------------------
def data_batch(seed: int) -> dict[str, torch.Tensor]:
    b = make_batch(seed)
    return {"response_mask": b["mask"], "prompt_mask": b["prompt_mask"],
            "token_scores": b["token_scores"], "token_rewards": b["token_rewards"],
            "advantages": b["adv"], "returns": b["ret"], "values": b["v"]}  # fmt: skip


def log_data(piece, tracker: Tracker, max_response: int = T) -> None:
    rl.log_updates(tracker, rl.batch_metrics(
        piece["response_mask"], scores=piece["token_scores"], rewards=piece["token_rewards"],
        advantages=piece["advantages"], returns=piece["returns"], values=piece["values"],
        prompt_mask=piece["prompt_mask"], max_response_length=max_response, max_prompt_length=3,
    ))  # fmt: skip


def test_batch_metrics_equal_verl_under_every_split() -> None:
    batch = data_batch(6)
    got = assert_partition_invariant(log_data, batch)
    want = verl.data_metrics(np_batch(batch), ev_eps=0.0)
    assert set(got) == set(want)
    assert_equal(got, want, rtol=1e-9)  # the explained variance merges moments: 1e-9


def test_reward_kl_penalty_rewards_and_coefficient_equal_verl() -> None:
    b = make_batch(7)
    rewards, updates = rl.kl_penalty_rewards(b["token_scores"], b["old"], b["ref"], b["mask"],
                                             kl_coef=0.05, estimator="k1")  # fmt: skip
    n = np_batch(b)
    want = n["token_scores"] - 0.05 * verl.kl_penalty(n["old"], n["ref"], "k1") * n["mask"]
    np.testing.assert_allclose(rewards.numpy()[n["mask"]], want[n["mask"]], rtol=1e-15)
    tracker = Tracker()
    rl.log_updates(tracker, updates)
    assert tracker.compute()["actor/reward_kl_penalty_coeff"] == 0.05


def test_timing_and_throughput_names_and_values_equal_verl() -> None:
    tracker = Tracker()
    clock = iter([0.0, 2.0, 2.0, 2.5]).__next__
    with rl.timer(tracker, "gen", clock=clock) as stage:
        stage.num_tokens = 40.0  # response tokens, known once generated
    with rl.timer(tracker, "update_actor", num_tokens=100.0, clock=clock):
        pass
    rl.log_updates(tracker, rl.perf_updates(100.0, 4.0))
    want = verl.timing({"gen": 2.0, "update_actor": 0.5}, 40.0, 100.0)
    want |= {k: v for k, v in verl.throughput(100.0, 4.0, 1).items() if k != "perf/time_per_step"}
    got = tracker.compute()
    extras = {"timing_s/gen/mean", "timing_s/gen/min", "timing_s/gen/slowest_rank",
              "timing_s/update_actor/mean", "timing_s/update_actor/min",
              "timing_s/update_actor/slowest_rank", "perf/throughput/total"}  # fmt: skip
    assert extras <= set(got)  # the rank-aware keys verl does not have
    assert_equal({k: v for k, v in got.items() if k not in extras}, want, rtol=1e-15)


# -- the deliberate differences, each shown where it is claimed ------------------------------
def test_every_difference_has_a_test() -> None:
    tests = {name for name in globals() if name.startswith("test_difference_")}
    assert tests == {f"test_difference_{key}" for key in DIFFERENCES}


def test_difference_masked_mean_eps() -> None:
    b = np_batch(make_batch(8))
    agg = "seq-mean-token-mean"
    exact, verl_eps = verl_losses(b, agg, "k1", eps=0.0), verl_losses(b, agg, "k1", eps=1e-8)
    tracker = Tracker()
    log_losses(_Whole(make_batch(8)), tracker, agg, "k1")
    got = tracker.compute()
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "critic/vpred_mean", "actor/pg_loss"):
        assert got[key] == pytest.approx(exact[key], rel=RTOL, abs=0)
        assert got[key] != verl_eps[key]  # verl is off by about value·1e-8 / count
        assert got[key] == pytest.approx(verl_eps[key], rel=1e-7)


def test_difference_explained_var_eps() -> None:
    rng = np.random.default_rng(9)
    ret = rng.normal(0, 0.002, (4, 5))  # small returns: exact 0.807, verl 0.935
    val = ret + rng.normal(0, 0.001, (4, 5))
    m = np.ones((4, 5), bool)
    tracker = Tracker()
    rl.log_updates(tracker, [rl.explained_var_update(*map(torch.from_numpy, (ret, val, m)))])
    got = tracker.compute()["critic/vf_explained_var"]
    exact = 1 - np.var(ret - val) / np.var(ret)
    verl_value = 1 - np.var(ret - val, ddof=1) / (np.var(ret, ddof=1) + 1e-5)
    assert got == pytest.approx(exact, rel=1e-12) and abs(got - verl_value) > 0.1


def test_difference_empty_metrics() -> None:
    batch = data_batch(10)
    batch["response_mask"] = torch.zeros_like(batch["response_mask"])  # all aborted
    tracker = Tracker()
    log_data(batch, tracker)
    got = tracker.compute()
    assert not any(k.startswith(("critic/score/", "critic/advantages/")) for k in got)
    assert got["response/aborted_ratio"] == 1.0
    m = batch["response_mask"].numpy()
    assert verl.masked_mean(np.ones(m.shape), m) == 0.0  # verl's empty mean
    pg = rl.ppo_policy_loss(*(torch.zeros(2, 3, dtype=torch.float64),) * 3,
                            torch.zeros(2, 3, dtype=torch.bool))  # fmt: skip
    empty = Tracker()
    rl.log_updates(empty, pg.updates)
    assert "actor/pg_clipfrac" not in empty.compute()


def test_difference_micro_batch_means() -> None:
    batch = make_batch(11)
    b = np_batch(batch)
    whole = verl_losses(b, "token-mean", "k1", eps=0.0)["actor/pg_clipfrac"]
    pieces = [slice(0, 4), slice(4, B)]  # uneven micro-batches, each with tokens
    verl_style = np.mean([verl_losses({k: v[p] for k, v in b.items()}, "token-mean", "k1",
                                      eps=1e-8)["actor/pg_clipfrac"] for p in pieces])  # fmt: skip
    tracker = Tracker()
    for p in pieces:
        piece = _Whole({k: v[p] for k, v in batch.items()})
        piece.counts = rl.global_counts(batch["mask"])
        log_losses(piece, tracker, "token-mean", "k1")
    got = tracker.compute()["actor/pg_clipfrac"]
    assert got == pytest.approx(whole, rel=RTOL) and abs(verl_style - whole) > 1e-3


def test_difference_reward_kl_penalty() -> None:
    b = make_batch(12)
    _, updates = rl.kl_penalty_rewards(b["token_scores"], b["old"], b["ref"], b["mask"],
                                       kl_coef=0.1, estimator="k1")  # fmt: skip
    tracker = Tracker()
    rl.log_updates(tracker, updates)
    got = tracker.compute()["actor/reward_kl_penalty"]
    n = np_batch(b)
    token_mean = (n["old"] - n["ref"])[n["mask"]].mean()
    want = verl.reward_kl_penalty(n["old"], n["ref"], n["mask"], "k1", 0.1)
    assert got == pytest.approx(token_mean, rel=RTOL)
    assert abs(got - want["actor/reward_kl_penalty"]) > 1e-3  # ragged rows: not the same
    full = np.ones_like(n["mask"])  # equal rows: the two means agree
    _, same = rl.kl_penalty_rewards(b["token_scores"], b["old"], b["ref"], torch.from_numpy(full),
                                    kl_coef=0.1, estimator="k1")  # fmt: skip
    equal_rows = Tracker()
    rl.log_updates(equal_rows, same)
    verl_full = verl.reward_kl_penalty(n["old"], n["ref"], full, "k1", 0.1, eps=0.0)
    assert equal_rows.compute()["actor/reward_kl_penalty"] == pytest.approx(
        verl_full["actor/reward_kl_penalty"], rel=RTOL
    )


def test_difference_dual_clip_default() -> None:
    logp = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[-2.0, 0.0]], dtype=torch.float64)  # ratio e² > 3 on the first token
    adv = torch.tensor([[-1.0, 1.0]], dtype=torch.float64)
    m = torch.ones(1, 2, dtype=torch.bool)
    want = verl.policy_loss(old.numpy(), logp.numpy(), adv.numpy(), m.numpy(), **VERL_CLIP,
                            mode="token-mean", eps=0.0)  # fmt: skip

    def pg_loss(**kw: float) -> float:
        tracker = Tracker()
        rl.log_updates(tracker, rl.ppo_policy_loss(logp, old, adv, m, **kw).updates)
        return tracker.compute()["actor/pg_loss"]

    clip = {"clip_low": 0.2, "clip_high": 0.28}
    assert pg_loss(**clip, clip_ratio_c=3.0) == pytest.approx(want["actor/pg_loss"], rel=RTOL)
    assert pg_loss(**clip) != pytest.approx(want["actor/pg_loss"], rel=1e-3)


def test_difference_norm_constant_required() -> None:
    b = make_batch(13)
    with pytest.raises(ValueError, match="norm_constant"):
        rl.kl_loss(b["logp"], b["ref"], b["mask"], agg="seq-mean-token-sum-norm")
    out = rl.kl_loss(b["logp"], b["ref"], b["mask"], agg="seq-mean-token-sum-norm",
                     norm_constant=float(T), estimator="k1")  # fmt: skip
    n = np_batch(b)
    want = verl.agg_loss(n["logp"] - n["ref"], n["mask"], "seq-mean-token-sum-norm")  # scale T
    assert out.loss.item() == pytest.approx(want, rel=RTOL)


def test_difference_gae_outside_mask() -> None:
    b = np_batch(make_batch(14))
    m = b["mask"]
    adv, _ = rl.gae(*(torch.from_numpy(b[k]) for k in ("token_rewards", "v", "mask")))
    want, _ = verl.gae(b["token_rewards"], b["v"], m, 1.0, 1.0)
    assert (adv.numpy()[~m] == 0).all() and (want[~m] != 0).any()
    np.testing.assert_allclose(adv.numpy()[m], want[m], rtol=1e-13)


def test_difference_whiten_few_tokens() -> None:
    x = torch.tensor([[0.5, 2.0, 3.0]], dtype=torch.float64)
    one = torch.tensor([[False, True, False]])
    assert (rl.masked_whiten(x, one) == 0).all()
    assert rl.masked_whiten(x, one, shift_mean=False)[0, 1].item() == 2.0
    with pytest.raises(ValueError, match="two valid tokens"):
        verl.masked_whiten(x.numpy(), one.numpy())


def test_difference_clip_ratio_ge() -> None:
    batch = data_batch(15)
    at_width, below = Tracker(), Tracker()
    log_data(batch, at_width)
    log_data(batch, below, max_response=T - 1)
    want = verl.data_metrics(np_batch(batch))["response_length/clip_ratio"]
    assert at_width.compute()["response_length/clip_ratio"] == pytest.approx(want, rel=RTOL)
    assert below.compute()["response_length/clip_ratio"] > want  # >= T - 1, not == T


def test_difference_throughput_slowest_rank() -> None:
    def merged(seconds: tuple[float, float]) -> float:
        states = []
        for rank, (tokens, secs) in enumerate(zip((60.0, 40.0), seconds, strict=True)):
            tracker = Tracker()
            rl.log_updates(tracker, rl.perf_updates(tokens, secs, rank=rank, world_size=2))
            states.append(tracker.state())
        return rl_merge(states)["perf/throughput"]

    # verl's formula with the slowest rank's time as the step time, whichever rank it is;
    # a mean of per-rank rates (the old figure, 60/4 and 40/2 averaged) is far off
    assert merged((4.0, 4.0)) == verl.throughput(100.0, 4.0, 2)["perf/throughput"]
    assert merged((4.0, 2.0)) == verl.throughput(100.0, 4.0, 2)["perf/throughput"]
    assert merged((2.0, 4.0)) == verl.throughput(100.0, 4.0, 2)["perf/throughput"]
    assert merged((4.0, 2.0)) != (60.0 / 4.0 + 40.0 / 2.0) / 2
    # a driver that also waits between the ranks' steps divides by more time
    assert merged((4.0, 2.0)) > verl.throughput(100.0, 4.5, 2)["perf/throughput"]


def rl_merge(states: list) -> dict[str, float]:
    from rlmetrics import TrackerState

    return TrackerState.merge_all(states).compute()


class _Whole(dict):
    """A batch as one piece on one process (``counts`` None: its own counts)."""

    counts = None
