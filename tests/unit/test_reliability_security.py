"""Security: metric names cannot steer file loggers out of their run directory, and the
sync path decodes peers' data as JSON and float64 tensors, never by unpickling (only user
kinds whose extras cannot be packed travel pickled, between the group's ranks)."""

from __future__ import annotations

import ast
import inspect
import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist

from rlmetrics import Tracker
from rlmetrics._engine import sync as rd
from rlmetrics._engine.schema import read_schema
from rlmetrics.loggers import JsonlLogger, MlflowLogger, TensorBoardLogger

from gloo_ranks import ok_results, run_together

EVIL_NAMES = [
    "../../x",
    "../" * 12 + "escaped",
    "/etc/passwd",
    "a/../../b",
    "..",
    ".",
    "/",
    "//server/share/y",
    "C:\\Windows\\z",
    "..\\..\\w",
    "x/./../../../../v",
    "nul\x00/../../u",
    "~/home_file",
    "$HOME/env_file",
]


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HOME and TMPDIR inside tmp_path; the run dir three levels down."""
    for name in ("home", "tmp"):
        (tmp_path / name).mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "nowhere").as_uri())
    monkeypatch.setattr("tempfile.tempdir", None)
    run_dir = tmp_path / "a" / "b" / "run"
    run_dir.mkdir(parents=True)
    return run_dir


def outside(root: Path, run_dir: Path) -> list[Path]:
    """Every file or folder under ``root`` that is not under ``run_dir`` (or its parents,
    or the empty HOME/TMPDIR)."""
    allowed = {root / "home", root / "tmp", root / "a", root / "a" / "b", run_dir}
    return [p for p in root.rglob("*") if p not in allowed and not p.is_relative_to(run_dir)]


@pytest.mark.parametrize("backend", ["jsonl", "tensorboard", "mlflow"])
def test_metric_names_cannot_write_outside_the_run_dir(sandbox: Path, backend: str) -> None:
    run_dir = sandbox
    root = run_dir.parents[2]
    passwd = Path("/etc/passwd")
    before = passwd.stat().st_mtime_ns if passwd.exists() else None
    metrics = {name: float(i) for i, name in enumerate(EVIL_NAMES)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MLflow's renaming warnings
        if backend == "jsonl":
            logger = JsonlLogger(run_dir / "metrics.jsonl")
        elif backend == "tensorboard":
            logger = TensorBoardLogger(run_dir / "tb")
        else:
            logger = MlflowLogger(run_dir=run_dir)
        logger.log(1, metrics)
        logger.log(2, metrics)
        logger.close()
    assert outside(root, run_dir) == []
    assert not (root / "home").exists() or not any((root / "home").iterdir())
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert written, "the logger wrote nothing at all"
    if before is not None:
        assert passwd.stat().st_mtime_ns == before
    for path in written:  # no file is a link that points elsewhere
        assert path.resolve().is_relative_to(run_dir.resolve()), path


def test_the_only_unpickling_in_the_sync_path_is_the_user_kind_object_gather() -> None:
    """Static check of _engine/sync.py: one pickle.loads, inside _gather_extras, under
    the ``if objects`` branch (user kinds whose extras cannot be packed)."""
    tree = ast.parse(inspect.getsource(rd))
    loads = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in ("loads", "load", "Unpickler")
        and isinstance(node.value, ast.Name)
        and node.value.id in ("pickle", "cloudpickle")
    ]
    assert len(loads) == 1
    gather = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_gather_extras"
    )
    branch = next(
        n for n in ast.walk(gather) if isinstance(n, ast.If) and ast.unparse(n.test) == "objects"
    )
    assert any(node is loads[0] for node in ast.walk(branch))
    assert "all_gather_object" not in inspect.getsource(rd)
    assert "broadcast_object_list" not in inspect.getsource(rd)


class Boom:
    """Unpickling this creates a marker file: proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


class NoPickle:
    """Stands in for the pickle module inside rlmetrics._engine.sync: any use fails."""

    def __getattr__(self, name: str):
        raise AssertionError(f"pickle.{name} used in the sync path")


def hostile_schema(rank: int, world: int, marker: str, mode: str) -> str:
    """Rank 1 sends a pickle (or a code-like JSON schema) instead of its schema; no rank
    may execute anything. Built-in kinds never touch pickle at all. Over a new group
    (nothing agreed yet, so the schema travels), the patches undone afterwards."""
    group = tdist.new_group(list(range(world)))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rd, "pickle", NoPickle())
        tracker = Tracker()
        tracker.mean("loss", 1.0)
        tracker.std("std", torch.tensor([1.0, 3.0]))
        tracker.dist("dist", [1.0, 2.0])
        if mode == "clean":
            return repr(tracker.compute(group=group, timeout=30))
        if rank == 1:
            original = rd.gather_bytes
            hostile = {
                "pickle": pickle.dumps(Boom(marker)),
                "json": b'[["__import__(\'os\').system(\'touch x\')", "os.system", "eval"]]',
            }[mode]

            def send_hostile(payload: bytes, *args, **kwargs):
                return original(hostile, *args, **kwargs)

            patch.setattr(rd, "gather_bytes", send_hostile)
        try:
            tracker.compute(group=group, timeout=30)
        except ValueError as error:  # JSONDecodeError, or an unknown kind
            return f"{type(error).__name__}: {error}"
        return "no error"


MODES = ("clean", "pickle", "json")


@pytest.fixture(scope="module")
def hostile_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The three modes in turn on one spawned pair of ranks, each with its own marker."""
    root = tmp_path_factory.mktemp("hostile")
    calls = {mode: (hostile_schema, (str(root / mode / "pwned"), mode)) for mode in MODES}
    for mode in MODES:
        (root / mode).mkdir()
    return root, run_together(calls, 2, timeout=300)


@pytest.mark.slow  # two gloo ranks
@pytest.mark.parametrize("mode", MODES)
def test_a_hostile_schema_is_decoded_as_json_and_executes_nothing(
    hostile_runs: tuple[Path, dict], mode: str
) -> None:
    root, outcomes = hostile_runs
    tmp_path = root / mode
    marker = tmp_path / "pwned"
    results = ok_results(outcomes[mode])
    assert not marker.exists()
    if mode == "clean":
        assert results[0] == results[1] and "'loss': 1.0" in results[0]
        return
    for message in results:  # every rank fails the same way, nothing hangs
        assert message != "no error"
        if mode == "pickle":
            assert message.startswith("JSONDecodeError") or "decode" in message.lower()
        else:
            assert "os.system" in message or "unpack" in message
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b'[["__import__(\'os\').system(\'touch x\')", "os.system", "eval"]]',
        b'{"metrics": [["x", "mean"]], "kinds": {}}',
        b'{"metrics": [[1, "mean", null]], "kinds": {}}',
        b'{"metrics": [], "kinds": []}',
        b'{"kinds": {}}',
        b"null",
    ],
)
def test_a_schema_of_another_form_is_a_value_error_naming_the_rank(data: bytes) -> None:
    with pytest.raises(ValueError, match="rank 3 sent a schema"):
        read_schema(3, data)


def test_a_schema_as_agree_schema_sends_it_is_read_back() -> None:
    sent = {"metrics": [["x", "dist", ["dist", [0.5]]]], "kinds": {"dist": ["dist", [0.5]]}}
    assert read_schema(0, json.dumps(sent).encode()) == sent
