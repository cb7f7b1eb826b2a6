"""The gradient itself is partition-invariant: summed micro-batch gradients, averaged
over simulated ranks as DDP/FSDP do, equal the one-rank, one-micro-batch gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlmetrics import rl
from rlmetrics.rl.counts import BatchCounts, local_counts

B, T, D, V = 7, 5, 3, 4
LENGTHS = [5, 0, 2, 1, 5, 3, 4]


def make_data(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(B, T, D, generator=g, dtype=torch.float64),
        "tokens": torch.randint(0, V, (B, T), generator=g),
        "old": torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 - 1.4,
        "ref": torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 - 1.4,
        "adv": torch.randn(B, T, generator=g, dtype=torch.float64),
        "ret": torch.randn(B, T, generator=g, dtype=torch.float64),
        "v_old": torch.randn(B, T, generator=g, dtype=torch.float64),
        "mask": torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None],
    }


def total_loss(p: dict, params: dict, counts: BatchCounts | None, agg: str) -> torch.Tensor:
    """Policy + KL + entropy + value losses of a tiny linear actor-critic."""
    logits = p["x"] @ params["w"]
    logp = torch.log_softmax(logits, -1).gather(-1, p["tokens"][..., None])[..., 0]
    values = p["x"] @ params["wv"]
    kw = {"counts": counts, "agg": agg, "norm_constant": 6.0}
    m = p["mask"]
    pg = rl.ppo_policy_loss(logp, p["old"], p["adv"], m, clip_low=0.2, clip_high=0.3,
                            clip_ratio_c=3.0, **kw)  # fmt: skip
    kl = rl.kl_loss(logp, p["ref"], m, estimator="low_var_kl", **kw)
    ent = rl.entropy_loss(rl.entropy_from_logits(logits), m, **kw)
    vf = rl.value_loss(values, p["v_old"], p["ret"], m, cliprange_value=0.2, **kw)
    return pg.loss + 0.1 * kl.loss - 0.01 * ent.loss + 0.5 * vf.loss


def gradient(data: dict, params: dict, ranks: int, mbs: int, agg: str, reduce: str) -> list:
    total = local_counts(data["mask"])
    scale = float(ranks) if reduce == "mean" else 1.0
    counts = BatchCounts(total[0], total[1], scale) if (ranks, mbs) != (1, B) else None
    per_rank = []
    for share in np.array_split(np.arange(B), ranks):
        for p in params.values():
            p.grad = None
        pieces = [share[:0]] + [share[i : i + mbs] for i in range(0, len(share), mbs)]
        for rows in pieces:
            piece = {k: v[torch.as_tensor(rows, dtype=torch.long)] for k, v in data.items()}
            total_loss(piece, params, counts, agg).backward()
        per_rank.append(
            [torch.zeros_like(p) if p.grad is None else p.grad for p in params.values()]
        )
    summed = [sum(gs) for gs in zip(*per_rank, strict=True)]
    return [g / ranks for g in summed] if reduce == "mean" else summed  # DDP averages


@pytest.mark.parametrize("agg", rl.AGG_MODES)
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_gradient_is_partition_invariant(agg: str, reduce: str) -> None:
    data = make_data()
    g = torch.Generator().manual_seed(1)
    params = {
        "w": torch.randn(D, V, generator=g, dtype=torch.float64, requires_grad=True),
        "wv": torch.randn(D, generator=g, dtype=torch.float64, requires_grad=True),
    }
    want = gradient(data, params, 1, B, agg, reduce)
    assert all(w.abs().sum() > 0 for w in want)
    for ranks in (1, 2, 4):
        for mbs in (1, 3, B):
            got = gradient(data, params, ranks, mbs, agg, reduce)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_the_documented_loop_runs_end_to_end() -> None:
    """The micro-batch loop of rlmetrics.rl's docstring, on one process."""
    from rlmetrics import Tracker

    data = make_data()
    model = torch.nn.Linear(D, V, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    tracker = Tracker()
    for _ in range(2):  # epochs
        for mini in np.array_split(np.arange(B), 2):
            mini_data = {k: v[torch.as_tensor(mini)] for k, v in data.items()}
            counts = rl.global_counts(mini_data["mask"])
            for rows in np.array_split(np.arange(len(mini)), 2):
                mb = {k: v[torch.as_tensor(rows)] for k, v in mini_data.items()}
                logp = torch.log_softmax(model(mb["x"]), -1).gather(-1, mb["tokens"][..., None])
                pg = rl.ppo_policy_loss(logp[..., 0], mb["old"], mb["adv"], mb["mask"],
                                        counts=counts)  # fmt: skip
                kl = rl.kl_loss(logp[..., 0], mb["ref"], mb["mask"], counts=counts)
                (pg.loss + 0.1 * kl.loss).backward()
                rl.log_updates(tracker, pg.updates + kl.updates)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            rl.log_updates(tracker, [*rl.grad_norm_updates(grad_norm), rl.lr_update(opt)])
            opt.step()
            opt.zero_grad()
    sched.step()
    metrics = tracker.compute(sync=False)
    assert metrics["actor/lr"] == 0.1 and opt.param_groups[0]["lr"] == 0.05
    assert {"actor/pg_loss", "actor/kl_loss", "actor/grad_norm_max", "actor/ppo_kl"} <= set(metrics)
