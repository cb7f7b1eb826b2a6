"""Losses and their metrics against an independent numpy computation, under every split:
micro-batch sizes 1..B, token budgets, 1/2/4 simulated ranks, 1-3 mini-batches, 1-2
epochs at fixed parameters, ragged and fully masked sequences, empty micro-batches."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlmetrics import Tracker, rl
from rlmetrics.rl.counts import BatchCounts, local_counts

CLIP = {"clip_low": 0.2, "clip_high": 0.28, "clip_ratio_c": 3.0}
C = 7.0  # norm_constant of seq-mean-token-sum-norm


# -- numpy reference (scalar formulas, written independently of the torch code) ---------
def np_ppo_token(lp: float, olp: float, a: float) -> tuple[float, bool, bool]:
    """(loss, clipped, dual-clip active) of one token."""
    r = math.exp(max(min(lp - olp, 20.0), -20.0))
    r_clip = min(max(r, 1 - CLIP["clip_low"]), 1 + CLIP["clip_high"])
    loss = max(-a * r, -a * r_clip)
    clipped = -a * r_clip > -a * r
    lower = False
    if a < 0:
        bound = -a * CLIP["clip_ratio_c"]
        lower = loss > bound
        loss = min(loss, bound)
    return loss, clipped, lower


def np_kl_token(lp: float, ref: float, estimator: str) -> float:
    """The estimator's value; a straight-through ``+`` form has its base's value."""
    d = lp - ref
    return {
        "kl": d,
        "k1": d,
        "abs": abs(d),
        "mse": d * d / 2,
        "k2": d * d / 2,
        "low_var_kl": min(max(math.exp(-d) + d - 1, -10.0), 10.0),
        "k3": min(max(math.exp(-d) + d - 1, -10.0), 10.0),
    }[estimator.removesuffix("+")]


def np_entropy(z: np.ndarray) -> float:
    p = np.exp(z - z.max())
    p /= p.sum()
    return float(-(p * np.log(p)).sum())


def np_value_token(v: float, old: float, ret: float, clip: float) -> tuple[float, bool]:
    v_clip = min(max(v, old - clip), old + clip)
    return 0.5 * max((v - ret) ** 2, (v_clip - ret) ** 2), (v_clip - ret) ** 2 > (v - ret) ** 2


def np_objective(losses: np.ndarray, mask: np.ndarray, agg: str) -> float | None:
    """The mini-batch objective; None when it has no valid token."""
    n = mask.sum(1)
    if n.sum() == 0:
        return None
    if agg == "token-mean":
        return float(losses[mask].sum() / n.sum())
    if agg == "token-sum":
        return float(losses[mask].sum())
    seqs = [losses[i][mask[i]] for i in range(len(n)) if n[i] > 0]
    per_seq = {
        "seq-mean-token-sum": [s.sum() for s in seqs],
        "seq-mean-token-mean": [s.mean() for s in seqs],
        "seq-mean-token-sum-norm": [s.sum() / C for s in seqs],
    }[agg]
    return float(np.mean(per_seq))


def np_token_losses(b: dict[str, np.ndarray], estimator: str) -> dict[str, np.ndarray]:
    """Per-token losses and flags of the whole batch."""
    shape = b["mask"].shape
    out = {k: np.zeros(shape) for k in ("pg", "clip", "lower", "kl", "ent", "vf", "vclip")}
    for i, t in np.ndindex(shape):
        pg = np_ppo_token(b["logp"][i, t], b["old"][i, t], b["adv"][i, t])
        out["pg"][i, t] = pg[0] * b["is_w"][i, t]
        out["clip"][i, t], out["lower"][i, t] = pg[1], pg[2]
        out["kl"][i, t] = np_kl_token(b["logp"][i, t], b["ref"][i, t], estimator)
        out["ent"][i, t] = np_entropy(b["logits"][i, t])
        vf = np_value_token(b["v"][i, t], b["v_old"][i, t], b["ret"][i, t], 0.3)
        out["vf"][i, t], out["vclip"][i, t] = vf
    return out


def np_expected(b: dict, agg: str, estimator: str, num_mini: int) -> dict[str, float]:
    tok = np_token_losses(b, estimator)
    mask = b["mask"]
    minis = np.array_split(np.arange(len(mask)), num_mini)
    out = {}
    for name, key in (("actor/pg_loss", "pg"), ("actor/kl_loss", "kl"),
                      ("actor/entropy_loss", "ent"), ("critic/vf_loss", "vf")):  # fmt: skip
        values = [np_objective(tok[key][m], mask[m], agg) for m in minis]
        values = [v for v in values if v is not None]
        if values:
            out[name] = float(np.mean(values))
    if mask.any():
        for name, key in (("actor/pg_clipfrac", "clip"), ("actor/pg_clipfrac_lower", "lower"),
                          ("actor/entropy_token_mean", "ent"),
                          ("critic/vf_clipfrac", "vclip")):  # fmt: skip
            out[name] = float(tok[key][mask].mean())
        out["actor/ppo_kl"] = float((b["old"] - b["logp"])[mask].mean())
        out["critic/vpred_mean"] = float(b["v"][mask].mean())
    return out


# -- the code under test, run over a simulated training step ----------------------------
def log_losses(p: dict, counts: BatchCounts, tracker: Tracker, agg: str, estimator: str) -> None:
    kw = {"counts": counts, "agg": agg, "norm_constant": C}
    m = p["mask"]
    pg = rl.ppo_policy_loss(p["logp"], p["old"], p["adv"], m, **CLIP, **kw,
                            rollout_is_weights=p["is_w"])  # fmt: skip
    kl = rl.kl_loss(p["logp"], p["ref"], m, estimator=estimator, **kw)
    ent = rl.entropy_loss(rl.entropy_from_logits(p["logits"]), m, **kw)
    vf = rl.value_loss(p["v"], p["v_old"], p["ret"], m, cliprange_value=0.3, **kw)
    rl.log_updates(tracker, pg.updates + kl.updates + ent.updates + vf.updates)


def micro_batches(rows: np.ndarray, tokens: np.ndarray, split: int | str) -> list[np.ndarray]:
    """Fixed-size micro-batches, or greedy token-budget ones ("budget:N")."""
    if isinstance(split, int):
        return [rows[i : i + split] for i in range(0, len(rows), split)]
    budget, out, used = int(split.split(":")[1]), [], math.inf
    for row in rows:
        if used + tokens[row] > budget:
            out.append([])
            used = 0
        out[-1].append(row)
        used += tokens[row]
    return [np.asarray(c, dtype=np.int64) for c in out]


def simulate(batch: dict, *, agg: str, estimator: str, num_mini: int, epochs: int,
             ranks: int, split: int | str, empties: bool) -> dict[str, float]:  # fmt: skip
    """One training step: epochs x mini-batches x ranks x micro-batches; states merged."""
    trackers = [Tracker() for _ in range(ranks)]
    tokens = batch["mask"].sum(1).numpy()
    minis = np.array_split(np.arange(len(tokens)), num_mini)
    for _ in range(epochs):
        for mini in minis:
            total = local_counts(batch["mask"][torch.as_tensor(mini)])
            counts = BatchCounts(total[0], total[1], float(ranks))
            for rank, share in enumerate(np.array_split(mini, ranks)):
                pieces = micro_batches(share, tokens, split)
                if empties:
                    pieces = [share[:0], *pieces, share[:0]]
                for rows in pieces:
                    piece = {
                        k: v[torch.as_tensor(rows, dtype=torch.long)] for k, v in batch.items()
                    }
                    log_losses(piece, counts, trackers[rank], agg, estimator)
    merged = Tracker()
    for t in trackers:
        merged.merge(t.state())
    return merged.compute(sync=False)


def make_batch(seed: int, lengths: list[int], width: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, shape = len(lengths), (len(lengths), width)

    def randn(*s: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*s, generator=g, dtype=torch.float64) * scale

    logp = randn(*shape, scale=0.5) - 1.0
    return {
        "mask": torch.arange(width)[None, :] < torch.tensor(lengths)[:, None],
        "logp": logp,
        "old": logp + randn(*shape, scale=0.3),
        "ref": logp + randn(*shape, scale=0.4),
        "adv": randn(*shape),
        "is_w": torch.rand(*shape, generator=g, dtype=torch.float64) + 0.5,
        "logits": randn(b, width, 4),
        "v": randn(*shape),
        "v_old": randn(*shape),
        "ret": randn(*shape),
    }


def assert_close(got: dict[str, float], want: dict[str, float], label: str) -> None:
    assert set(got) == set(want), (label, set(got) ^ set(want))
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-9, abs=1e-12), (label, name)


@pytest.mark.parametrize("agg", rl.AGG_MODES)
def test_every_micro_batch_size_and_rank_count(agg: str) -> None:
    batch = make_batch(0, [5, 0, 3, 1, 5, 2], 5)
    want = np_expected({k: v.numpy() for k, v in batch.items()}, agg, "low_var_kl", 1)
    for ranks in (1, 2, 4):
        for split in [*range(1, 7), "budget:5", "budget:8"]:
            got = simulate(batch, agg=agg, estimator="low_var_kl", num_mini=1, epochs=1,
                           ranks=ranks, split=split, empties=False)  # fmt: skip
            assert_close(got, want, f"ranks={ranks} split={split}")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 4), min_size=1, max_size=7),
    agg=st.sampled_from(rl.AGG_MODES),
    estimator=st.sampled_from(rl.KL_ESTIMATORS),
    num_mini=st.integers(1, 3),
    epochs=st.integers(1, 2),
    ranks=st.sampled_from((1, 2, 4)),
    split=st.one_of(st.integers(1, 7), st.sampled_from(("budget:4", "budget:6"))),
    empties=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_splits_match_numpy(lengths, agg, estimator, num_mini, epochs, ranks, split,
                                   empties, seed) -> None:  # fmt: skip
    batch = make_batch(seed, lengths, 4)
    want = np_expected({k: v.numpy() for k, v in batch.items()}, agg, estimator, num_mini)
    got = simulate(batch, agg=agg, estimator=estimator, num_mini=num_mini, epochs=epochs,
                   ranks=ranks, split=split, empties=empties)  # fmt: skip
    assert_close(got, want, "random split")


TOKEN_TERMS = (  # (coefficient, per-token loss, mask, mode) of each term of the total
    (1.0, "adv", "mask", "token-mean"),
    (0.5, "ref", "aux", "token-mean"),
    (2.0, "ret", "aux", "token-sum"),
)
MIXED_TERMS = (*TOKEN_TERMS, (-0.25, "v", "aux", "seq-mean-token-mean"))


def log_loss_terms(
    piece: dict, counts: dict[str, BatchCounts], tracker: Tracker, spec: tuple
) -> None:
    terms = [
        (c, rl.objective_update(f"term{k}", piece[loss], piece[mask], counts[mask], agg))
        for k, (c, loss, mask, agg) in enumerate(spec)
    ]
    rl.log_updates(tracker, [rl.loss_update("loss", terms)])


@pytest.mark.parametrize("spec", [TOKEN_TERMS, MIXED_TERMS], ids=["token", "mixed"])
@pytest.mark.parametrize("num_mini", [1, 2])
def test_loss_update_adds_terms_over_their_own_masks_and_modes(num_mini: int, spec) -> None:
    """Terms on different masks of one shape, and other modes: the total is Σ_k c_k J_k
    of each mini-batch, every J_k over its own mask and counts, as numpy computes it
    over the whole batch; the mean over mini-batches, under every split and rank count
    (it took the first term's weights for every term)."""
    batch = make_batch(3, [5, 2, 4, 3, 5, 1], 5)
    batch["aux"] = batch["mask"] & (torch.arange(5) % 2 == 0)  # token 0 of every sequence
    b = {k: v.numpy() for k, v in batch.items()}
    minis = np.array_split(np.arange(6), num_mini)
    totals = [
        sum(c * np_objective(b[loss][m], b[mask][m], agg) for c, loss, mask, agg in spec)
        for m in minis
    ]
    want = float(np.mean(totals))
    for ranks in (1, 2):
        for split in range(1, 7):
            trackers = [Tracker() for _ in range(ranks)]
            for mini in minis:
                rows = torch.as_tensor(mini)
                counts = {
                    mask: BatchCounts(*local_counts(batch[mask][rows]), float(ranks))
                    for mask in ("mask", "aux")
                }
                for rank, share in enumerate(np.array_split(mini, ranks)):
                    for piece_rows in micro_batches(share, b["mask"].sum(1), split):
                        index = torch.as_tensor(piece_rows, dtype=torch.long)
                        piece = {k: v[index] for k, v in batch.items()}
                        log_loss_terms(piece, counts, trackers[rank], spec)
            merged = Tracker()
            for tracker in trackers:
                merged.merge(tracker.state())
            got = merged.compute(sync=False)["loss"]
            assert got == pytest.approx(want, rel=1e-12), (ranks, split)


def test_loss_update_terms_sharing_a_weight_add_element_wise() -> None:
    losses, mask = torch.randn(3, 4, dtype=torch.float64), torch.rand(3, 4) > 0.3
    a = rl.objective_update("a", losses, mask, None)
    b = rl.MetricUpdate("b", "mean", losses * 2, a.weight)
    total = rl.loss_update("loss", [(1.0, a), (0.5, b)])
    assert total.weight is a.weight and torch.equal(total.value, a.value + 0.5 * b.value)
    with pytest.raises(ValueError, match=r"'loss'.*term 'm' is kind 'max'"):
        rl.loss_update("loss", [(1.0, a), (1.0, rl.MetricUpdate("m", "max", losses))])
    with pytest.raises(ValueError, match="'loss': needs at least one"):
        rl.loss_update("loss", [])


def test_fully_masked_batch_logs_no_loss_and_zero_gradient() -> None:
    batch = make_batch(1, [0, 0], 3)
    logp = batch["logp"].clone().requires_grad_()
    out = rl.ppo_policy_loss(logp, batch["old"], batch["adv"], batch["mask"])
    out.loss.backward()
    assert out.loss.item() == 0.0 and logp.grad.abs().sum().item() == 0.0
    tracker = Tracker()
    rl.log_updates(tracker, out.updates)
    assert tracker.compute(sync=False) == {}


def test_nan_in_padding_does_not_leak() -> None:
    batch = make_batch(2, [2, 1], 3)
    batch["adv"][~batch["mask"]] = math.nan
    tracker = Tracker()
    out = rl.ppo_policy_loss(batch["logp"], batch["old"], batch["adv"], batch["mask"])
    rl.log_updates(tracker, out.updates)
    assert all(math.isfinite(v) for v in tracker.compute(sync=False).values())
    assert math.isfinite(out.loss.item())


@pytest.mark.parametrize("num_mini", [1, 2, 3])
@pytest.mark.parametrize("epochs", [1, 2])
def test_mini_batches_and_epochs_at_fixed_parameters(num_mini: int, epochs: int) -> None:
    batch = make_batch(5, [4, 0, 2, 4, 1, 3, 0, 4], 4)
    np_batch = {k: v.numpy() for k, v in batch.items()}
    for agg in rl.AGG_MODES:
        want = np_expected(np_batch, agg, "k1", num_mini)
        got = simulate(batch, agg=agg, estimator="k1", num_mini=num_mini, epochs=epochs,
                       ranks=2, split="budget:5", empties=True)  # fmt: skip
        assert_close(got, want, f"{agg} mini={num_mini} epochs={epochs}")


@pytest.mark.parametrize("estimator", rl.KL_ESTIMATORS)
def test_kl_estimators_match_numpy(estimator: str) -> None:
    g = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(2, 3, 5, generator=g, dtype=torch.float64) * 3
    got = rl.kl_estimate(logp, ref, estimator).numpy()
    want = np.vectorize(lambda a, b: np_kl_token(a, b, estimator))(logp.numpy(), ref.numpy())
    np.testing.assert_allclose(got, want, rtol=1e-12)
