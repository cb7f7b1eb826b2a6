"""Resume: a trainer run that dies and is resumed writes an uninterrupted run's JSONL.

The end-to-end test runs ``rlmetrics demo`` (spawn, 2 gloo ranks, float64, 6 steps,
a checkpoint every 2) three times: uninterrupted; killed (``os._exit`` on rank 0 after
step 5 was logged, through the test hook ``RLMETRICS_TEST_CRASH_AFTER_STEP``); resumed
from step 4. The resumed file holds steps 1..6 once each, every metric but timings
bit-identical to the uninterrupted run's. Tracker states survive the checkpoint file
(``torch.load(weights_only=True)``) mid-step; ``test_kinds.py`` covers the JSON route.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp

from rlmetrics import Tracker
from rlmetrics.cli import build_parser, config_from_args, main
from rlmetrics.trainer import (
    AlgoConfig,
    ModelConfig,
    RunConfig,
    TaskConfig,
    TrainConfig,
    checkpoint,
    train,
)
from rlmetrics.trainer.checkpoint import CRASH_ENV, CRASH_EXIT_CODE, FILE_NAME

from gloo_ranks import ok_results, run_ranks

SKIP = ("timing_s/", "timing_per_token_ms/", "perf/", "actor/perf/", "critic/perf/")
FLAGS = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--num-prompts", "4",
         "--samples-per-prompt", "3", "--mini-batches", "2", "--micro-batch-size", "2",
         "--warmup-steps", "2", "--dtype", "float64", "--seed", "5", "--steps", "6",
         "--dp", "2", "--checkpoint-every", "2", "--loggers", "jsonl", "--log-every", "0",
         "--no-progress"]  # fmt: skip


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def exact(row: dict) -> dict:
    """A JSONL row without the timings and throughput (which no two runs share), NaN
    written as the string "nan" so that equal rows compare equal."""
    return {k: "nan" if v != v else v for k, v in row.items() if not k.startswith(SKIP)}


def test_killed_and_resumed_run_writes_the_uninterrupted_jsonl(tmp_path, monkeypatch) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["demo", *FLAGS, "--run-dir", str(a)]) == 0
    monkeypatch.setenv(CRASH_ENV, "5")
    with pytest.raises(mp.ProcessExitedException, match=f"exit code {CRASH_EXIT_CODE}"):
        main(["demo", *FLAGS, "--run-dir", str(b)])
    assert [row["step"] for row in read_jsonl(b / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert checkpoint.load(b / FILE_NAME)["step"] == 4
    monkeypatch.delenv(CRASH_ENV)
    assert main(["demo", *FLAGS, "--run-dir", str(b), "--resume"]) == 0
    want, got = read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl")
    assert [row["step"] for row in got] == [1, 2, 3, 4, 5, 6]  # 5 rewritten, not duplicated
    assert "actor/lr" in got[0] and "timing_s/step" in got[5]
    for step, (x, y) in enumerate(zip(got, want, strict=True), start=1):
        assert exact(x) == exact(y), f"step {step} differs after the resume"
    assert checkpoint.load(b / FILE_NAME)["step"] == 6
    assert not list(b.glob("*.tmp"))


QUIET = {"steps": 4, "dp": 1, "loggers": "jsonl", "log_every": 0, "progress": False,
         "checkpoint_every": 2}  # fmt: skip


def tiny(run_dir, **run: object) -> TrainConfig:
    """A 4-step float64 PPO run on one in-process rank (the critic is checkpointed too)."""
    return TrainConfig(
        task=TaskConfig(num_symbols=3, max_prompt_len=3),
        model=ModelConfig(n_layer=1, n_head=2, n_embd=16, dtype="float64"),
        algo=AlgoConfig(
            algo="ppo", num_prompts=3, samples_per_prompt=2, mini_batches=2, warmup_steps=1
        ),
        run=RunConfig(**{**QUIET, "run_dir": str(run_dir), **run}),
    )


class Crash(Exception):
    """Stands for a crash of the in-process run."""


def test_ppo_resume_in_process_and_resume_from(tmp_path, monkeypatch) -> None:
    """dp 1, PPO: a run stopped after step 3 and resumed equals one that never stopped;
    ``resume_from`` starts a new run dir from another run's checkpoint."""
    want = train(tiny(tmp_path / "a", resume=True))  # no checkpoint yet: starts afresh

    def crash_after_3(r: object, step: int) -> None:
        if step == 3:
            raise Crash

    monkeypatch.setattr(checkpoint, "maybe_crash_for_test", crash_after_3)
    with pytest.raises(Crash):
        train(tiny(tmp_path / "b"))
    monkeypatch.undo()
    got = train(tiny(tmp_path / "b", resume=True))
    assert [exact(m) for m in got] == [exact(m) for m in want[2:]]
    rows = read_jsonl(tmp_path / "b" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert [exact(r) for r in rows] == [exact(r) for r in read_jsonl(tmp_path / "a/metrics.jsonl")]
    assert "critic/vf_loss" in rows[-1]
    later = train(tiny(tmp_path / "c", resume_from=str(tmp_path / "b")))
    assert later == []  # b's checkpoint is at its last step: nothing left to run
    assert read_jsonl(tmp_path / "c" / "metrics.jsonl") == []


def test_resume_refuses_another_config_and_a_missing_checkpoint(tmp_path) -> None:
    cfg = tiny(tmp_path)
    r_cfg = replace(cfg, run=replace(cfg.run, steps=2))
    train(r_cfg)
    other = replace(r_cfg, algo=replace(r_cfg.algo, lr=1e-4), run=replace(r_cfg.run, resume=True))
    with pytest.raises(ValueError, match=r"config differs \(algo.lr: 0.0015 -> 0.0001\)"):
        train(other)
    with pytest.raises(FileNotFoundError, match="resume_from: no checkpoint at"):
        train(replace(cfg, run=replace(cfg.run, resume_from=str(tmp_path / "nowhere"))))
    with pytest.raises(ValueError, match="checkpoint_every must be >= 0, got -1"):
        RunConfig(checkpoint_every=-1)


def resume_in(rank: int, world_size: int, run_dirs: list[str]) -> str:
    """Rank r resumes from ``run_dirs[r]``; returns the error it raised."""
    with pytest.raises(RuntimeError, match="ranks resume at different steps") as err:
        train(tiny(run_dirs[rank], resume=True), rank, world_size, report=False)
    return str(err.value)


def test_ranks_that_find_different_checkpoints_refuse_to_train(tmp_path) -> None:
    """Rank 0 sees a checkpoint at step 4, rank 1 none (no shared file system)."""
    train(tiny(tmp_path / "0"))
    errors = ok_results(run_ranks(resume_in, 2, [str(tmp_path / "0"), str(tmp_path / "1")]))
    assert "rank 0: step 4" in errors[0] and "rank 1: step 0 from None" in errors[1]


def test_flags_map_onto_the_run_config() -> None:
    args = ["demo", "--checkpoint-every", "3", "--resume", "--resume-from", "runs/x"]
    run = config_from_args(build_parser().parse_args(args)).run
    assert (run.checkpoint_every, run.resume, run.resume_from) == (3, True, "runs/x")
    assert config_from_args(build_parser().parse_args(["demo"])).run.resume is False


def fill(t: Tracker, scale: float) -> None:
    """A few updates of every built-in kind (python numbers and tensors)."""
    t.mean("m", torch.tensor([1.0, 2.5, -3.0]) * scale, torch.tensor([1.0, 0.0, 2.0]))
    t.sum("s", 0.1 * scale)
    t.max("hi", torch.tensor([scale, -scale]))
    t.min("lo", -2.0 * scale)
    t.std("sd", torch.tensor([1e8 + scale, 1e8 - scale, 1e8]))
    t.last("lr", 1e-3 * scale)
    t.dist("d", torch.tensor([scale, 2.0, -scale]))


def test_tracker_state_survives_the_checkpoint_file_mid_step(tmp_path) -> None:
    """Half a step, saved as in a checkpoint (weights_only load), loaded into a fresh
    tracker, then the rest of the step: the same result as never stopping."""
    whole, first = Tracker(), Tracker()
    for t in (whole, first):
        fill(t, 1.0)
    checkpoint.save({"version": checkpoint.VERSION, "tracker": first.state_dict()},
                    tmp_path / FILE_NAME)  # fmt: skip
    resumed = Tracker()
    resumed.load_state_dict(torch.load(tmp_path / FILE_NAME, weights_only=True)["tracker"])
    for t in (whole, resumed):
        fill(t, 3.0)
    got, want = resumed.compute(), whole.compute()
    assert got.keys() == want.keys() and len(want) >= 7
    assert all(got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k])) for k in want)


def test_save_is_atomic(tmp_path, monkeypatch) -> None:
    """A save that fails in mid-write leaves the previous checkpoint and no temp file."""
    path = tmp_path / FILE_NAME
    checkpoint.save({"version": checkpoint.VERSION, "step": 2}, path)

    def torn(state: object, f: object) -> None:
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", torn)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save({"version": checkpoint.VERSION, "step": 4}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True)["step"] == 2
    assert [p.name for p in tmp_path.iterdir()] == [FILE_NAME]


# -- corrupted checkpoints: a clear error naming the file and the problem ---------------
def corrupt(state: dict, how: str, path) -> None:
    """Write a damaged copy of a real checkpoint ``state`` to ``path``."""
    good = path.with_name("good.pt")
    checkpoint.save(state, good)
    data = good.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(b"\x00not a checkpoint\xff" * 64)
    elif how == "not a dict":
        torch.save([1, 2, 3], path)
    elif how == "missing keys":
        checkpoint.save({k: v for k, v in state.items() if k not in ("optimizers", "rng")}, path)
    elif how == "negative step":
        checkpoint.save({**state, "step": -3}, path)
    elif how == "bool step":
        checkpoint.save({**state, "step": True}, path)
    elif how == "missing learner":
        checkpoint.save({**state, "schedulers": {}}, path)


CORRUPTIONS = {  # how: what the error says
    "truncated": "not a readable checkpoint",
    "empty": "not a readable checkpoint",
    "garbage": "not a readable checkpoint",
    "not a dict": "expected a dict of checkpoint parts, got list",
    "missing keys": r"missing parts \['optimizers', 'rng'\]",
    "negative step": "step must be an integer >= 0, got -3",
    "bool step": "step must be an integer >= 0, got True",
    "missing learner": r"schedulers must hold one state per trained model \['actor', 'critic'\]",
}


@pytest.fixture(scope="module")
def real_state(tmp_path_factory) -> dict:
    """The checkpoint of a 1-step in-process PPO run (actor, critic, reference)."""
    run_dir = tmp_path_factory.mktemp("real")
    train(tiny(run_dir, steps=1, checkpoint_every=1))
    return torch.load(run_dir / FILE_NAME, weights_only=True)


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_corrupted_checkpoint_names_the_file_and_the_problem(tmp_path, real_state, how) -> None:
    path = tmp_path / FILE_NAME
    corrupt(real_state, how, path)
    with pytest.raises(checkpoint.CheckpointError, match=CORRUPTIONS[how]) as err:
        checkpoint.load(path)
    assert str(err.value).startswith(str(path))
    with pytest.raises(checkpoint.CheckpointError, match=CORRUPTIONS[how]):  # the trainer too
        train(tiny(tmp_path / "run", steps=2, resume_from=str(path)))
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not read_jsonl(
        tmp_path / "run" / "metrics.jsonl"
    )


def test_demo_rejects_a_bad_checkpoint_before_spawning(tmp_path, real_state, monkeypatch,
                                                       capsys) -> None:  # fmt: skip
    """--resume-from a missing or corrupted checkpoint: a usage error naming it, no rank
    started (was a rank's traceback, after spawning)."""
    from rlmetrics.trainer import launch

    def no_spawn(cfg):
        raise AssertionError("ranks were spawned")

    monkeypatch.setattr(launch, "spawn", no_spawn)
    negative = tmp_path / "neg.pt"
    corrupt(real_state, "negative step", negative)
    cases = {
        str(tmp_path / "nowhere"): "resume_from: no checkpoint at",
        str(tmp_path): "resume_from: no checkpoint at .*checkpoint.pt",  # a dir without one
        str(negative): "step must be an integer >= 0, got -3",
    }
    for target, message in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            main(["demo", *FLAGS, "--run-dir", str(tmp_path / "b"), "--resume-from", target])
        assert exit_info.value.code == 2
        assert re.search(message, capsys.readouterr().err), target
