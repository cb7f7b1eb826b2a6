"""``rlmetrics audit``: the reference trainer's metrics are invariant, naive ones drift.

One launch of four gloo ranks runs step 1 under the default partitions (dp1 whole,
dp2 micro-batches of 3, dp2 token budget, dp4 uneven shards); a second, smaller one goes
through the command line with ``--naive --plot``.
"""

from __future__ import annotations

import math

import pytest
from rich.console import Console

from rlmetrics.audit import (
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
from rlmetrics.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report():
    runs = run_partitions(audit_config(), parse_partitions(DEFAULT_PARTITIONS))
    return build_report(runs, 1e-9, naive=True)


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


def test_plot_writes_a_png(report, tmp_path) -> None:
    path = plot(report, tmp_path / "audit.png")
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


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
