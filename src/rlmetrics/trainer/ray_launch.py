"""The Ray launcher: D actors, one gloo rank each; the driver owns the loop and the loggers.

    rlmetrics demo --launcher ray --dp 2                        # a local Ray, 2 actors
    rlmetrics demo --launcher ray --metrics-path driver         # merge states on the driver
    rlmetrics demo --launcher ray --ray-address auto            # an existing cluster

Each actor builds what a spawned rank builds (``train.setup``) and joins one gloo group
with its peers, which all-reduces the gradients. For step t the driver calls every
actor's ``step(t)``, waits for all of them and logs one dict:

* ``collective``: each actor ends the step with ``tracker.compute(group)``; every actor
  returns the same dict and the driver logs rank 0's after checking that they agree.
* ``driver``: each actor returns ``tracker.state()`` (and resets); the driver merges the
  states in rank order (``rlmetrics.integrations.ray.call_and_merge``) and computes the dict.

Both give the numbers the spawn launcher gives; only timings differ. Importing this
module imports Ray; the rest of the trainer never does.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from datetime import timedelta
from typing import Any

try:
    import ray
except ImportError as error:
    raise ImportError(
        "the Ray launcher needs Ray, an optional extra: pip install 'rlmetrics[ray]'"
    ) from error

import torch
import torch.distributed as dist

from rlmetrics.integrations.ray import call_and_merge, compute_states, init_ray, with_metrics
from rlmetrics.state import TrackerState
from rlmetrics.tracker import Tracker
from rlmetrics.trainer import extras
from rlmetrics.trainer.config import METRICS_PATHS, TrainConfig, check
from rlmetrics.trainer.launch import free_port, threads_per_rank
from rlmetrics.trainer.rank import Rank
from rlmetrics.trainer.report import Reporter
from rlmetrics.trainer.train import log_step, setup, train_step

SYNC_TIME = "timing_s/metrics"  # each rank's (or the driver's) own time: never compared


class RayRank:
    """One data-parallel rank inside a Ray actor: its gloo rank, models and Tracker."""

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int) -> None:
        torch.set_num_threads(threads_per_rank(world_size))
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.tracker = Tracker()
        self.r: Rank | None = None

    def address(self) -> tuple[str, int]:
        """This actor's node IP and a port free on it (rank 0's hosts the rendezvous)."""
        return ray.util.get_node_ip_address(), free_port()

    def join(self, host: str, port: int) -> None:
        """Join the gloo group (blocks until every rank has joined), then build the models."""
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=self.cfg.run.timeout),
        )
        self.r = setup(self.cfg, self.rank, self.world_size, None, "cpu")

    def step(self, step: int, metrics_path: str) -> tuple[dict[str, float] | None, TrackerState]:
        """Train step ``step``; returns (the synced metrics, an empty state) on the
        collective path, (None, this rank's state) on the driver path."""
        if self.r is None:
            raise RuntimeError(f"rank {self.rank}: step() before join()")
        if metrics_path == "collective":
            return with_metrics(train_step(self.r, step, self.tracker), self.tracker)
        log_step(self.r, step, self.tracker)
        return with_metrics(None, self.tracker)

    def close(self) -> None:
        """Leave the group together (a rank tearing gloo down early can abort a peer)."""
        dist.barrier()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def launch(
    cfg: TrainConfig, *, metrics_path: str = "collective", address: str | None = None
) -> list[dict[str, float]]:
    """Train on ``cfg.run.dp`` Ray actors; returns every step's metrics, as logged.

    Args:
        cfg: the run's config.
        metrics_path: "collective" (compute() in the actors) or "driver" (states merged
            on the driver).
        address: a Ray cluster to join; None uses ``RAY_ADDRESS`` when set, else starts
            a local Ray with max(dp, CPUs) CPUs (shut down at the end). An already
            initialised Ray is used as it is.

    Raises:
        TimeoutError: the actors did not start within ``cfg.run.timeout`` seconds.
        Exception: the first actor error, with a note naming the actor.
    """
    check(metrics_path in METRICS_PATHS, "metrics_path", metrics_path, f"one of {METRICS_PATHS}")
    # checkpoints are train()'s (trainer/checkpoint.py); this loop does not write or read them
    if any(getattr(cfg.run, name, None) for name in ("checkpoint_every", "resume", "resume_from")):
        raise ValueError("the Ray launcher does not checkpoint or resume yet; use spawn")
    started = not ray.is_initialized()
    local = (address or os.environ.get("RAY_ADDRESS")) is None
    init_ray(address, num_cpus=max(cfg.run.dp, os.cpu_count() or 1) if local else None)
    actors: list[Any] = []
    try:
        actors = start_actors(cfg)
        history = drive(cfg, actors, metrics_path)
        ray.get([actor.close.remote() for actor in actors], timeout=cfg.run.timeout)
        return history
    finally:
        for actor in actors:
            ray.kill(actor)
        if started:
            ray.shutdown()


def start_actors(cfg: TrainConfig) -> list[Any]:
    """D actors (1 CPU each) in one gloo group, in rank order."""
    world, timeout = cfg.run.dp, cfg.run.timeout
    remote = ray.remote(num_cpus=1)(RayRank)
    # handles: ray's ActorHandle types the actor's methods as plain callables, not remote ones
    actors: list[Any] = [remote.remote(cfg, rank, world) for rank in range(world)]
    try:
        addresses = ray.get([actor.address.remote() for actor in actors], timeout=timeout)
    except ray.exceptions.GetTimeoutError as err:
        raise TimeoutError(
            f"the Ray launcher: {world} actors (1 CPU each) did not start within {timeout:g} s; "
            f"does the cluster have {world} free CPUs?"
        ) from err
    same_node = len({ip for ip, _ in addresses}) == 1
    host = "127.0.0.1" if same_node else addresses[0][0]
    ray.get([actor.join.remote(host, addresses[0][1]) for actor in actors], timeout=timeout)
    return actors


def drive(cfg: TrainConfig, actors: list[Any], metrics_path: str) -> list[dict[str, float]]:
    """The driver's loop: every step on every actor, one dict logged per step."""
    history: list[dict[str, float]] = []
    with Reporter(cfg) as reporter:
        for step in range(1, cfg.run.steps + 1):
            results, state = call_and_merge(actors, "step", step, metrics_path)
            if metrics_path == "collective":
                metrics = agreed(results)
            else:
                start = time.perf_counter()
                metrics = extras.finish(compute_states(state))
                metrics[SYNC_TIME] = time.perf_counter() - start  # the driver's compute
            history.append(metrics)
            reporter.log(step, metrics)
    return history


def agreed(results: list[dict[str, float]]) -> dict[str, float]:
    """Rank 0's metrics, after checking that every rank's collective gave the same dict."""
    first = results[0]
    for rank, other in enumerate(results[1:], start=1):
        differ = sorted(
            key
            for key in first.keys() | other.keys()
            if key != SYNC_TIME and not _same(first.get(key), other.get(key))
        )
        if differ:
            raise RuntimeError(f"rank {rank}'s metrics differ from rank 0's: {differ[:5]}")
    return first


def _same(a: float | None, b: float | None) -> bool:
    return a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))
