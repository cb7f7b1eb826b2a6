"""Loggers: each backend's output read back, resume, name safety, failure policy."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import struct
import sys
import time
import warnings
from pathlib import Path

import pytest

from rlmetrics.loggers import (
    ConsoleLogger,
    JsonlLogger,
    LoggerWarning,
    MlflowLogger,
    MultiLogger,
    TensorBoardLogger,
    WandbLogger,
    build_loggers,
    parse_backends,
    sanitize_name,
)

STEPS = {
    1: {"actor/pg_loss": 0.5, "actor/entropy": 1.25, "critic/vf_loss": 2.0, "lr": 1e-3},
    2: {"actor/pg_loss": 0.25, "actor/entropy": 1.0, "critic/vf_loss": 1.5, "lr": 1e-3},
}


@pytest.fixture(scope="module", autouse=True)
def sandbox(tmp_path_factory):
    """HOME, TMPDIR and every W&B/MLflow folder inside one temp dir, W&B offline."""
    root = tmp_path_factory.mktemp("home")
    env = {
        "HOME": root,
        "TMPDIR": root / "tmp",
        "WANDB_MODE": "offline",
        "WANDB_DIR": root / "wandb",
        "WANDB_CACHE_DIR": root / "wandb-cache",
        "WANDB_CONFIG_DIR": root / "wandb-config",
        "WANDB_DATA_DIR": root / "wandb-data",
        "WANDB_SILENT": "true",
        "MLFLOW_TRACKING_URI": (root / "nowhere").as_uri(),
    }
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            if isinstance(value, Path):
                value.mkdir(exist_ok=True)
            mp.setenv(key, str(value))
        mp.setattr("tempfile.tempdir", None)
        yield root
        if "wandb" in sys.modules:
            sys.modules["wandb"].teardown()


def files_under(root: Path) -> list[Path]:
    """Regular files (wandb links its core log into the sandbox's cache: skipped)."""
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]


def assert_inside(root: Path, paths: list[Path]) -> None:
    for path in paths:
        assert path.absolute().is_relative_to(root.absolute()), path


# -- JSONL -----------------------------------------------------------------------------
def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_one_object_per_step_flushed(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    logger = JsonlLogger(path)
    logger.log(1, STEPS[1])
    assert read_lines(path) == [{"step": 1, **STEPS[1]}]  # readable before close
    logger.log(2, STEPS[2])
    logger.close()
    assert read_lines(path) == [{"step": s, **m} for s, m in STEPS.items()]


def test_jsonl_non_finite_values_are_null(tmp_path):
    path = tmp_path / "m.jsonl"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logger = JsonlLogger(path)
        logger.log(0, {"a": math.nan, "b": math.inf, "c": -math.inf, "d": 1})
        logger.close()
    assert path.read_text() == '{"step": 0, "a": null, "b": null, "c": null, "d": 1.0}\n'


def test_jsonl_reopen_appends_and_skips_steps_already_written(tmp_path):
    path = tmp_path / "m.jsonl"
    first = JsonlLogger(path)
    for step in (1, 2, 3):
        first.log(step, {"x": float(step)})
    first.close()
    second = JsonlLogger(path)
    with pytest.warns(LoggerWarning, match="already holds steps up to 3") as record:
        second.log(2, {"x": 20.0})
        second.log(3, {"x": 30.0})
    assert len(record) == 1
    second.log(4, {"x": 4.0})
    second.close()
    assert second.state_dict()["last_step"] == 4
    assert [(r["step"], r["x"]) for r in read_lines(path)] == [(s, float(s)) for s in (1, 2, 3, 4)]


def test_jsonl_resume_step_truncates_to_the_checkpoint(tmp_path):
    path = tmp_path / "m.jsonl"
    logger = JsonlLogger(path)
    for step in range(1, 6):
        logger.log(step, {"x": float(step)})
        if step == 3:
            checkpoint = logger.state_dict()
    logger.close()
    assert checkpoint["last_step"] == 3
    resumed = JsonlLogger(path, resume_step=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.log(4, {"x": 40.0})
    resumed.close()
    assert [(r["step"], r["x"]) for r in read_lines(path)] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]
    again = JsonlLogger(path)
    again.load_state_dict(checkpoint)  # the same, through the checkpointed state
    again.log(4, {"x": 400.0})
    again.close()
    assert read_lines(path)[-1] == {"step": 4, "x": 400.0}
    assert len(read_lines(path)) == 4


def test_jsonl_drops_a_torn_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x"')
    logger = JsonlLogger(path)
    logger.log(2, {"x": 2.0})
    logger.close()
    assert read_lines(path) == [{"step": 1, "x": 1.0}, {"step": 2, "x": 2.0}]


def test_jsonl_metric_named_step_is_dropped_with_a_warning(tmp_path):
    logger = JsonlLogger(tmp_path / "m.jsonl")
    with pytest.warns(LoggerWarning, match="may not be named 'step'") as record:
        logger.log(5, {"step": 99.0, "x": 1.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logger.log(6, {"step": 99.0, "x": 2.0})  # warned once
    logger.close()
    assert read_lines(tmp_path / "m.jsonl") == [{"step": 5, "x": 1.0}, {"step": 6, "x": 2.0}]
    # the line is written: the warning says the metric is left out, not that writing failed
    (message,) = [str(w.message) for w in record]
    assert "failed" not in message and "leaves out the metric named 'step'" in message


class FullDisk:
    """A file whose every write fails as a full disk does."""

    def write(self, text):
        raise OSError(28, "No space left on device")

    def close(self):
        pass


def test_jsonl_write_failure_warns_once_and_never_raises(tmp_path):
    logger = JsonlLogger(tmp_path / "m.jsonl")
    logger._file = FullDisk()
    with pytest.warns(
        LoggerWarning, match="jsonl logger failed to write: OSError.*No space"
    ) as rec:
        logger.log(1, {"x": 1.0})
        logger.log(2, {"x": 2.0})
    assert len(rec) == 1


def test_a_logger_says_at_close_how_many_failures_it_did_not_report(tmp_path):
    """STYLE rule 12: a failure is never swallowed. After the first of its kind, each is
    counted, and the count is reported when the logger closes (once)."""

    logger = JsonlLogger(tmp_path / "m.jsonl")
    logger._file = FullDisk()
    with pytest.warns(LoggerWarning, match="failed to write: OSError"):
        for step in range(5):
            logger.log(step, {"x": 1.0})
    with pytest.warns(LoggerWarning, match=r"failed 4 more to write \(OSError\)") as rec:
        logger.close()
    assert len(rec) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logger.close()  # counted once: nothing more to say


# -- console ---------------------------------------------------------------------------
def test_console_table_grouped_by_prefix_every_k(tmp_path):
    from rich.console import Console

    console = Console(record=True, width=100, file=io.StringIO())
    logger = ConsoleLogger(every=2, console=console)
    logger.log(1, STEPS[1])  # skipped: not a multiple of 2
    logger.log(2, STEPS[2])
    logger.close()
    text = console.export_text()
    assert "step 1" not in text and "step 2" in text
    lines = text.splitlines()
    row = {
        name: next(i for i, line in enumerate(lines) if name in line)
        for name in ("lr", "actor", "pg_loss", "entropy", "critic", "vf_loss")
    }
    assert row["lr"] < row["actor"] <= row["entropy"] < row["pg_loss"] < row["critic"]
    assert "0.25" in lines[row["pg_loss"]] and "1.5" in lines[row["vf_loss"]]
    with pytest.raises(ValueError, match="every"):
        ConsoleLogger(every=0)


def test_console_shows_names_literally_not_as_rich_markup():
    from rich.console import Console

    console = Console(record=True, width=100, file=io.StringIO())
    logger = ConsoleLogger(console=console)
    logger.log(1, {"acc[top1]": 0.5, "eval/[bold]x[/bold]": 1.0, "[red]": 2.0})
    text = console.export_text()
    assert "acc[top1]" in text and "[bold]x[/bold]" in text and "[red]" in text


def test_console_without_rich_prints_plain_text(monkeypatch):
    for name in [m for m in sys.modules if m == "rich" or m.startswith("rich.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "rich", None)
    out = io.StringIO()
    logger = ConsoleLogger(every=2, file=out)  # rich missing: plain text, not ImportError
    assert logger.plain
    logger.log(1, STEPS[1])
    logger.log(2, {**STEPS[2], "acc[top1]": 0.125})
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 2" and lines[1].split() == ["group", "metric", "value"]
    rows = [line.split() for line in lines[2:]]
    assert rows == [
        ["acc[top1]", "0.125"],
        ["lr", "0.001"],
        ["actor", "entropy", "1"],
        ["pg_loss", "0.25"],
        ["critic", "vf_loss", "1.5"],
    ]
    with pytest.raises(ValueError, match="plain=True"):
        ConsoleLogger(plain=True, console=object())
    with pytest.raises(ImportError, match=r"pip install 'rlmetrics\[console\]'"):
        ConsoleLogger(plain=False)  # rich asked for, not installed


# -- TensorBoard -----------------------------------------------------------------------
def read_tensorboard(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_read_back(tmp_path):
    log_dir = tmp_path / "tb"
    logger = TensorBoardLogger(log_dir)
    for step, metrics in STEPS.items():
        logger.log(step, metrics)
    logger.log(3, {"../../escape": 1.0, "nan": math.nan})
    logger.close()
    scalars = read_tensorboard(log_dir)
    assert scalars["actor/pg_loss"] == [(1, 0.5), (2, 0.25)]
    assert scalars["lr"] == [(1, pytest.approx(1e-3)), (2, pytest.approx(1e-3))]
    assert math.isnan(scalars["nan"][0][1])
    assert "../../escape" in scalars  # a tag, not a path
    assert_inside(log_dir, files_under(tmp_path))


# -- W&B -------------------------------------------------------------------------------
def read_wandb_records(path: Path) -> list:
    """Records of a .wandb file (a LevelDB-style log of wandb's own Record protos)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # still being written
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def finished_records(run_root: Path, timeout: float = 20.0) -> list:
    """The run's records once wandb-core has written its exit record (it may lag)."""
    (path,) = run_root.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + timeout
    while True:
        records = read_wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path} has no exit record"
        time.sleep(0.05)


def wandb_history(run_root: Path) -> dict[int, dict[str, float]]:
    history = {}
    for record in finished_records(run_root):
        if record.WhichOneof("record_type") == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            history[record.history.step.num] = {
                k: v for k, v in items.items() if not k.startswith("_")
            }
    return history


def test_wandb_offline_run_read_back(tmp_path):
    pytest.importorskip("wandb")
    logger = WandbLogger(project="test", dir=tmp_path, name="r1", config={"lr": 1e-3})
    for step, metrics in STEPS.items():
        logger.log(step, metrics)
    assert logger.state_dict() == {"run_id": logger.run.id}
    logger.close()
    history = wandb_history(tmp_path)
    assert history[1] == pytest.approx(STEPS[1])
    assert history[2] == pytest.approx(STEPS[2])
    assert_inside(tmp_path, files_under(tmp_path))


# -- MLflow ----------------------------------------------------------------------------
def mlflow_history(logger: MlflowLogger, name: str) -> list[tuple[int, float]]:
    history = logger.client.get_metric_history(logger.run_id, name)
    return sorted((m.step, m.value) for m in history)


def test_mlflow_file_store_read_back(tmp_path):
    pytest.importorskip("mlflow")
    logger = MlflowLogger(run_dir=tmp_path, experiment="exp", run_name="r1")
    for step, metrics in STEPS.items():
        logger.log(step, metrics)
    logger.close()
    assert logger.tracking_uri.startswith("file:")
    assert mlflow_history(logger, "actor/pg_loss") == [(1, 0.5), (2, 0.25)]
    assert mlflow_history(logger, "lr") == [(1, 1e-3), (2, 1e-3)]
    run = logger.client.get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r1"


def test_mlflow_names_sanitised_once_and_kept_inside_the_store(tmp_path):
    pytest.importorskip("mlflow")
    logger = MlflowLogger(run_dir=tmp_path / "run")
    weird = {"../../evil": 1.0, "/abs//x/./y": 2.0, "a:b@c": 3.0, "a_b_c": 4.0, "ok/name": 5.0}
    with pytest.warns(LoggerWarning) as record:
        logger.log(1, weird)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logger.log(2, weird)  # each renaming is reported once
    logger.close()
    messages = [str(w.message) for w in record]
    assert len(messages) == 3  # ok/name and a_b_c keep their names
    assert mlflow_history(logger, "__/__/evil") == [(1, 1.0), (2, 1.0)]
    assert mlflow_history(logger, "abs/x/y") == [(1, 2.0), (2, 2.0)]
    assert mlflow_history(logger, "a_b_c") == [(1, 4.0), (2, 4.0)]
    (renamed,) = [m for m in messages if "'a:b@c'" in m]
    collided = renamed.split(" is logged as ")[1].split("'")[1]
    assert collided.startswith("a_b_c-") and mlflow_history(logger, collided) == [
        (1, 3.0),
        (2, 3.0),
    ]
    assert_inside(tmp_path / "run", files_under(tmp_path))


def test_mlflow_name_sanitised_to_a_leading_dotdot_costs_nothing(tmp_path):
    pytest.importorskip("mlflow")
    logger = MlflowLogger(run_dir=tmp_path / "run")
    metrics = {"ok": 1.0, "...x": 2.0, "..": 3.0, ".../y": 4.0, "a/..b": 5.0}
    with pytest.warns(LoggerWarning):
        for step in (1, 2, 3):
            logger.log(step, metrics)
    logger.close()
    assert mlflow_history(logger, "ok") == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert mlflow_history(logger, "___x") == [(1, 2.0), (2, 2.0), (3, 2.0)]
    assert mlflow_history(logger, "__") == [(1, 3.0), (2, 3.0), (3, 3.0)]
    assert mlflow_history(logger, "___/y") == [(1, 4.0), (2, 4.0), (3, 4.0)]
    assert mlflow_history(logger, "a/__b") == [(1, 5.0), (2, 5.0), (3, 5.0)]


def test_mlflow_one_refused_name_never_costs_the_others(tmp_path):
    """Whatever MLflow refuses (here a name map that passes names through unchanged, so
    MLflow sees '..x'), the other metrics of the batch are logged every step."""
    pytest.importorskip("mlflow")

    from rlmetrics.loggers.mlflow import NameMap

    class Unchanged(NameMap):
        def map_all(self, names):
            return {name: name for name in names}

    logger = MlflowLogger(run_dir=tmp_path / "run")
    logger.names = Unchanged()
    with pytest.warns(LoggerWarning, match=r"MLflow rejected the metric '\.\.x'") as record:
        for step in (1, 2, 3):
            logger.log(step, {"a": float(step), "..x": 1.0, "b": 2.0})
    logger.close()
    assert len(record) == 1
    assert mlflow_history(logger, "a") == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert mlflow_history(logger, "b") == [(1, 2.0), (2, 2.0), (3, 2.0)]


def mlflow_run_metrics(logger: MlflowLogger) -> dict[str, list[tuple[int, float]]]:
    """Every metric of the logger's run, read back by a new MlflowClient: its history."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=logger.tracking_uri)
    keys = client.get_run(logger.run_id).data.metrics
    return {
        key: sorted((m.step, m.value) for m in client.get_metric_history(logger.run_id, key))
        for key in keys
    }


PREFIXED = {  # names that are path prefixes of others: a timer, throughput, group keys
    "timing_s/gen": 1.5,
    "timing_s/gen/mean": 0.75,
    "timing_s/gen/slowest_rank": 1.0,
    "perf/throughput": 10.0,
    "perf/throughput/total": 20.0,
    "critic/score/mean": 0.3,
    "critic/score/mean/short": 0.2,
    "critic/score/mean/long": 0.4,
    "lr": 1e-3,
}


def test_mlflow_names_that_are_path_prefixes_of_others_all_arrive(tmp_path):
    """In the file store a metric's file cannot also be a folder: a name that is a path
    prefix of another is logged as <name>/value, every metric every step, each renaming
    warned about once."""
    pytest.importorskip("mlflow")
    logger = MlflowLogger(run_dir=tmp_path / "run")
    with pytest.warns(LoggerWarning) as record:
        logger.log(1, PREFIXED)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logger.log(2, {k: 2 * v for k, v in PREFIXED.items()})
    logger.close()
    renamed = {"timing_s/gen", "perf/throughput", "critic/score/mean"}
    assert sorted(str(w.message).split("'")[1] for w in record) == sorted(renamed)
    expected = {
        (f"{k}/value" if k in renamed else k): [(1, v), (2, 2 * v)] for k, v in PREFIXED.items()
    }
    assert mlflow_run_metrics(logger) == expected


def test_mlflow_name_under_an_earlier_metric_file_arrives_and_resumes_alike(tmp_path):
    """a/b logged alone, then a/b/c: a/b is already a file, so a/b/c is logged as a/b.c;
    a resumed logger (the run's names read back) maps both names as before."""
    pytest.importorskip("mlflow")
    first = MlflowLogger(run_dir=tmp_path)
    first.log(1, {"a/b": 1.0})
    with pytest.warns(LoggerWarning, match=r"'a/b/c' is logged as 'a/b\.c'"):
        first.log(2, {"a/b": 2.0, "a/b/c": 3.0})
    state = first.state_dict()
    first.close()
    second = MlflowLogger(run_dir=tmp_path)
    second.load_state_dict(state)
    with pytest.warns(LoggerWarning) as caught:
        second.log(3, {"a/b/c": 4.0, "a/b": 5.0, "a/b/d": 6.0})
    second.close()
    assert sorted(str(w.message).split(" (")[0] for w in caught) == [
        "rlmetrics: MLflow metric 'a/b/c' is logged as 'a/b.c'",
        "rlmetrics: MLflow metric 'a/b/d' is logged as 'a/b.d'",
    ]
    assert mlflow_run_metrics(second) == {
        "a/b": [(1, 1.0), (2, 2.0), (3, 5.0)],
        "a/b.c": [(2, 3.0), (3, 4.0)],
        "a/b.d": [(3, 6.0)],
    }


def test_mlflow_any_refusal_of_a_batch_costs_only_the_refused_metric(tmp_path):
    """A batch the store refuses with any error (here the real file store's 'Not a
    directory', names passed through unchanged) goes metric by metric: the refused one
    is named once in a warning, every other metric is logged every step."""
    pytest.importorskip("mlflow")
    from rlmetrics.loggers.mlflow import NameMap

    class Unchanged(NameMap):
        def map_all(self, names):
            return {name: name for name in names}

    logger = MlflowLogger(run_dir=tmp_path / "run")
    logger.names = Unchanged()
    with pytest.warns(LoggerWarning) as record:
        for step in (1, 2, 3):
            logger.log(step, {"a": float(step), "a/b": 1.0, "z": 2.0})
    logger.close()
    (warned,) = [str(w.message) for w in record]
    assert "MLflow rejected the metric 'a/b'" in warned and "Not a directory" in warned
    history = {k: sorted(set(v)) for k, v in mlflow_run_metrics(logger).items()}
    assert history == {"a": [(1, 1.0), (2, 2.0), (3, 3.0)], "z": [(1, 2.0), (2, 2.0), (3, 2.0)]}


def test_mlflow_a_failing_store_refuses_no_metric(tmp_path):
    """When every metric fails alone too (the store itself fails: here its folder is a
    file), no metric is refused: the failure is reported once and, once the store
    works again, every metric is logged."""
    pytest.importorskip("mlflow")
    logger = MlflowLogger(run_dir=tmp_path / "run")
    logger.log(1, {"a": 1.0, "b": 2.0, "c": 3.0})
    metrics_dir = next((tmp_path / "run" / "mlruns").glob("*/*/metrics"))
    os.rename(metrics_dir, metrics_dir.with_name("moved"))
    metrics_dir.write_text("")
    with pytest.warns(LoggerWarning, match="failed to write") as record:
        logger.log(2, {"a": 1.0, "b": 2.0, "c": 3.0})
        logger.log(3, {"a": 1.0, "b": 2.0, "c": 3.0})
    assert len(record) == 1 and "rejected" not in str(record[0].message)
    metrics_dir.unlink()
    os.rename(metrics_dir.with_name("moved"), metrics_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logger.log(4, {"a": 1.0, "b": 2.0, "c": 3.0})
    with pytest.warns(LoggerWarning, match="failed 1 more to write"):  # step 3's, unsaid
        logger.close()
    assert mlflow_run_metrics(logger) == {
        k: [(1, v), (4, v)] for k, v in zip("abc", (1.0, 2.0, 3.0), strict=True)
    }


@pytest.mark.slow
def test_mlflow_gets_every_metric_of_the_demo(tmp_path, monkeypatch):
    """`rlmetrics demo --loggers jsonl,mlflow`: every key of the JSONL reaches MLflow,
    under its name or its documented file-store mapping, with the same value."""
    pytest.importorskip("mlflow")
    from rlmetrics.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    run_dir = tmp_path / "run"
    args = ["demo", "--steps", "2", "--loggers", "jsonl,mlflow", "--run-dir", str(run_dir)]
    assert main([*args, "--no-progress", "--log-every", "0"]) == 0
    rows = read_lines(run_dir / "metrics.jsonl")
    (experiment,) = [p for p in (run_dir / "mlruns").iterdir() if p.name not in ("0", ".trash")]
    (run,) = [p for p in experiment.iterdir() if p.is_dir()]
    logger = MlflowLogger(run_dir=run_dir, run_id=run.name)
    got = mlflow_run_metrics(logger)
    names = {k for k in rows[0] if k != "step"}
    assert len(names) >= 80 and len(got) == len(names)
    for name in names:
        mapped = name if name in got else f"{name}/value"
        assert [step for step, _ in got[mapped]] == [row["step"] for row in rows], name
        assert [v for _, v in got[mapped]] == pytest.approx([row[name] for row in rows]), name


def test_mlflow_resume_continues_the_checkpointed_run(tmp_path):
    pytest.importorskip("mlflow")
    first = MlflowLogger(run_dir=tmp_path)
    first.log(1, {"x": 1.0})
    state = first.state_dict()
    first.close()
    second = MlflowLogger(run_dir=tmp_path)
    second.load_state_dict(state)
    second.log(2, {"x": 2.0})
    second.close()
    assert second.run_id == first.run_id
    assert mlflow_history(second, "x") == [(1, 1.0), (2, 2.0)]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("actor/pg_loss", "actor/pg_loss"),
        ("..", "__"),
        ("", "_"),
        ("a/../../b", "a/__/__/b"),
        ("x" * 300, None),
        ("ünïcode", "_n_code"),
        ("...", "___"),
        ("..x/y", "__x/y"),
        ("./../.../z", "__/___/z"),
        ("a/..b/c", "a/__b/c"),
        (".hidden/..", ".hidden/__"),
        ("." * 300, None),
    ],
)
def test_sanitize_name(name, expected):
    clean = sanitize_name(name)
    if expected is not None:
        assert clean == expected
    assert len(clean) <= 250
    assert os.path.normpath(clean) == clean and not clean.startswith(("/", ".."))
    if importlib.util.find_spec("mlflow") is not None:
        from mlflow.utils.validation import _validate_metric_name

        _validate_metric_name(clean)  # MLflow's own check accepts it


# -- fan-out, extras, failure policy ---------------------------------------------------
def test_build_loggers_all_backends(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    run_dir = tmp_path / "run"
    loggers = build_loggers(
        "console,jsonl,tensorboard,wandb,mlflow",
        run_dir=run_dir,
        run_name="all",
        options={"console": {"console": _quiet_console()}},
    )
    assert list(loggers.loggers) == ["console", "jsonl", "tensorboard", "wandb", "mlflow"]
    with loggers:
        for step, metrics in STEPS.items():
            loggers.log(step, metrics)
        state = loggers.state_dict()
    assert set(state) == {"jsonl", "wandb", "mlflow"}
    assert read_lines(run_dir / "metrics.jsonl")[1] == {"step": 2, **STEPS[2]}
    assert read_tensorboard(run_dir / "tensorboard")["critic/vf_loss"] == [(1, 2.0), (2, 1.5)]
    assert wandb_history(run_dir)[2] == pytest.approx(STEPS[2])
    assert mlflow_history(loggers["mlflow"], "actor/entropy") == [(1, 1.25), (2, 1.0)]
    assert_inside(run_dir, files_under(tmp_path))


def _quiet_console():
    from rich.console import Console

    return Console(file=io.StringIO())


def test_parse_backends(tmp_path):
    assert parse_backends(" JSONL, console,jsonl ,") == ["jsonl", "console"]
    assert parse_backends("none") == parse_backends("") == []
    with pytest.raises(ValueError, match=r"unknown logger 'tensorbord'.*console, jsonl"):
        parse_backends("console,tensorbord")
    assert len(build_loggers("none", run_dir=tmp_path / "run")) == 0


def test_multilogger_isolates_a_failing_backend(tmp_path):
    class Exploding:
        name = "exploding"

        def log(self, step, metrics):
            raise RuntimeError("backend down")

        def close(self):
            raise RuntimeError("cannot close")

    jsonl = JsonlLogger(tmp_path / "m.jsonl")
    multi = MultiLogger([Exploding(), jsonl])
    with pytest.warns(LoggerWarning) as record:
        for step, metrics in STEPS.items():
            multi.log(step, metrics)
        multi.close()
    messages = [str(w.message) for w in record]
    assert len(messages) == 3
    assert "exploding logger failed to log: RuntimeError: backend down" in messages[0]
    assert "failed to close" in messages[1]
    assert "exploding logger failed 1 more to log (RuntimeError)" in messages[2]
    assert len(read_lines(tmp_path / "m.jsonl")) == 2


@pytest.mark.parametrize(
    ("factory", "module", "extra"),
    [
        (lambda d: TensorBoardLogger(d), "torch.utils.tensorboard", "tensorboard"),
        (lambda d: WandbLogger(dir=d), "wandb", "wandb"),
        (lambda d: MlflowLogger(run_dir=d), "mlflow", "mlflow"),
    ],
)
def test_missing_backend_names_the_extra(tmp_path, monkeypatch, factory, module, extra):
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match=rf"pip install 'rlmetrics\[{extra}\]'"):
        factory(tmp_path)
