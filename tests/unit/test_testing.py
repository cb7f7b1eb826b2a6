"""rlmetrics.testing.assert_partition_invariant: passes correct code, catches the
classic metric bugs, and reports a table of what drifts."""

from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest
import torch

from rlmetrics import rl
from rlmetrics.testing import Piece, assert_partition_invariant


def make_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([4, 1, 0, 3, 4, 2, 1])
    shape = (7, 4)
    logp = torch.randn(*shape, generator=g, dtype=torch.float64) * 0.5 - 1
    return {
        "response_mask": torch.arange(4)[None, :] < lengths[:, None],
        "logp": logp,
        "old": logp + torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3,
        "ref": logp + torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3,
        "adv": torch.randn(*shape, generator=g, dtype=torch.float64),
    }


def policy(piece: Piece) -> rl.LossOutput:
    return rl.ppo_policy_loss(piece["logp"], piece["old"], piece["adv"], piece["response_mask"],
                              counts=piece.counts, clip_low=0.1, clip_high=0.1)  # fmt: skip


def test_correct_code_passes_over_every_mode_and_epochs() -> None:
    def fn(piece, tracker):
        for agg in rl.AGG_MODES:
            m = piece["response_mask"]
            kw = {"counts": piece.counts, "agg": agg, "norm_constant": 4}
            pg = rl.ppo_policy_loss(piece["logp"], piece["old"], piece["adv"], m, **kw)
            kl = rl.kl_loss(piece["logp"], piece["ref"], m, **kw)
            rl.log_updates(tracker.prefixed(f"{agg}/"), pg.updates + kl.updates)

    metrics = assert_partition_invariant(fn, make_batch(), epochs=(1, 2))
    assert "token-mean/actor/pg_loss" in metrics and len(metrics) == 5 * len(rl.AGG_MODES)


def test_catches_a_mean_of_means_clip_fraction() -> None:
    def fn(piece, tracker):
        m = piece["response_mask"]
        clipped = policy(piece).updates[1].value  # per-token 0/1 clip flags
        if m.any():
            tracker.mean("actor/pg_clipfrac", clipped[m].mean())  # weight 1 per micro-batch

    with pytest.raises(AssertionError, match=r"actor/pg_clipfrac +\d+ +ranks="):
        assert_partition_invariant(fn, make_batch())


def test_catches_a_loss_summed_over_micro_batches() -> None:
    def fn(piece, tracker):
        m = piece["response_mask"]
        if m.any():  # the micro-batch mean, summed: grows with the number of micro-batches
            tracker.sum("actor/pg_loss", (policy(piece).updates[0].value.sum() / m.sum()))

    with pytest.raises(AssertionError, match="actor/pg_loss"):
        assert_partition_invariant(fn, make_batch())


def test_catches_the_backward_scale_leaking_into_the_metric() -> None:
    def fn(piece, tracker):
        tracker.sum("actor/pg_loss", policy(piece).loss.detach())  # carries grad_scale

    with pytest.raises(AssertionError, match=r"actor/pg_loss .*ranks=4"):
        assert_partition_invariant(fn, make_batch(), micro_batch_sizes=(7,))


def test_catches_kl_loss_overwritten_per_micro_batch() -> None:
    def fn(piece, tracker):
        out = rl.kl_loss(piece["logp"], piece["ref"], piece["response_mask"], counts=piece.counts)
        update = out.updates[0]
        if piece["response_mask"].any():  # a dict entry updated, not appended
            tracker.last(
                "actor/kl_loss", (update.value * update.weight).sum() / update.weight.sum()
            )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # ranks disagree: reported as such
        with pytest.raises(AssertionError, match="actor/kl_loss"):
            assert_partition_invariant(fn, make_batch())


def lr_fn(read_before_step: bool):
    """Per micro-batch lr logging; the scheduler steps at the accumulation boundary."""
    schedulers: dict[tuple, list[float]] = {}

    def fn(piece, tracker):
        info = piece.info
        lr = schedulers.setdefault((info.partition, info.rank), [1.0])  # one replica per rank
        before = lr[0]
        if info.is_last:  # optimizer.step(); scheduler.step()
            lr[0] *= 0.5
        tracker.mean("actor/lr", before if read_before_step else lr[0])

    return fn


def test_catches_lr_read_after_the_scheduler_step() -> None:
    assert_partition_invariant(lr_fn(read_before_step=True), make_batch())
    with pytest.raises(AssertionError, match="actor/lr"):
        assert_partition_invariant(lr_fn(read_before_step=False), make_batch())


def test_report_is_a_table_with_missing_metrics() -> None:
    def fn(piece, tracker):
        tracker.sum("rows", float(len(piece["logp"])))
        if len(piece["logp"]) >= 7:
            tracker.mean("only_whole", 1.0)

    with pytest.raises(AssertionError) as info:
        assert_partition_invariant(fn, make_batch(), ranks=(2,), epochs=(1, 2))
    report = str(info.value)
    assert report.splitlines()[0] == "2 metric(s) depend on the partition:"
    assert "metric" in report and "worst run" in report and "rel diff" in report
    assert "missing" in report and "epochs=2" in report
    assert "rows " not in report.split("only_whole")[0].splitlines()[-1]


@pytest.mark.parametrize(
    ("whole", "split", "drifts"),
    [
        (math.inf, -math.inf, True),
        (math.inf, 1e308, True),
        (-math.inf, -1e308, True),
        (1e308, math.inf, True),
        (math.nan, math.inf, True),
        (math.inf, math.nan, True),
        (1.0, math.nan, True),
        (math.inf, math.inf, False),
        (-math.inf, -math.inf, False),
        (math.nan, math.nan, False),
    ],
)
def test_non_finite_values_compare_by_identity(whole: float, split: float, drifts: bool) -> None:
    """inf matches only inf, -inf only -inf, NaN only NaN: a tolerance scaled by an
    infinite expected value (inf <= rtol * inf) must not hide a drift."""
    rows = len(make_batch()["logp"])

    def fn(piece, tracker):
        tracker.max("x", whole if len(piece["logp"]) == rows else split)

    if not drifts:
        assert_partition_invariant(fn, make_batch(), ranks=(2,))
        return
    with pytest.raises(AssertionError, match=r"1 metric\(s\) depend on the partition:\n"):
        assert_partition_invariant(fn, make_batch(), ranks=(2,))


def test_options_are_checked() -> None:
    batch = make_batch()
    with pytest.raises(TypeError, match="unknown options"):
        assert_partition_invariant(lambda p, t: None, batch, micro_batch=2)
    with pytest.raises(ValueError, match="share their first dimension"):
        assert_partition_invariant(lambda p, t: None, {**batch, "x": torch.zeros(3)})


def test_pieces_carry_counts_and_token_budgets_respected() -> None:
    seen = []

    def fn(piece, tracker):
        assert piece.counts.num_tokens.item() == 15
        assert piece.counts.grad_scale == piece.info.num_ranks
        if "token_budget=4" in piece.info.partition:
            seen.append(int(piece["response_mask"].sum()))

    assert_partition_invariant(fn, make_batch(), token_budgets=(4,), mask_key="response_mask")
    assert seen and max(seen) <= 4


# -- the real-rank mode: run_ranks spawns gloo ranks that all call the checker ------------


def correct_fn(seen: list | None = None):
    def fn(piece, tracker):
        if seen is not None and piece.info.partition.startswith("real "):
            seen.append((piece.info.partition, piece.info.rank, piece.info.rows.tolist()))
        out = policy(piece)
        rl.log_updates(tracker, out.updates)
        tracker.sum("rows", float(len(piece["logp"])))
        tracker.max("longest", piece["response_mask"].sum(-1), piece["response_mask"].any(-1))

    return fn


def mean_of_means_fn(piece, tracker):
    m = piece["response_mask"]
    clipped = policy(piece).updates[1].value
    if m.any():
        tracker.mean("actor/pg_clipfrac", clipped[m].mean())  # weight 1 per micro-batch


def outcome(call) -> tuple[str, str]:
    """("ok", "") or (the exception's type name, its message)."""
    try:
        call()
    except Exception as error:
        return type(error).__name__, str(error)
    return "ok", ""


def real_rank_checks(rank: int, world: int) -> dict:
    """Every scenario on every rank of one spawned group (one spawn per world size)."""
    batch = make_batch()
    out: dict = {}
    seen: list = []
    out["metrics"] = assert_partition_invariant(correct_fn(seen), batch)
    out["seen"] = seen
    out["bug"] = outcome(lambda: assert_partition_invariant(mean_of_means_fn, batch))
    # one micro-batch per simulated rank: only the real ranks' merge can see this bug
    only_real = {"ranks": (1,), "micro_batch_sizes": (7,), "token_budgets": (), "shuffle": False}
    out["bug_real_only"] = outcome(
        lambda: assert_partition_invariant(mean_of_means_fn, batch, **only_real)
    )
    out["bug_off"] = outcome(
        lambda: assert_partition_invariant(mean_of_means_fn, batch, real_ranks=False, **only_real)
    )
    small = {k: v[: world - 1] for k, v in batch.items()}  # the last rank's shard is empty
    seen_small: list = []
    out["small"] = outcome(lambda: assert_partition_invariant(correct_fn(seen_small), small))
    out["seen_small"] = seen_small

    def raises_on_rank_1(piece, tracker):
        if piece.info.partition.startswith("real ") and piece.info.rank == 1:
            raise ZeroDivisionError("rank 1 fails")
        tracker.sum("rows", float(len(piece["logp"])))

    out["raises"] = outcome(lambda: assert_partition_invariant(raises_on_rank_1, batch))
    other = {k: v.flip(0) if rank == 0 else v for k, v in batch.items()}
    out["other_batch"] = outcome(lambda: assert_partition_invariant(correct_fn(), other))
    out["after"] = assert_partition_invariant(correct_fn(), batch, ranks=(2,)) == out["metrics"]
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world={w}")
def real_ranks(request) -> tuple[int, list[dict]]:
    from gloo_ranks import ok_results, run_ranks

    return request.param, ok_results(run_ranks(real_rank_checks, request.param, timeout=90))


@pytest.mark.slow  # gloo ranks (the real_ranks fixture)
def test_real_ranks_correct_code_passes_on_every_rank(real_ranks) -> None:
    world, per_rank = real_ranks
    assert all(r["metrics"] == per_rank[0]["metrics"] for r in per_rank)
    assert per_rank[0]["metrics"]["rows"] == 7.0 and "actor/pg_loss" in per_rank[0]["metrics"]
    shares = [s.tolist() for s in np.array_split(np.arange(7), world)]
    for rank, result in enumerate(per_rank):
        seen = result["seen"]
        assert {r for _, r, _ in seen} == {rank}
        labels = {label for label, _, _ in seen}
        assert f"real ranks={world} micro_batch_size=7" in labels
        assert any("token_budget" in label for label in labels)
        assert any("shuffled" in label for label in labels)
        whole_share = [rows for label, _, rows in seen if label.endswith("micro_batch_size=7")]
        assert whole_share == [shares[rank]]
        assert result["after"]  # every rank left the group's collectives in step


@pytest.mark.slow  # gloo ranks (the real_ranks fixture)
def test_real_ranks_a_bug_raises_on_every_rank_naming_the_metric(real_ranks) -> None:
    world, per_rank = real_ranks
    for result in per_rank:
        kind, message = result["bug"]
        assert kind == "AssertionError" and "actor/pg_clipfrac" in message
        # the simulated runs pass; the merge over real ranks catches the mean of means
        kind, message = result["bug_real_only"]
        assert kind == "AssertionError", message
        assert re.search(rf"actor/pg_clipfrac +\d+ +real ranks={world} ", message)
        assert result["bug_off"] == ("ok", "")  # real_ranks=False: simulated ranks only


@pytest.mark.slow  # gloo ranks (the real_ranks fixture)
def test_real_ranks_empty_shard(real_ranks) -> None:
    world, per_rank = real_ranks
    shares = [s.tolist() for s in np.array_split(np.arange(world - 1), world)]
    assert shares[-1] == []
    for rank, result in enumerate(per_rank):
        assert result["small"] == ("ok", "")
        rows = sorted({tuple(r) for label, _, r in result["seen_small"]})
        if rank == world - 1:
            assert all(r == () for r in rows)  # only empty pieces, or none at all
        else:
            assert rows[-1] == tuple(shares[rank])


@pytest.mark.slow  # gloo ranks (the real_ranks fixture)
def test_real_ranks_a_failure_on_one_rank_raises_on_all(real_ranks) -> None:
    _, per_rank = real_ranks
    for rank, result in enumerate(per_rank):
        kind, message = result["raises"]
        if rank == 1:
            assert (kind, message) == ("ZeroDivisionError", "rank 1 fails")
        else:
            assert kind == "RuntimeError" and "rank(s) [1]" in message and "rank 1 fails" in message
        kind, message = result["other_batch"]
        assert kind == "ValueError" and "different batches" in message


def test_real_ranks_need_a_process_group() -> None:
    with pytest.raises(ValueError, match=r"needs torch\.distributed"):
        assert_partition_invariant(correct_fn(), make_batch(), real_ranks=True)
    with pytest.raises(TypeError, match="real_ranks"):
        assert_partition_invariant(correct_fn(), make_batch(), real_ranks="yes")
    assert assert_partition_invariant(correct_fn(), make_batch(), real_ranks=False)
