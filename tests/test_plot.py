"""rlmetrics.plot: JSONL metrics to a figure, and the CLI entry points."""

from __future__ import annotations

import argparse
import json
import math

import pytest

pytest.importorskip("matplotlib")

from rlmetrics.loggers import JsonlLogger
from rlmetrics.plot import add_plot_arguments, main, plot_jsonl, read_jsonl, run_plot

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
    out = plot_jsonl(run_file, ["eval/acc", "actor/pg_loss"], tmp_path / "figs" / "f.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert titles == ["eval/acc", "actor/pg_loss"]


def test_plot_all_metrics_default_output(run_file):
    out = plot_jsonl(run_file)
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
