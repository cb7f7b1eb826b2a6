"""Launchers: spawn D local gloo ranks, or join a torchrun job from its environment.

Both end in ``train(config, rank, world_size)``. The Ray launcher (``ray_launch.py``)
runs the ranks in actors and the loop on its driver.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlmetrics.distributed import free_port
from rlmetrics.trainer.config import TrainConfig
from rlmetrics.trainer.train import train


def threads_per_rank(world_size: int) -> int:
    """CPU threads each local rank may use without oversubscribing the machine."""
    return max(1, (os.cpu_count() or 1) // world_size)


def check_device(device: str | None) -> None:
    """Raise ValueError naming ``--device`` when this machine has no such device."""
    if device is None or device == "cpu":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    index = torch.device(device).index
    if index is not None and index >= count:
        raise ValueError(
            f"--device {device}: this machine has {count} GPU(s) (cuda:0 to cuda:{count - 1})"
        )


def rank_device(device: str | None, local_rank: int) -> torch.device:
    """Where local rank ``local_rank`` trains for ``--device``: None and "cpu" the CPU,
    "cuda" GPU ``local_rank`` mod the GPU count, "cuda:N" that GPU (made current)."""
    check_device(device)
    if device is None or device == "cpu":
        return torch.device("cpu")
    if device == "cuda":
        chosen = torch.device("cuda", local_rank % torch.cuda.device_count())
    else:
        chosen = torch.device(device)
    torch.cuda.set_device(chosen)
    return chosen


def _spawned(rank: int, cfg: TrainConfig, world_size: int, port: int, out: str) -> None:
    """One spawned rank: init gloo on 127.0.0.1, train, rank 0 saves the history."""
    torch.set_num_threads(threads_per_rank(world_size))
    device = rank_device(cfg.run.device, rank)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=cfg.run.timeout),
    )
    try:
        history = train(cfg, rank, world_size, device=device)
        dist.barrier()  # leave together: a rank tearing gloo down early can abort a peer
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(history))
    exit_now(0)


def exit_now(code: int) -> None:
    """End a finished rank without the interpreter's teardown.

    Gloo's worker threads can still hold work objects with tensors when Python
    finalises; destroying them then aborts the process ("terminate called without an
    active exception", SIGABRT) although every step, log and file is done. The
    process group is destroyed and output flushed before this is called.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn(cfg: TrainConfig) -> list[dict[str, float]]:
    """Run ``cfg.run.dp`` local ranks (gloo, also for ranks on GPUs; one process each
    unless dp is 1) on ``cfg.run.device``.

    Returns rank 0's history: every step's metrics. A failing rank raises here with
    its traceback (``torch.multiprocessing.ProcessRaisedException``).
    """
    world_size = cfg.run.dp
    if world_size == 1:
        torch.set_num_threads(threads_per_rank(1))
        return train(cfg, 0, 1, device=rank_device(cfg.run.device, 0))
    with tempfile.TemporaryDirectory(prefix="rlmetrics-") as tmp:
        out = str(Path(tmp) / "history.json")
        mp.spawn(_spawned, args=(cfg, world_size, free_port(), out), nprocs=world_size)
        return json.loads(Path(out).read_text())


def from_env(cfg: TrainConfig) -> list[dict[str, float]]:
    """Join the job torchrun started (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    NCCL and one GPU per process when CUDA is available, gloo on the CPU otherwise;
    ``--device`` chooses instead when given (NCCL for cuda, gloo for cpu).
    """
    try:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    except KeyError as err:
        raise RuntimeError(
            f"environment variable {err.args[0]} is not set: start this with torchrun, "
            "e.g. torchrun --nproc-per-node 2 -m rlmetrics.trainer (or use rlmetrics demo)"
        ) from err
    kwargs: dict[str, Any] = {}
    if cfg.run.device is None:
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else "cpu"
    else:
        device = rank_device(cfg.run.device, local_rank)
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        torch.set_num_threads(threads_per_rank(local))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.run.timeout), **kwargs)
    try:
        history = train(cfg, rank, world_size, device=device)
        dist.barrier()  # leave together: a rank tearing gloo down early can abort a peer
        return history
    finally:
        dist.destroy_process_group()
