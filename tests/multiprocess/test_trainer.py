"""The reference trainer: a CLI smoke run, and partition invariance of its metrics.

The integration test trains the same float64 run under four partitions (one rank with
the whole batch in one micro-batch; two ranks by micro-batch size; two ranks by token
budget; four ranks with uneven shards) in one launch of four gloo processes, and checks
every metric but timings and throughput: step 1 within 1e-9, later steps within 1e-6.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import torch
import torch.distributed as dist

from rlmetrics.cli import build_parser, config_from_args, main
from rlmetrics.trainer import AlgoConfig, ModelConfig, RunConfig, TaskConfig, TrainConfig, train
from rlmetrics.trainer.rollout import shard_indices

from gloo_ranks import ok_results, run_ranks

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--num-prompts", "4",
        "--samples-per-prompt", "3", "--mini-batches", "2", "--epochs", "2"]  # fmt: skip
# measurements, and the naive values `rlmetrics demo` shows (they change with the split)
SKIP = ("timing_s/", "timing_per_token_ms/", "perf/", "actor/perf/", "critic/perf/", "naive/")


def base_config(**algo: object) -> TrainConfig:
    """A tiny float64 run: 5 prompts x 3 samples, 2 mini-batches, 2 epochs, 3 steps."""
    return TrainConfig(
        task=TaskConfig(num_symbols=3, max_prompt_len=3),
        model=ModelConfig(n_layer=1, n_head=2, n_embd=16, dtype="float64"),
        algo=AlgoConfig(
            num_prompts=5, samples_per_prompt=3, mini_batches=2, epochs=2, warmup_steps=1, **algo
        ),
        run=RunConfig(steps=3, progress=False, loggers="", log_every=0),
    )


# names added for verl parity (issue 17) that must not depend on the partition either
INVARIANT_VERL_NAMES = {
    "grpo": ("actor/loss", "actor/entropy", "actor/entropy_token_mean", "critic/returns/mean",
             "critic/returns/max", "critic/returns/min", "response/aborted_ratio",
             "response_length_non_aborted/mean", "response_length_non_aborted/clip_ratio",
             "training/global_step", "training/epoch"),
}  # fmt: skip
INVARIANT_VERL_NAMES["ppo"] = (*INVARIANT_VERL_NAMES["grpo"], "critic/loss")
# per data source (issue 19): logged with by=, compared below like every other metric
PER_SOURCE = {f"{name}/{source}" for name in ("critic/score/mean", "response_length/mean",
              "critic/advantages/mean") for source in ("short", "long")}  # fmt: skip


def assert_per_source(history: list[dict]) -> None:
    """Every per-source name is reported on some step, and each step's overall mean
    score lies between its sources' (it is their count-weighted mean)."""
    missing = PER_SOURCE - set().union(*history)
    assert not missing, sorted(missing)
    for row in history:
        scores = [v for k, v in row.items() if k.startswith("critic/score/mean/")]
        assert scores and min(scores) - 1e-12 <= row["critic/score/mean"] <= max(scores) + 1e-12


PARTITIONS = {  # name: (world size, algo overrides)
    "dp1-whole": (1, {}),
    "dp2-mbs3": (2, {"micro_batch_size": 3}),
    "dp2-tokens": (2, {"max_tokens_per_micro_batch": 16}),
    "dp4-uneven": (4, {"micro_batch_size": 1}),
}


def with_algo(cfg: TrainConfig, overrides: dict) -> TrainConfig:
    return replace(cfg, algo=replace(cfg.algo, **overrides))


def four_partitions(rank: int, world: int, algos: tuple[str, ...]) -> dict[tuple, list[dict]]:
    """On 4 ranks, per algo: dp1 on rank 0 while ranks 2-3 run dp2-tokens; dp2-mbs3 on
    ranks 0-1; dp4-uneven on all. Returns {(algo, partition): metrics per step}."""
    torch.set_num_threads(1)
    groups = {ranks: dist.new_group(list(ranks)) for ranks in ((0,), (0, 1), (2, 3))}
    groups[(0, 1, 2, 3)] = None  # the default group
    out: dict[tuple, list[dict]] = {}
    plan = (("dp1-whole", (0,)), ("dp2-tokens", (2, 3)), ("dp2-mbs3", (0, 1)),
            ("dp4-uneven", (0, 1, 2, 3)))  # fmt: skip
    for algo in algos:
        for name, ranks in plan:
            if rank in ranks:
                size, overrides = PARTITIONS[name]
                cfg = with_algo(base_config(algo=algo), overrides)
                history = train(cfg, ranks.index(rank), size, group=groups[ranks], report=False)
                out[algo, name] = [strip(m) for m in history]
    return out


def strip(metrics: dict) -> dict:
    """The metrics that must not depend on the partition (no timings, no throughput)."""
    return {k: v for k, v in metrics.items() if not k.startswith(SKIP)}


def assert_close(name: str, got: dict, want: dict, rtol: float, step: int) -> None:
    keys = set(want)
    assert keys == set(got), f"{name} step {step}: names differ: {keys ^ set(got)}"
    for key in sorted(keys):
        a, b = got[key], want[key]
        ok = (math.isnan(a) and math.isnan(b)) or abs(a - b) <= rtol * max(1.0, abs(b))
        assert ok, f"{name} step {step}: {key} = {a!r}, whole batch on one rank: {b!r}"


def test_metrics_do_not_depend_on_the_partition() -> None:
    algos = ("grpo", "ppo")
    results = ok_results(run_ranks(four_partitions, 4, algos, timeout=240))
    runs = {**results[2], **results[1], **results[0]}
    for rank_result in results:
        for key, history in rank_result.items():
            assert history == runs[key], f"{key}: ranks disagree"  # all ranks get one dict
    for algo in algos:
        reference = runs[algo, "dp1-whole"]
        assert "actor/pg_clipfrac" in reference[0] and "critic/score/mean" in reference[0]
        assert set(INVARIANT_VERL_NAMES[algo]) <= set(reference[0])  # compared below too
        assert_per_source(reference)  # compared below too
        for name in PARTITIONS:
            for step, (got, want) in enumerate(zip(runs[algo, name], reference, strict=True), 1):
                got, want = strip(got), strip(want)
                assert_close(f"{algo} {name}", got, want, 1e-9 if step == 1 else 1e-6, step)


def test_shards_are_uneven_and_cover_each_mini_batch() -> None:
    shards = [shard_indices(15, 2, rank, 4) for rank in range(4)]
    sizes = [[len(rows) for rows in shard] for shard in shards]
    assert sizes == [[2, 2], [2, 2], [2, 2], [2, 1]]
    for k, (lo, hi) in enumerate(((0, 8), (8, 15))):
        assert sorted(int(i) for s in shards for i in s[k]) == list(range(lo, hi))


def launch_args(tmp_path, name: str) -> list[str]:
    """Flags of a tiny float64 run writing ``tmp_path/name.jsonl``."""
    return [*TINY, "--steps", "2", "--dtype", "float64", "--seed", "3", "--log-every", "1",
            "--metrics-jsonl", str(tmp_path / f"{name}.jsonl"), "--run-dir", str(tmp_path),
            "--no-progress"]  # fmt: skip


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_launchers_agree_with_one_process(tmp_path, capsys) -> None:
    """rlmetrics demo (spawn, dp=2) and torchrun (dp=2) match one in-process rank."""
    args = launch_args(tmp_path, "spawn")
    assert main(["demo", "--dp", "2", "--micro-batch-size", "2", *args]) == 0
    assert "mean reward" in capsys.readouterr().out
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "-m", "rlmetrics.trainer", *launch_args(tmp_path, "torchrun"),
                "--max-tokens-per-micro-batch", "20"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(torchrun, check=True, env=env, timeout=120, capture_output=True)
    cfg = config_from_args(build_parser().parse_args(["demo", *launch_args(tmp_path, "one")]))
    want = [strip(m) for m in train(cfg, report=False)]
    for name in ("spawn", "torchrun"):
        rows = read_jsonl(tmp_path / f"{name}.jsonl")
        assert [row.pop("step") for row in rows] == [1, 2]
        assert "timing_s/gen" in rows[0] and "perf/throughput" in rows[0]
        for row in rows:  # rank-aware timings (docs/timing.md): 2 ranks, 0 or 1 the slowest
            assert row["timing_s/gen/slowest_rank"] in (0, 1), name
            assert row["timing_s/step/min"] <= row["timing_s/step/mean"] <= row["timing_s/step"]
            assert row["perf/throughput/total"] == 2 * row["perf/throughput"]
        for step, (got, ref) in enumerate(zip(rows, want, strict=True), start=1):
            assert_close(name, strip(got), ref, 1e-9 if step == 1 else 1e-6, step)


VERL_NAMES = (  # issue 17, point 7: what verl logs, in the JSONL of both algorithms
    "actor/loss", "actor/entropy", "actor/pg_clipfrac_lower", "critic/returns/mean",
    "critic/returns/max", "critic/returns/min", "perf/mfu/actor", "perf/mfu/actor_infer",
    "perf/time_per_step", "perf/throughput", "perf/total_num_tokens", "training/global_step",
    "training/epoch", "timing_s/gen", "timing_s/reward", "timing_s/old_log_prob",
    "timing_s/ref", "timing_s/adv", "timing_s/update_actor", "timing_s/step",
    "timing_per_token_ms/gen", "timing_per_token_ms/reward", "timing_per_token_ms/ref",
    "timing_per_token_ms/adv", "timing_per_token_ms/update_actor",
    "response_length_non_aborted/mean", "response/aborted_ratio",
)  # fmt: skip
PPO_NAMES = ("critic/loss", "perf/mfu/critic", "timing_s/values", "timing_s/update_critic",
             "timing_per_token_ms/values", "timing_per_token_ms/update_critic")  # fmt: skip


def memory_names(learner: str) -> set[str]:
    """The memory metrics a learner on the CPU reports (see trainer/perf.py): the GPU's
    are reported only for a model on a GPU, whether or not the machine has one."""
    return {f"{learner}/perf/cpu_memory_used_gb"} if importlib.util.find_spec("psutil") else set()


def test_jsonl_has_verl_names(tmp_path) -> None:
    for algo in ("grpo", "ppo"):
        path = tmp_path / f"{algo}.jsonl"
        cfg = base_config(algo=algo)
        run = {"steps": 2, "loggers": "jsonl", "metrics_jsonl": str(path),
               "run_dir": str(tmp_path / algo), "checkpoint_every": 1}  # fmt: skip
        cfg = replace(cfg, run=replace(cfg.run, **run))
        train(cfg, report=True)
        rows = read_jsonl(path)
        want = {*VERL_NAMES, *memory_names("actor")}
        if algo == "ppo":
            want |= {*PPO_NAMES, *memory_names("critic")}
        for row in rows:
            assert want <= set(row), (algo, sorted(want - set(row)))
        assert [row["training/global_step"] for row in rows] == [1.0, 2.0]
        assert_per_source(rows)
        assert rows[0]["perf/time_per_step"] == rows[0]["timing_s/step"]
        assert "timing_s/save_checkpoint" in rows[1]  # step 1's save, reported with step 2
        assert 0 < rows[0]["perf/mfu/actor"] < 1 and cfg.algo.clip_ratio_c == 3.0  # verl's c
