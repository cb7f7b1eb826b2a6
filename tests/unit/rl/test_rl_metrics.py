"""Batch metrics, advantages, optimizer-step metrics, timing and the explained-variance
kind, against numpy; merged over simulated ranks and micro-batches."""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest
import torch

from rlmetrics import Tracker, TrackerState, rl
from rlmetrics.rl.updates import extremes, token_mean
from rlmetrics.testing import assert_partition_invariant

from gloo_ranks import ok_results, run_ranks


def ragged_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, t, p = 8, 5, 4
    lengths = torch.tensor([5, 0, 3, 1, 5, 2, 4, 5])
    plengths = torch.tensor([4, 1, 2, 4, 3, 0, 4, 2])

    def randn(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g, dtype=torch.float64)

    return {
        "response_mask": torch.arange(t)[None, :] < lengths[:, None],
        "prompt_mask": torch.arange(p)[None, :] < plengths[:, None],
        "scores": randn(b),
        "token_rewards": randn(b, t),
        "advantages": randn(b, t),
        "returns": randn(b, t) + 1e6,  # a large mean: the explained variance stays exact
        "values": randn(b, t) + 1e6,
    }


def test_batch_metrics_match_numpy_under_every_split() -> None:
    batch = ragged_batch()

    def fn(piece, tracker):
        rl.log_updates(tracker, rl.batch_metrics(
            piece["response_mask"], scores=piece["scores"], rewards=piece["token_rewards"],
            advantages=piece["advantages"], returns=piece["returns"], values=piece["values"],
            prompt_mask=piece["prompt_mask"], max_response_length=5, max_prompt_length=4,
        ))  # fmt: skip

    got = assert_partition_invariant(fn, batch, micro_batch_sizes=range(1, 9))
    b = {k: v.numpy() for k, v in batch.items()}
    m = b["response_mask"]
    rewards = (b["token_rewards"] * m).sum(1)
    lengths, plengths = m.sum(1), b["prompt_mask"].sum(1)
    want = {}
    answered = lengths > 0  # row 1 is aborted (empty response): not in score or rewards
    for name, x in (("critic/score", b["scores"][answered]), ("critic/rewards", rewards[answered]),
                    ("critic/advantages", b["advantages"][m]), ("critic/returns", b["returns"][m]),
                    ("critic/values", b["values"][m]), ("response_length", lengths),
                    ("response_length_non_aborted", lengths[answered]),
                    ("prompt_length", plengths)):  # fmt: skip
        want |= {f"{name}/mean": x.mean(), f"{name}/max": x.max(), f"{name}/min": x.min()}
    want["response_length/clip_ratio"] = (lengths == 5).mean()
    want["response_length_non_aborted/clip_ratio"] = (lengths[answered] == 5).mean()
    want["response/aborted_ratio"] = (~answered).mean()
    want["prompt_length/clip_ratio"] = (plengths == 4).mean()
    ret, res = b["returns"][m], (b["returns"] - b["values"])[m]
    want["critic/vf_explained_var"] = 1 - res.var() / ret.var()
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-9), name


def test_log_updates_converts_each_shared_input_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """extremes' three updates share one value and mask: one log_shared call, and the
    same results as logging each update on its own."""
    values, mask = torch.randn(4, 5, dtype=torch.float64), torch.rand(4, 5) > 0.3
    updates = [*extremes("adv", values, mask), token_mean("kl", values, mask)]
    calls: list[list] = []
    shared = Tracker()
    original = Tracker._log_shared

    def spy(self: Tracker, metrics: list, value: object, weight: object) -> None:
        calls.append(metrics)
        original(self, metrics, value, weight)

    monkeypatch.setattr(Tracker, "_log_shared", spy)
    rl.log_updates(shared, updates)
    assert calls == [[("adv/mean", "mean"), ("adv/max", "max"), ("adv/min", "min")]]
    separate = Tracker()
    for update in updates:
        separate.log(update.name, update.value, update.weight, kind=update.kind)
    assert shared.compute() == separate.compute()


def test_explained_var_state_round_trips_and_merges_in_any_order() -> None:
    batch = ragged_batch(3)
    trackers = []
    for rows in (slice(0, 3), slice(3, 4), slice(4, 8)):
        t = Tracker()
        m = batch["response_mask"][rows]
        rl.log_updates(
            t, [rl.explained_var_update(batch["returns"][rows], batch["values"][rows], m)]
        )
        trackers.append(t)
    states = [t.state() for t in trackers]
    forward = TrackerState.merge_all(states).compute()
    backward = TrackerState.merge_all(states[::-1]).compute()
    copied = TrackerState.from_dict(
        pickle.loads(pickle.dumps(TrackerState.merge_all(states).to_dict()))
    )
    assert forward == pytest.approx(backward, rel=1e-9)
    assert copied.compute() == forward
    with pytest.raises(TypeError, match="explained_var"):
        Tracker().log("x", 1.0, kind="explained_var")


def test_grpo_advantages_match_numpy() -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(9, generator=g, dtype=torch.float64)
    uids = ["a", "b", "a", "c", "b", "a", "b", "d", "d"]
    mask = torch.rand(9, 3, generator=g) > 0.3
    for norm, singleton in itertools.product((True, False), ("score", "zero")):
        got = rl.grpo_advantages(scores, uids, mask, norm_by_std=norm, singleton=singleton)
        s = scores.numpy()
        for i, uid in enumerate(uids):  # "c" is a group of one
            group = s[[j for j, u in enumerate(uids) if u == uid]]
            mean, std = group.mean(), group.std(ddof=1) if len(group) > 1 else 0.0
            if len(group) == 1 and singleton == "score":
                mean, std = 0.0, 1.0
            want = (s[i] - mean) / ((std + 1e-6) if norm else 1.0)
            assert got[i][mask[i]].numpy() == pytest.approx(np.full(mask[i].sum().item(), want))
            assert (got[i][~mask[i]] == 0).all()
    assert rl.grpo_advantages(scores, torch.tensor([0, 1, 0, 2, 1, 0, 1, 3, 3])).shape == (9,)


def test_gae_matches_a_numpy_loop_over_valid_tokens() -> None:
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(4, 6, generator=g, dtype=torch.float64)
    values = torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0],
                         [0, 1, 1, 1, 1, 0]], dtype=torch.bool)  # fmt: skip
    adv, ret = rl.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    for i in range(4):
        idx = [t for t in range(6) if mask[i, t]]
        r, v = rewards[i, idx].numpy(), values[i, idx].numpy()
        want, last = np.zeros(len(idx)), 0.0
        for k in reversed(range(len(idx))):
            nxt = v[k + 1] if k + 1 < len(idx) else 0.0
            last = r[k] + 0.9 * nxt - v[k] + 0.9 * 0.8 * last
            want[k] = last
        assert adv[i, idx].numpy() == pytest.approx(want, rel=1e-12)
        assert ret[i, idx].numpy() == pytest.approx(want + v, rel=1e-12)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    white = rl.masked_whiten(adv, mask)[mask].numpy()
    assert white.mean() == pytest.approx(0, abs=1e-12)
    assert white.std(ddof=1) == pytest.approx(1, rel=1e-6)


def test_kl_penalty_rewards_and_entropy() -> None:
    g = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(2, 2, 3, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    scores = torch.zeros(2, 3, dtype=torch.float64)
    scores[0, 1] = scores[1, 0] = 1.0
    rewards, updates = rl.kl_penalty_rewards(scores, logp, ref, mask, kl_coef=0.1, estimator="k1")
    d = (logp - ref).numpy()
    assert rewards.numpy() == pytest.approx(np.where(mask.numpy(), scores.numpy() - 0.1 * d, 0.0))
    t = Tracker()
    rl.log_updates(t, updates)
    assert t.compute() == pytest.approx(
        {"actor/reward_kl_penalty_coeff": 0.1, "actor/reward_kl_penalty": d[mask].mean()}
    )
    logits = torch.randn(3, 5, generator=g, dtype=torch.float64)
    p = torch.softmax(logits, -1).numpy()
    assert rl.entropy_from_logits(logits).numpy() == pytest.approx(-(p * np.log(p)).sum(-1))


def test_step_metrics_over_ranks_and_optimizer_steps() -> None:
    norms = [[1.0, 4.0, 2.0], [1.0, 4.0, 2.0]]  # the same on every rank after the reduction
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    states = []
    for rank, rank_norms in enumerate(norms):
        t = Tracker()
        for norm in rank_norms:
            rl.log_updates(t, [*rl.grad_norm_updates(torch.tensor(norm)), rl.lr_update(opt)])
        where = {"rank": rank, "world_size": 2}
        perf = rl.perf_updates(100.0 * (rank + 1), 2.0, **where)
        rl.log_updates(t, [rl.kl_coef_update(0.05), *perf])
        clock = iter([0.0, 1.5 + rank]).__next__
        with rl.timer(t, "update", num_tokens=300, clock=clock, **where):
            pass
        states.append(t.state())
    opt.step()
    sched.step()
    assert rl.lr_update(opt).value == pytest.approx(0.05) and rl.lr_update(sched).value == 0.05
    assert TrackerState.merge_all(states).compute() == pytest.approx({
        "actor/grad_norm": 7 / 3, "actor/grad_norm_max": 4.0, "actor/lr": 0.5,
        "actor/kl_coef": 0.05, "perf/total_num_tokens": 300.0, "perf/throughput": 75.0,
        "perf/throughput/total": 150.0, "timing_s/update": 2.5, "timing_s/update/mean": 2.0,
        "timing_s/update/min": 1.5, "timing_s/update/slowest_rank": 1.0,
        "timing_per_token_ms/update": 2500 / 300,
    })  # fmt: skip


def test_errors_name_the_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="agg must be one of"):
        rl.ppo_policy_loss(x, x, x, mask, agg="mean")
    with pytest.raises(ValueError, match="norm_constant"):
        rl.kl_loss(x, x, mask, agg="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="clip_ratio_c"):
        rl.ppo_policy_loss(x, x, x, mask, clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="estimator"):
        rl.kl_estimate(x, x, "k4")
    with pytest.raises(ValueError, match="grad_reduce"):
        rl.global_counts(mask, grad_reduce="avg")
    with pytest.raises(TypeError, match="lr_update"):
        rl.lr_update("0.1")
    monkeypatch.setattr("rlmetrics.rl.counts.world_size", lambda group=None: 4)
    with pytest.raises(ValueError, match="counts=None with 4 ranks"):
        rl.value_loss(x, x, x, mask)


def test_global_counts_without_a_process_group_are_local() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    counts = rl.global_counts(mask)
    assert (counts.num_tokens.item(), counts.num_seqs.item(), counts.grad_scale) == (3, 2, 1.0)


def _counts_on_rank(rank: int, world_size: int) -> None:
    mask = torch.ones(rank + 1, 3, dtype=torch.bool)  # 3 tokens on rank 0, 6 on rank 1
    counts = rl.global_counts(mask)
    assert (counts.num_tokens.item(), counts.num_seqs.item(), counts.grad_scale) == (9, 3, 2)
    assert rl.global_counts(mask, grad_reduce="sum").grad_scale == 1.0
    with pytest.raises(ValueError, match="counts=None with 2 ranks"):
        rl.ppo_policy_loss(*(torch.zeros(1, 3),) * 3, mask[:1])


def test_global_counts_all_reduce_over_gloo() -> None:
    ok_results(run_ranks(_counts_on_rank, 2, start_method="fork"))
