"""Checkpoints of the reference trainer: rank 0 saves, every rank loads, the run resumes.

One file, ``RUN_DIR/checkpoint.pt``, replaced atomically (a temp file in the same
folder, then ``os.replace``) every ``--checkpoint-every`` steps and at the last step,
after that step's metrics were logged. It holds the step, every model, optimizer and
scheduler, the tracker's and the loggers' ``state_dict`` and the global torch RNG.
Everything in it is tensors and plain python, so it loads with ``weights_only=True``.

Resuming (``--resume``, ``--resume-from PATH``) loads the same file on every rank and
continues at the next step; the loggers resume at the checkpoint's step (the JSONL file
drops what a lost run wrote after it), so the file ends as an uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlmetrics.distributed import all_reduce_sum
from rlmetrics.tracker import Tracker
from rlmetrics.trainer.config import RunConfig, TrainConfig

if TYPE_CHECKING:
    from rlmetrics.trainer.rank import Rank
    from rlmetrics.trainer.report import Reporter

FILE_NAME = "checkpoint.pt"
VERSION = 1
PARTS = (
    "version",
    "step",
    "world_size",
    "config",
    "models",
    "optimizers",
    "schedulers",
    "tracker",
    "loggers",
    "rng",
)
MUST_MATCH = ("task", "model", "algo")  # config sections a resumed run may not change
CRASH_ENV = "RLMETRICS_TEST_CRASH_AFTER_STEP"  # test hook: see maybe_crash_for_test
CRASH_EXIT_CODE = 86


def save(state: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``state`` to ``path`` atomically: a reader sees the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class CheckpointError(ValueError):
    """A checkpoint file that cannot be resumed from (the message names the file)."""


def load(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint written by ``save`` (tensors on the CPU; nothing but data unpickled).

    Raises:
        FileNotFoundError: there is no file at ``path``.
        CheckpointError: the file is not a readable checkpoint (truncated, not written
            by ``torch.save``, another version, missing parts, a negative step); the
            message names the file and what is wrong.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"no checkpoint at {os.fspath(path)!r}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, garbage, unsafe pickle: torch's many types
        raise CheckpointError(
            f"{os.fspath(path)}: not a readable checkpoint (truncated, or not written by "
            f"rlmetrics' trainer): {type(err).__name__}: {err}"
        ) from err
    validate(state, path)
    return state


def validate(state: Any, path: str | os.PathLike) -> None:
    """Raise CheckpointError naming ``path`` unless ``state`` has every part ``restore`` reads."""

    def fail(what: str) -> None:
        raise CheckpointError(f"{os.fspath(path)}: {what}")

    if not isinstance(state, dict):
        fail(f"expected a dict of checkpoint parts, got {type(state).__name__}")
    if state.get("version") != VERSION:
        fail(f"unsupported checkpoint version {state.get('version')!r} (expected {VERSION})")
    missing = [key for key in PARTS if key not in state]
    if missing:
        fail(f"missing parts {missing} (a checkpoint holds {', '.join(PARTS)})")
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        fail(f"step must be an integer >= 0, got {step!r}")
    config = state["config"]
    sections = (*MUST_MATCH, "run")
    if not isinstance(config, dict) or not all(isinstance(config.get(s), dict) for s in sections):
        fail(f"config must hold the sections {sections}")
    models = state["models"]
    if not isinstance(models, dict) or "ref" not in models or "actor" not in models:
        fail("models must hold 'ref' and 'actor'")
    learned = set(models) - {"ref"}
    for part in ("optimizers", "schedulers"):
        if not isinstance(state[part], dict) or set(state[part]) != learned:
            fail(f"{part} must hold one state per trained model {sorted(learned)}")
    if not isinstance(state["rng"], dict) or "torch" not in state["rng"]:
        fail("rng must hold the 'torch' generator state")


def resume_path(run: RunConfig) -> Path | None:
    """The checkpoint to resume from: ``resume_from`` (a file, or a folder holding
    ``checkpoint.pt``; it must exist), else ``RUN_DIR/checkpoint.pt`` with ``resume``
    if it exists, else None (start afresh)."""
    if run.resume_from is not None:
        path = Path(run.resume_from)
        path = path / FILE_NAME if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(
                f"resume_from: no checkpoint at {str(path)!r} (a checkpoint file, or a run "
                f"folder holding {FILE_NAME}; --checkpoint-every K writes one)"
            )
        return path
    path = Path(run.run_dir) / FILE_NAME
    return path if run.resume and path.is_file() else None


def learners(r: Rank) -> dict[str, Any]:
    """The trained models with their optimizers, by name."""
    return {x.name: x for x in (r.actor, r.critic) if x is not None}


def capture(r: Rank, step: int, tracker: Tracker, loggers: dict[str, Any]) -> dict[str, Any]:
    """Everything a rank needs to continue after ``step``."""
    parts = learners(r)
    return {
        "version": VERSION,
        "step": step,
        "world_size": r.world_size,
        "config": asdict(r.cfg),
        "models": {"ref": r.ref.state_dict()} | {k: x.model.state_dict() for k, x in parts.items()},
        "optimizers": {k: x.opt.state_dict() for k, x in parts.items()},
        "schedulers": {k: x.sched.state_dict() for k, x in parts.items()},
        "tracker": tracker.state_dict(),
        "loggers": loggers,
        "rng": {"torch": torch.get_rng_state()},
    }


def check_config(cfg: TrainConfig, saved: dict[str, Any], path: Path) -> None:
    """Raise ValueError naming the fields where ``cfg`` differs from the checkpoint's."""
    now = asdict(cfg)
    diff = [
        f"{section}.{key}: {saved[section].get(key)!r} -> {value!r}"
        for section in MUST_MATCH
        for key, value in now[section].items()
        if saved[section].get(key) != value
    ]
    if saved["run"].get("seed") != cfg.run.seed:
        diff.append(f"run.seed: {saved['run'].get('seed')!r} -> {cfg.run.seed!r}")
    if diff:
        raise ValueError(f"cannot resume from {path}: the config differs ({'; '.join(diff)})")


def restore(r: Rank, tracker: Tracker, state: dict[str, Any]) -> None:
    """Load a checkpoint's models, optimizers, schedulers, tracker and RNG into this rank."""
    r.ref.load_state_dict(state["models"]["ref"])
    for name, learner in learners(r).items():
        learner.model.load_state_dict(state["models"][name])
        learner.opt.load_state_dict(state["optimizers"][name])
        learner.sched.load_state_dict(state["schedulers"][name])
    tracker.load_state_dict(state["tracker"])
    torch.set_rng_state(state["rng"]["torch"])


def maybe_resume(r: Rank, tracker: Tracker) -> dict[str, Any] | None:
    """On every rank: load the checkpoint to resume from, if any, and check that all
    ranks resume at the same step (one small all_reduce, only when resuming is asked)."""
    run = r.cfg.run
    if not (run.resume or run.resume_from is not None):
        return None
    path = resume_path(run)
    state = None
    if path is not None:
        state = load(path)
        check_config(r.cfg, state["config"], path)
        restore(r, tracker, state)
    step = 0 if state is None else int(state["step"])
    counts = torch.tensor([step, step * step, 1], dtype=torch.float64, device=r.device)
    total, squares, n = all_reduce_sum(counts, r.group, run.timeout).tolist()
    if total * total != squares * n:  # the steps' variance is 0 iff every rank agrees
        raise RuntimeError(
            f"ranks resume at different steps (rank {r.rank}: step {step} from {path}); "
            "every rank must see the same RUN_DIR/checkpoint.pt (a shared file system)"
        )
    return state


def due(r: Rank, step: int) -> bool:
    """Whether this rank saves a checkpoint after ``step`` (rank 0 only)."""
    run = r.cfg.run
    every = run.checkpoint_every
    return r.rank == 0 and bool(every) and (step % every == 0 or step == run.steps)


def maybe_save(r: Rank, step: int, tracker: Tracker, reporter: Reporter | None) -> None:
    """On rank 0, every ``checkpoint_every`` steps and at the last step: save (with the
    loggers' positions when this rank reports)."""
    run = r.cfg.run
    if not due(r, step):
        return
    loggers = reporter.state_dict() if reporter is not None else {}
    save(capture(r, step, tracker, loggers), Path(run.run_dir) / FILE_NAME)


def maybe_crash_for_test(r: Rank, step: int) -> None:
    """Test hook: rank 0 dies at once, like a killed process, after step
    ``$RLMETRICS_TEST_CRASH_AFTER_STEP`` (logged and maybe checkpointed)."""
    if r.rank == 0 and os.environ.get(CRASH_ENV) == str(step):
        os._exit(CRASH_EXIT_CODE)
