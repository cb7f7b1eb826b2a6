"""rlmetrics.plot: JSONL metrics to a figure, and the CLI entry points."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

from rlmetrics.loggers import JsonlLogger
from rlmetrics.plot import (
    PAGE_SIZE,
    PlotWarning,
    add_plot_arguments,
    main,
    pages,
    plot_jsonl,
    read_jsonl,
    run_plot,
)

from helpers import SRC_DIR

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def sandbox(tmp_path, monkeypatch):
    """matplotlib's config and cache folders inside the test's temp dir."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "mpl"))


@pytest.fixture
def run_file(tmp_path):
    path = tmp_path / "run.jsonl"
    logger = JsonlLogger(path)
    for step in range(1, 6):
        metrics = {"actor/pg_loss": 1.0 / step, "lr": 1e-3}
        if step % 2:
            metrics["eval/acc"] = step / 10
        if step == 3:
            metrics["actor/pg_loss"] = math.nan  # written as null: a gap
        logger.log(step, metrics)
    logger.close()
    return path


def test_read_jsonl_series(run_file):
    series = read_jsonl(run_file)
    assert sorted(series) == ["actor/pg_loss", "eval/acc", "lr"]
    steps, values = series["actor/pg_loss"]
    assert steps == [1, 2, 3, 4, 5] and math.isnan(values[2]) and values[3] == 0.25
    assert series["eval/acc"] == ([1, 3, 5], [0.1, 0.3, 0.5])


def test_plot_selected_metrics(run_file, tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    titles = []
    real_savefig = Figure.savefig

    def spy(fig, *args, **kwargs):
        titles.extend(ax.get_title(loc="left") for ax in fig.axes)
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    (out,) = plot_jsonl(run_file, ["eval/acc", "actor/pg_loss"], tmp_path / "figs" / "f.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert titles == ["eval/acc", "actor/pg_loss"]


def test_plot_all_metrics_default_output(run_file):
    (out,) = plot_jsonl(run_file)
    assert out == run_file.with_suffix(".png")
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_plot_unknown_metric_names_the_available_ones(run_file, tmp_path):
    with pytest.raises(ValueError, match=r"\['nope'\] are not in .*actor/pg_loss, eval/acc, lr"):
        plot_jsonl(run_file, ["nope"], tmp_path / "x.png")


def test_plot_empty_file_raises(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(ValueError, match="holds no metrics"):
        plot_jsonl(path, None, tmp_path / "x.png")


def test_cli_functions(run_file, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="rlmetrics")
    sub = parser.add_subparsers(dest="command")
    add_plot_arguments(sub.add_parser("plot"))
    args = parser.parse_args(
        ["plot", str(run_file), "--metrics", "lr, eval/acc", "--out", str(tmp_path / "cli.svg")]
    )
    assert run_plot(args) == 0
    assert (tmp_path / "cli.svg").read_text().lstrip().startswith("<?xml")
    assert "wrote" in capsys.readouterr().out


def test_main(run_file, tmp_path, capsys):
    assert main([str(run_file), "--metrics", "lr", "--out", str(tmp_path / "m.png")]) == 0
    assert (tmp_path / "m.png").read_bytes()[:8] == PNG_MAGIC
    assert main([str(run_file), "--metrics", "missing", "--out", str(tmp_path / "m.png")]) == 2
    assert "['missing'] are not in" in capsys.readouterr().err
    assert main([str(tmp_path / "absent.jsonl")]) == 2
    assert "No such file" in capsys.readouterr().err


# -- many metrics: pages, not one giant figure ----------------------------------------
def write_run(path, names, steps=20):
    with open(path, "w") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({"step": step, **{n: step * (i + 1) for i, n in enumerate(names)}}))
            f.write("\n")
    return path


def test_pages_group_by_prefix_and_split_large_groups():
    names = [f"actor/m{i}" for i in range(30)] + ["lr", "critic/a"]
    assert pages(names[:5]) == [("", names[:5])]  # fits on one page: one page
    got = pages(names)
    assert [(g, len(m)) for g, m in got] == [("actor 1/2", 24), ("actor 2/2", 6), ("other", 1),
                                              ("critic", 1)]  # fmt: skip
    assert [n for _, members in got for n in members] == names  # every name once, in order


def test_plot_all_of_many_metrics_one_file_per_page(tmp_path, monkeypatch):
    """Without --metrics, 27 metrics in 3 groups: pages of at most PAGE_SIZE subplots,
    every metric drawn once with its own title (no figure holds them all)."""
    from matplotlib.figure import Figure

    names = [f"{g}/m{i:02d}" for g in ("actor", "critic", "perf") for i in range(9)]
    run = write_run(tmp_path / "run.jsonl", names)
    drawn: list[list[str]] = []
    real_savefig = Figure.savefig

    def spy(fig, *args, **kwargs):
        drawn.append([ax.get_title(loc="left") for ax in fig.axes if ax.get_visible()])
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    paths = plot_jsonl(run, None, tmp_path / "out" / "fig.png")
    assert [p.name for p in paths] == ["fig-01-actor.png", "fig-02-critic.png", "fig-03-perf.png"]
    assert not (tmp_path / "out" / "fig.png").exists()
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in paths)
    assert all(len(titles) <= PAGE_SIZE for titles in drawn)
    assert sorted(t for titles in drawn for t in titles) == sorted(names)


def test_plot_many_metrics_to_one_multi_page_pdf(tmp_path):
    names = [f"g{i % 3}/m{i:02d}" for i in range(27)]
    run = write_run(tmp_path / "run.jsonl", names, steps=5)
    (out,) = plot_jsonl(run, None, tmp_path / "all.pdf")
    data = out.read_bytes()
    assert data[:5] == b"%PDF-"
    assert data.count(b"/Type /Page") - data.count(b"/Type /Pages") == 3


# -- bad lines are skipped, never a crash -----------------------------------------------
def test_bad_lines_are_skipped_with_one_warning(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = [{"step": 1, "x": 1.0}, {"step": 4, "x": 4.0, "s": "text", "b": True}]
    bad = [
        '{"step": 2, "x": ' + "9" * 400 + "}",  # an integer beyond float range
        '{"step": 3, "x": 1, "deep": ' + "[" * 100_000 + "]" * 100_000 + "}",  # too deep
        '{"step": true, "x": 9.0}',  # a bool is not a step
        '{"step": 2.5, "x": 9.0}',  # nor is a fraction
        '{"step": "3", "x": 9.0}',
        "[1, 2]",
        "null",
        '{"x": 9.0}',
        '{"step": 5, "x"',  # torn
    ]
    path.write_text("\n".join([json.dumps(good[0]), *bad[:4], json.dumps(good[1]), *bad[4:]]))
    with pytest.warns(PlotWarning, match=f"skipped {len(bad)} line"):
        series = read_jsonl(path)
    assert series == {"x": ([1, 4], [1.0, 4.0])}
    with pytest.warns(PlotWarning):
        (out,) = plot_jsonl(path, None, tmp_path / "bad.png")
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_plot_without_matplotlib_names_the_extra_before_reading(tmp_path, monkeypatch, capsys):
    import sys

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main([str(tmp_path / "absent.jsonl")]) == 2  # the extra, not the missing file
    assert "pip install 'rlmetrics[plot]'" in capsys.readouterr().err


# -- values matplotlib refuses cost only their own metric ------------------------------
def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_cli_plots_the_rest_beside_a_metric_near_float_max(tmp_path, capsys):
    """A diverging grad norm (finite values near ±1.7e308) is drawn divided by 1e308,
    named on stderr; the other metrics are drawn, the PNG written, exit 0."""
    rows = [
        {"step": s, "loss": 1.0 / s, "grad_norm": (-1) ** s * 1.7e308, "lr": 1e-3}
        for s in range(1, 6)
    ]
    path = write_rows(tmp_path / "run.jsonl", rows)
    out = tmp_path / "fig.png"
    assert main([str(path), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    err = capsys.readouterr().err
    assert "metric 'grad_norm'" in err and "divided by 1e308" in err
    assert "'loss'" not in err and "'lr'" not in err
    from rlmetrics.plot import panel

    drawn = panel("grad_norm", [r["step"] for r in rows], [r["grad_norm"] for r in rows])
    assert drawn.title == "grad_norm (×1e308)"
    assert drawn.values == pytest.approx([(-1) ** s * 1.7 for s in range(1, 6)])


def test_cli_plots_the_rest_beside_other_values_matplotlib_refuses(tmp_path, capsys):
    """Only null (NaN) values, infinities, a single point, a step beyond the float
    range, huge ranges: every metric with a finite value is drawn, each one not drawn
    as it is named on stderr with the reason, exit 0."""
    rows = [
        {"step": s, "ok": float(s), "nulls": None, "one": 2.0 if s == 3 else None,
         "infs": float("inf") if s == 2 else float(-s), "wide": (-1) ** s * 1e299 * s,
         "max": 1.7976931348623157e308 if s == 4 else 1.0}
        for s in range(1, 6)
    ]  # fmt: skip
    text = (
        "".join(json.dumps(row) + "\n" for row in rows) + '{"step": 1' + "0" * 400 + ', "ok": 1}\n'
    )
    path = tmp_path / "run.jsonl"
    path.write_text(text)
    out = tmp_path / "fig.png"
    assert main([str(path), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    err = capsys.readouterr().err
    assert "metric 'nulls': not drawn: no finite value in 5 point(s)" in err
    assert "metric 'infs': 1 infinite value(s) drawn as gaps" in err
    assert "metric 'max': values reach 1.8e+308: drawn divided by 1e308" in err
    assert "metric 'ok': 1 point(s) at steps beyond" in err
    assert "'one'" not in err and "'wide'" not in err
    from rlmetrics.plot import panel

    assert panel("one", [1, 2], [math.nan, 2.0]).drawn
    assert not panel("nulls", [1], [math.nan]).drawn


def test_cli_shows_foreign_warnings_once_and_ends(tmp_path):
    """Warnings matplotlib raises while drawing (a glyph missing from its font for a
    metric named in Chinese or with an emoji; identical x limits for steps near 1e18)
    are shown once each on stderr and the command ends, exit 0, the figure written (they
    were shown inside the block that recorded them, each one recorded again into the
    list being shown: the command never ended). In a fresh interpreter, since pytest
    records warnings itself."""
    rows = [{"step": 10**18 + s, "critic/score/数学": float(s), "reward/🙂": 1.0} for s in range(3)]
    path = write_rows(tmp_path / "run.jsonl", rows)
    out = tmp_path / "fig.png"
    env = {**os.environ, "PYTHONPATH": str(SRC_DIR)}
    command = [sys.executable, "-m", "rlmetrics.plot", str(path), "--out", str(out)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"rlmetrics plot ran for 120 s: {str(expired.stderr)[:500]}")
    assert done.returncode == 0 and done.stdout.startswith("wrote "), done.stderr
    assert out.read_bytes()[:8] == PNG_MAGIC
    for glyph in ("CJK UNIFIED IDEOGRAPH-6570", "SLIGHTLY SMILING FACE"):
        assert done.stderr.count(glyph) == 1, done.stderr
    assert done.stderr.count("identical low and high xlims") == 1, done.stderr


def test_plot_with_nothing_to_draw_is_an_error_naming_each_metric(tmp_path, capsys):
    path = write_rows(tmp_path / "run.jsonl", [{"step": 1, "a": None, "b": None}])
    out = tmp_path / "fig.png"
    assert main([str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "nothing to draw" in err and "'a': not drawn: no finite value" in err and "'b'" in err
    assert not out.exists()


# -- per-group curves (--by) ----------------------------------------------------------
@pytest.fixture
def grouped_file(tmp_path):
    """A per-source run: critic/score/mean with /short and /long, a metric with no
    labels, and one that exists only per label (short only on even steps)."""
    path = tmp_path / "grouped.jsonl"
    with open(path, "w") as f:
        for step in range(1, 7):
            row = {"step": step, "critic/score/mean": step / 10,
                   "critic/score/mean/short": step / 5, "critic/score/mean/long": step / 20,
                   "actor/grad_norm": 1.0, "actor/pg_loss/long": -step}  # fmt: skip
            if step % 2 == 0:
                row["actor/pg_loss/short"] = step
            f.write(json.dumps(row) + "\n")
    return path


def drawn_cells(monkeypatch):
    """What each saved figure's visible cells show: {title: {legend label: (x, y)}}."""
    from matplotlib.figure import Figure

    cells: dict[str, dict[str, tuple[list, list]]] = {}
    real_savefig = Figure.savefig

    def spy(fig, *args, **kwargs):
        for ax in fig.axes:
            if not ax.get_visible():
                continue
            lines = [line for line in ax.get_lines() if len(line.get_xdata())]
            legend = ax.get_legend()
            names = [t.get_text() for t in legend.get_texts()] if legend else [""]
            assert len(names) == len(lines), (ax.get_title(loc="left"), names)
            cells[ax.get_title(loc="left")] = {
                n: (list(line.get_xdata()), list(line.get_ydata()), line.get_color())
                for n, line in zip(names, lines, strict=True)
            }
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    return cells


def test_by_draws_each_label_on_its_metric_subplot(grouped_file, tmp_path, monkeypatch):
    cells = drawn_cells(monkeypatch)
    plot_jsonl(grouped_file, out=tmp_path / "g.png", by=["short", "long"])
    assert sorted(cells) == ["actor/grad_norm", "actor/pg_loss", "critic/score/mean"]
    score = cells["critic/score/mean"]
    assert list(score) == ["all", "short", "long"]
    assert score["all"][:2] == ([1, 2, 3, 4, 5, 6], pytest.approx([s / 10 for s in range(1, 7)]))
    assert score["short"][1] == pytest.approx([s / 5 for s in range(1, 7)])
    assert score["long"][1] == pytest.approx([s / 20 for s in range(1, 7)])
    assert [c[2] for c in score.values()] == ["black", "C0", "C1"]
    pg = cells["actor/pg_loss"]  # only per label; the colours follow the order of by
    assert list(pg) == ["short", "long"] and pg["short"][0] == [2, 4, 6]
    assert [c[2] for c in pg.values()] == ["C0", "C1"]
    assert list(cells["actor/grad_norm"]) == [""]  # no label: one line, no legend


def test_by_with_selected_metrics_and_the_cli(grouped_file, tmp_path, monkeypatch, capsys):
    cells = drawn_cells(monkeypatch)
    out = tmp_path / "c.png"
    args = ["--metrics", "critic/score/mean,actor/pg_loss", "--by", "long", "--out", str(out)]
    assert main([str(grouped_file), *args]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert list(cells["critic/score/mean"]) == ["all", "long"]
    assert list(cells["actor/pg_loss"]) == ["long"]
    assert main([str(grouped_file), "--metrics", "actor/pg_loss", "--out", str(out)]) == 2
    assert "['actor/pg_loss'] are not in" in capsys.readouterr().err  # no --by: no such key
    cells.clear()
    plot_jsonl(grouped_file, ["critic/score/mean/short"], tmp_path / "one.png", by=["long"])
    assert list(cells) == ["critic/score/mean/short"]  # a labelled key chosen by name


def test_pages_fit_their_subplots_and_rank_indices_are_points(tmp_path, monkeypatch):
    """All metrics of a run: a page is as tall as its subplots (no half-empty pages), a
    split group's pages have distinct titles, the page title sits above the first row's
    subplot titles, and a rank index (``*/slowest_rank``) is drawn as points."""
    from matplotlib.figure import Figure

    names = [f"timing_s/s{i:02d}" for i in range(25)] + ["timing_s/gen/slowest_rank", "lr"]
    run = write_run(tmp_path / "run.jsonl", names)
    pages_drawn: list[dict] = []
    real_savefig = Figure.savefig

    def spy(fig, *args, **kwargs):
        fig.canvas.draw()
        axes = [ax for ax in fig.axes if ax.get_visible()]
        pages_drawn.append({
            "title": fig._suptitle.get_text(),
            "height": fig.get_figheight(),
            "title_bottom": fig._suptitle.get_window_extent().y0,
            "row_title_top": max(ax.title.get_window_extent().y1 for ax in axes),
            "styles": {ax.get_title(loc="left"): ax.lines[0].get_linestyle() for ax in axes},
        })  # fmt: skip
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    plot_jsonl(run, None, tmp_path / "fig.png")
    titles = [p["title"] for p in pages_drawn]
    assert titles == ["other", "timing_s 1/2", "timing_s 2/2"]  # sorted names: lr first
    assert pages_drawn[0]["height"] < pages_drawn[2]["height"] < pages_drawn[1]["height"]
    assert all(p["title_bottom"] > p["row_title_top"] for p in pages_drawn)
    styles = {name: style for p in pages_drawn for name, style in p["styles"].items()}
    assert styles["timing_s/gen/slowest_rank"] == "None"
    assert styles["timing_s/s00"] == styles["lr"] == "-"
