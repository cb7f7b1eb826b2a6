"""verl 0.9.1's updates with the integration's extras (``RLMETRICS_VERL_DETAIL``), per rank.

Each rank builds verl's actor (``ActorRolloutRefWorker(role="actor")``) and critic
(``TrainingWorker``), computes its rows' log-probs, entropies and values with verl's own
forward passes (``compute_log_prob``, ``infer_batch``: the truth's inputs, lr 0 keeps
the weights), then runs every split with the switch off and on, counting this rank's
torch.distributed collectives per update and recording the keys its worker returns.
The batch's sources are placed so that rank 1 of 2 holds no row of ``"b"``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from scenarios import (
    BATCH,
    build_actor,
    build_critic,
    driver_reduce,
    init_rank,
    make_batch,
    rank_slice,
    update_input,
)

from gloo_ranks import count_collectives

SOURCES = ("a", "b", "a", "b", "a", "a", "a", "a")
"""Each sequence's data source: on 2 ranks, rank 0 holds a, b, a, b and rank 1 only a."""
DETAIL_SPLITS: dict[str, dict[str, Any]] = {
    "whole": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": BATCH},
    "micro1": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 1},
    "dynamic16": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 16},
    "2minibatches": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2, "mini_batches": 2},
}
SWITCH = "RLMETRICS_VERL_DETAIL"
PROMISED_FLOPS = 1e12
"""The CPU's promised FLOPS for verl's MFU (verl knows none for a CPU: its MFU reads 0)."""
SLOW_RANK = 1
SLOW_SECONDS = 1.0
"""Rank SLOW_RANK's engine train step takes this much longer (inside verl's timer)."""


def slow_down(engine: Any) -> None:
    """Make this rank's engine train step SLOW_SECONDS slower, after its last collective
    (so the other rank does not wait for it inside its own step)."""
    import time

    inner = engine.train_batch

    def slower(*args: Any, **kwargs: Any) -> Any:
        output = inner(*args, **kwargs)
        time.sleep(SLOW_SECONDS)
        return output

    engine.train_batch = slower


def expected_mfu(counter: Any, seconds: float, world_size: int) -> float:
    """verl's FLOPs estimate for every sequence of the batch (its global token counts)
    over ``seconds``, per device: what the step's exact MFU must be."""
    lengths = make_batch()["attention_mask"].sum(-1).tolist()
    achieved, promised = counter.estimate_flops(lengths, seconds)
    return achieved / promised / world_size


def with_sources(batch: Any, sources: tuple[str, ...] = SOURCES) -> Any:
    """``batch`` with verl's ``data_source`` column, as ``DataProto.to_tensordict`` makes it."""
    from tensordict.tensorclass import NonTensorData, NonTensorStack

    batch = batch.clone()
    batch["data_source"] = NonTensorStack.from_list([NonTensorData(s) for s in sources])
    return batch


LATE_UPDATES = (("a",) * 8, ("b",) * 8, ("a",) * 8, SOURCES)
"""The sources of each update of ``collect_first_updates``: the first holds no "b" on
any rank, the second no "a" (so an agreement there would leave "a" out), the third no
"b" again, the last both (rank 1 no "b")."""
SOURCES_VARIABLE = "RLMETRICS_VERL_SOURCES"
FIRST_UPDATE_RUNS = {
    "off": {},
    "on": {SWITCH: "1", SOURCES_VARIABLE: "a,b"},
    "on, sources not named": {SWITCH: "1"},
}
"""The environments ``collect_first_updates`` runs in, each on fresh ranks."""


def collect_first_updates(
    rank: int, world_size: int, port: int, model_path: str, run: str
) -> dict[str, list[int]]:
    """This rank's torch.distributed collectives in each of ``LATE_UPDATES``' actor and
    critic updates, in a fresh process (the first update is its group's first sync, as
    in a job), in the environment ``FIRST_UPDATE_RUNS[run]``. Also the keys each update
    logged that end in a source."""
    os.environ.update(FIRST_UPDATE_RUNS[run])
    init_rank(rank, world_size, port)
    import rlmetrics.integrations.verl as integration

    integration.enable()
    actor = build_actor(os.path.join(model_path, "actor"))
    critic = build_critic(os.path.join(model_path, "critic"))
    counts = count_collectives()
    out: dict[str, Any] = {"actor": [], "critic": [], "keys": []}
    for sources in LATE_UPDATES:
        batch = rank_slice(with_sources(make_batch(), sources), rank, world_size)
        for role, update in (("actor", actor.update_actor), ("critic", critic.train_mini_batch)):
            before = counts["n"]
            output = update(update_input(batch, DETAIL_SPLITS["whole"], world_size))
            out[role].append(counts["n"] - before)
            logged = driver_reduce(output, f"{role}/")
            out["keys"].append(sorted(k for k in logged if k.endswith(("/a", "/b"))))
    return out


def forward_pass(actor: Any, critic: Any, batch: Any) -> dict[str, list]:
    """This rank's rows' log-probs, entropies (actor) and values (critic), padded to the
    response width, from verl's own inference calls."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    rows = batch.batch_size[0]
    whole = {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": rows, "temperature": 1.0}
    data = left_right_2_no_padding(batch.clone())
    tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=False, **whole)
    output = actor.compute_log_prob(data)
    log_probs = no_padding_2_padding(tu.get(output, "log_probs"), data)
    entropy = no_padding_2_padding(tu.get(output, "entropy"), data)
    data = left_right_2_no_padding(batch.clone())
    tu.assign_non_tensor(data, compute_loss=False, **whole)
    values = no_padding_2_padding(tu.get(critic.infer_batch(data), "values"), data)
    width = batch["responses"].shape[1]

    def padded(x: torch.Tensor) -> list:
        return torch.nn.functional.pad(x.double(), (0, width - x.shape[1])).tolist()

    return {"log_probs": padded(log_probs), "entropy": padded(entropy), "values": padded(values)}


def run_updates(actor: Any, critic: Any, batch: Any, world_size: int) -> dict[str, Any]:
    """Per split, the driver's reduced metrics, this rank's keys and its collectives per
    update; one warm-up update of each first (the step that agrees the schema)."""
    out: dict[str, Any] = {"actor": {}, "critic": {}, "keys": {}, "collectives": {}}
    counts = count_collectives()
    for role, update in (("actor", actor.update_actor), ("critic", critic.train_mini_batch)):
        before = counts["n"]
        update(update_input(batch, DETAIL_SPLITS["whole"], world_size))
        out["warmup_collectives"] = out.get("warmup_collectives", {}) | {role: counts["n"] - before}
        for name, split in DETAIL_SPLITS.items():
            before = counts["n"]
            output = update(update_input(batch, split, world_size))
            out["collectives"][f"{role}/{name}"] = counts["n"] - before
            out[role][name] = logged = driver_reduce(output, f"{role}/")
            out["keys"][f"{role}/{name}"] = sorted(logged)
            seconds = logged.get(f"{role}/update_time_s")
            if seconds is not None:
                counter = (actor.actor if role == "actor" else critic).flops_counter
                mfu = expected_mfu(counter, seconds, world_size)
                out.setdefault("expected_mfu", {})[f"{role}/{name}"] = mfu
                fastest = expected_mfu(counter, logged[f"{role}/update_time_s/min"], world_size)
                out.setdefault("mean_of_rank_ratios", {})[f"{role}/{name}"] = (mfu + fastest) / 2
    return out


def collect_detail(rank: int, world_size: int, port: int, model_path: str) -> dict[str, Any]:
    """Everything the detail tests check, from one rank (under ``gloo_ranks.run_ranks``)."""
    init_rank(rank, world_size, port)
    import rlmetrics.integrations.verl as integration

    integration.enable()
    batch = rank_slice(with_sources(make_batch()), rank, world_size)
    from verl.utils import flops_counter

    flops_counter._DEVICE_FLOPS["CPU"] = PROMISED_FLOPS
    actor = build_actor(os.path.join(model_path, "actor"))
    critic = build_critic(os.path.join(model_path, "critic"))
    if rank == SLOW_RANK:
        slow_down(actor.actor.engine)
        slow_down(critic.engine)
    out: dict[str, Any] = {"forward": forward_pass(actor, critic, batch)}
    os.environ.pop(SWITCH, None)
    out["off"] = run_updates(actor, critic, batch, world_size)
    os.environ[SWITCH] = "1"
    out["on"] = run_updates(actor, critic, batch, world_size)
    os.environ.pop(SWITCH, None)
    out["off_again"] = run_updates(actor, critic, batch, world_size)
    return out


def whole_batch(ranks: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The batch as numpy arrays (as the ranks saw it), with the ranks' forward passes."""
    batch = make_batch()
    arrays = {k: batch[k].double().numpy() for k in ("old_log_probs", "ref_log_prob")}
    arrays |= {k: batch[k].double().numpy() for k in ("advantages", "values", "returns")}
    arrays["mask"] = batch["response_mask"].bool().numpy()
    for key in ("log_probs", "entropy", "values"):
        rows = [np.asarray(r["forward"][key]) for r in ranks]
        arrays["new_" + key] = np.concatenate(rows)
    arrays["sources"] = np.asarray(SOURCES)
    return arrays
