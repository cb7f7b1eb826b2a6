"""``rlmetrics audit``: the reference trainer's metrics are invariant, naive ones drift.

One launch of four gloo ranks runs step 1 under the default partitions (dp1 whole,
dp2 micro-batches of 3, dp2 token budget, dp4 uneven shards); a second, smaller one goes
through the command line with ``--naive --plot``. ``--fn`` audits a user module written to
tmp_path over the checker's runs (no processes).
"""

from __future__ import annotations

import math

import pytest
from rich.console import Console

from rlmetrics.cli import main
from rlmetrics.cli.audit import (
    DEFAULT_PARTITIONS,
    RecordingTracker,
    audit_config,
    build_report,
    parse_partitions,
    plot,
    render,
    run_partitions,
    spread,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report():
    runs = run_partitions(audit_config(), parse_partitions(DEFAULT_PARTITIONS))
    return build_report(runs, 1e-9, naive=True)


@pytest.mark.slow  # spawns gloo ranks (the report fixture)
def test_exact_metrics_are_invariant_and_naive_ones_drift(report) -> None:
    assert report.partitions == ["dp1-whole", "dp2-mbs3", "dp2-tokens24", "dp4-mbs1"]
    assert {"actor/pg_loss", "actor/pg_clipfrac", "critic/score/mean"} <= set(report.exact)
    assert report.drifting == []
    assert all(s.ok for s in report.exact.values())
    for name in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_loss", "actor/kl_loss"):
        naive = report.naive[name]
        assert not naive.ok and naive.rel_diff > 1e-3, (name, naive)
    for name in ("actor/lr", "actor/grad_norm_max", "critic/score/max"):
        assert report.naive[name].ok, name  # replicated values and extremes survive
    assert "timing_s/step" in report.excluded and "perf/throughput" in report.excluded
    assert not any(n.startswith(("timing_s/", "perf/")) for n in report.exact)


@pytest.mark.slow  # spawns gloo ranks (the report fixture)
def test_table_names_metrics_sorted_by_drift_and_ends_with_a_verdict(report) -> None:
    console = Console(record=True, width=200)
    render(report, console)
    text = console.export_text()
    assert "actor/pg_clipfrac" in text and "critic/score/mean" in text
    assert f"{len(report.exact)} metrics invariant to 1e-09; 0 drift" in text
    assert "naive (verl-style) aggregation:" in text and "excluded" in text
    order = report.order()
    naive = [report.naive[n].rel_diff for n in order]
    assert naive == sorted(naive, reverse=True)  # no exact drift: by naive spread
    narrow = Console(record=True, width=100)  # the table reads in a 100-column terminal
    render(report, narrow)
    lines = narrow.export_text().splitlines()
    assert max(map(len, lines)) <= 100 and "…" not in "".join(lines)
    header = next(line.split() for line in lines if line.startswith("metric"))
    assert header == ["metric", "value", "exact", "Δ", "naive", "naive", "Δ", "at"]
    rows = {
        line.split()[0]: line.split() for line in lines if line.split()[:1] in [[n] for n in order]
    }
    assert set(rows) == set(order)  # every name whole, on one line
    worst = report.naive[order[0]]  # the naive value shown is the furthest partition's
    assert rows[order[0]][4] == f"{worst.worst_value:.6g}" and rows[order[0]][-1] == worst.worst
    assert len(lines) <= len(order) + 8  # the exclusions fit on a line or two


@pytest.mark.slow  # spawns gloo ranks (the report fixture)
def test_plot_writes_a_png(report, tmp_path) -> None:
    path = plot(report, tmp_path / "audit.png")
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


@pytest.mark.slow  # spawns gloo ranks
def test_command_line_with_naive_and_plot(tmp_path, capsys) -> None:
    out = tmp_path / "cli.png"
    args = ["audit", "--partitions", "1,2:mbs=2", "--num-prompts", "3", "--naive", "--plot",
            str(out)]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "dp2-mbs2" in text and "actor/pg_loss" in text and "0 drift" in text
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_naive_losses_are_pre_scaled_and_summed_per_optimizer_step() -> None:
    import torch

    t = RecordingTracker()
    for values, weight in (([1.0, 1.0], 0.25), ([4.0], 0.5)):  # micro-batches: 2 rows, 1 row
        v = torch.tensor(values, dtype=torch.float64)
        t.mean("actor/pg_loss", v, torch.full_like(v, weight))
        t.mean("actor/pg_clipfrac", v / 8)
    t.mean("actor/grad_norm", 1.0)
    assert t.compute()["actor/pg_loss"] == 2.5  # Σ value·weight: the objective
    fixed, tokens = t.naive(by_tokens=False), t.naive(by_tokens=True)
    assert fixed["actor/pg_loss"] == ("mean", 2.5)  # 1/2 · 1 + 1/2 · 4
    assert tokens["actor/pg_loss"] == ("mean", 2.0)  # 2/3 · 1 + 1/3 · 4
    assert fixed["actor/pg_clipfrac"] == ("mean", (1 / 8 + 4 / 8) / 2)  # mean of means


def test_spread_and_partition_parsing() -> None:
    assert spread({"a": 1.0, "b": 1.0 + 1e-12}, 1e-9).ok
    far = spread({"a": 2.0, "b": 2.0, "c": 3.0}, 1e-9)
    assert (far.abs_diff, far.rel_diff, far.worst, far.ok) == (1.0, 0.5, "c", False)
    assert spread({"a": math.nan, "b": math.nan}, 1e-9).ok
    assert spread({"a": 1.0, "b": None}, 1e-9).abs_diff == math.inf
    parts = parse_partitions("1, 2:mbs=3, 2:tokens=24, 4:whole")
    assert [p.label for p in parts] == ["dp1-whole", "dp2-mbs3", "dp2-tokens24", "dp4-whole"]
    for bad in ("1", "x,2", "1,2:mbs=0", "1,2:size=3"):
        with pytest.raises(ValueError, match="--partitions"):
            parse_partitions(bad)


# -- --fn: a user's function through the checker ---------------------------------------
USER_MODULE = '''
def token_mean(piece, tracker):
    """Correct: a token-weighted mean, merged exactly over any split."""
    loss, mask = piece["loss"], piece["response_mask"]
    tracker.mean("loss/token_mean", loss, mask)


def mean_of_means(piece, tracker):
    """The bug: each micro-batch's own token mean, then the mean of those."""
    token_mean(piece, tracker)
    loss, mask = piece["loss"], piece["response_mask"]
    if mask.sum() > 0:
        tracker.mean("loss/mean_of_means", (loss * mask).sum() / mask.sum())
'''


@pytest.fixture
def user_fn(tmp_path, monkeypatch):
    """A user module and a saved batch in tmp_path, which is the current directory."""
    import sys

    import torch

    name = f"audit_user_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1, 5, 2, 7, 3, 3, 6, 1, 4])
    mask = (torch.arange(8)[None, :] < lengths[:, None]).to(torch.float64)
    loss = torch.rand(len(lengths), 8, generator=gen, dtype=torch.float64)
    torch.save({"loss": loss, "response_mask": mask}, tmp_path / "batch.pt")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the audit puts the cwd first
    yield name
    sys.modules.pop(name, None)


def test_fn_audit_of_a_correct_mean_is_invariant(user_fn, capsys) -> None:
    assert main(["audit", "--fn", f"{user_fn}:token_mean", "--batch", "batch.pt"]) == 0
    text = capsys.readouterr().out
    assert "9 rows" in text and "loss/token_mean" in text
    assert "1 metrics invariant to 1e-09; 0 drift" in text
    assert "ranks=4 micro_batch_size=1" in text and "token_budget=" in text
    assert "naive" not in text  # no naive column in --fn mode


def test_fn_audit_names_a_drifting_mean_of_means_and_plots(user_fn, tmp_path, capsys) -> None:
    args = ["audit", "--fn", f"{user_fn}:mean_of_means", "--batch", "batch.pt",
            "--ranks", "1,2", "--micro-batch-sizes", "2,4", "--plot", "fn.png"]  # fmt: skip
    assert main(args) == 1
    text = capsys.readouterr().out
    assert "1 metrics invariant to 1e-09; 1 drift" in text
    drifting = [line for line in text.splitlines() if "DRIFT" in line]
    assert len(drifting) == 1 and "loss/mean_of_means" in drifting[0]
    assert "ranks=2 micro_batch_size=4" in text and "ranks=4" not in text
    assert "micro_batch_size=3" not in text
    data = (tmp_path / "fn.png").read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_fn_audit_rejects_bad_arguments(user_fn, capsys) -> None:
    for args, message in (
        (["--fn", f"{user_fn}:token_mean"], "--fn and --batch go together"),
        (["--fn", f"{user_fn}", "--batch", "batch.pt"], "MODULE:FUNCTION"),
        (["--fn", f"{user_fn}:nope", "--batch", "batch.pt"], "has no 'nope'"),
        (["--fn", "no_such_module_xyz:f", "--batch", "batch.pt"], "cannot import"),
        (["--fn", f"{user_fn}:token_mean", "--batch", "missing.pt"], "cannot load"),
        (["--fn", f"{user_fn}:token_mean", "--batch", "batch.pt", "--ranks", "0"], ">= 1"),
        (["--fn", f"{user_fn}:token_mean", "--batch", "batch.pt", "--naive"], "trainer audit"),
    ):
        with pytest.raises(SystemExit) as exit_info:  # a usage error, never 1 ("drift")
            main(["audit", *args])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_partition_runs_are_the_checkers_runs() -> None:
    import torch

    from rlmetrics.testing import assert_partition_invariant, partition_runs

    def fn(piece, tracker):
        tracker.mean("x", piece["x"])

    batch = {"x": torch.arange(5, dtype=torch.float64)}
    runs = partition_runs(fn, batch, ranks=(1, 2, 2), micro_batch_sizes=(2,), epochs=(1, 2))
    # whole batch + 2 ranks x (size 2, +empty pieces) x 2 epochs + shuffled x 2 epochs
    assert list(runs)[:3] == ["whole batch", "ranks=1 micro_batch_size=2",
                              "ranks=1 micro_batch_size=2 epochs=2"]  # fmt: skip
    assert len(runs) == 11 and all(m == {"x": 2.0} for m in runs.values())
    assert assert_partition_invariant(fn, batch) == runs["whole batch"]
    with pytest.raises(TypeError, match="real_ranks"):
        partition_runs(fn, batch, real_ranks=True)


def test_the_demos_naive_values_are_the_audits_mean_of_micro_batch_means() -> None:
    """``naive/actor/pg_clipfrac`` (``MetricsConfig.naive``, on in ``rlmetrics demo``) is the
    mean of each micro-batch's own clip fraction: what the audit's recording tracker,
    which keeps every log call's own value, reduces naively. Uneven micro-batches move
    it away from the exact value."""
    from dataclasses import replace

    from rlmetrics.trainer.config import MetricsConfig
    from rlmetrics.trainer.train import setup, train_step

    cfg = audit_config()
    cfg = replace(cfg, algo=replace(cfg.algo, micro_batch_size=2),
                  metrics=MetricsConfig(naive=True))  # fmt: skip
    tracker = RecordingTracker()
    metrics = train_step(setup(cfg, 0, 1, None, None), 1, tracker)
    naive = tracker.naive(by_tokens=False)
    for name in ("actor/pg_clipfrac", "actor/ppo_kl"):
        assert math.isclose(metrics[f"naive/{name}"], naive[name][1], rel_tol=1e-12), name
    assert metrics["naive/actor/pg_clipfrac"] != metrics["actor/pg_clipfrac"] > 0
