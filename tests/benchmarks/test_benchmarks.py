"""The benchmarks' measuring tools: the torch-op counter and the target verdicts of
log_bench, sync_bench (sync_ops) and framework_overhead, and tiny log_bench, step_bench
and fold_bench runs end to end (framework_overhead's run in the TRL and verl suites)."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> Iterator[dict[str, ModuleType]]:
    """The benchmark modules, imported with benchmarks/ on sys.path for this module."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        patch.setenv("OMP_NUM_THREADS", "1")  # sync_bench sets it on import; undone after
        names = ("op_count", "log_bench", "sync_ops", "step_bench", "sync_bench", "fold_bench")
        names += ("framework_overhead",)
        yield {name: importlib.import_module(name) for name in names}


def test_op_counter_counts_each_dispatched_op(bench: dict[str, ModuleType]) -> None:
    op_count = bench["op_count"]
    x = torch.arange(4.0)
    counter = op_count.count_ops(lambda: (x * 2 + 1).sum(), repeat=3)
    assert counter.total == 9
    assert dict(counter.ops) == {"aten.mul.Tensor": 3, "aten.add.Tensor": 3, "aten.sum.default": 3}
    assert op_count.describe(counter, per=3).count("x1") == 3


def test_op_counter_sees_no_host_arithmetic(bench: dict[str, ModuleType]) -> None:
    op_count = bench["op_count"]
    array = np.arange(4.0)
    counter = op_count.count_ops(lambda: float((array * 2 + 1).sum()) + 0.5)
    assert counter.total == 0
    assert op_count.describe(counter) == "none"


def test_log_bench_verdict_per_target(bench: dict[str, ModuleType]) -> None:
    log_bench = bench["log_bench"]
    fast, slow = [600.0, 900.0, 1000.0], [900.0, 1200.0, 1300.0]  # medians 900, 1200 ns
    samples = {key: fast for key in log_bench.TARGETS}
    counts = {key: (0.0, "none") for key in log_bench.TARGETS}
    lines = log_bench.verdict(samples, counts)
    assert len(lines) == 4 and all(line.count(" met") == 2 for line in lines)
    first, last = log_bench.TARGETS[0], log_bench.TARGETS[-1]
    samples[first] = slow
    counts[last] = (14.0, "aten.sum.default x14")
    lines = log_bench.verdict(samples, counts)
    assert "1.20 µs per call, not met" in lines[0] and "0 torch ops per call, met" in lines[0]
    assert "0.90 µs per call, met" in lines[-1]
    assert "14 torch ops per call, not met" in lines[-1]


def test_sync_ops_verdict_needs_the_same_count(bench: dict[str, ModuleType]) -> None:
    sync_ops = bench["sync_ops"]
    same = {(p, c): (6, "") for p in sync_ops.PATHS for c in sync_ops.CALLS}
    assert sync_ops.verdict({2: same, 4: same}).endswith(": met.")
    grows = dict(same)
    grows["tensor path", sync_ops.CALLS[-1]] = (7, "")
    assert sync_ops.verdict({2: same, 4: grows}).endswith(": not met.")
    table = "\n".join(sync_ops.markdown({4: grows}))
    assert "| 4 | tensor path | 6 | 7 | no |" in table


def _sync_results(medians_us: dict[int, dict[str, float]]) -> dict:
    """sync_bench's per-iteration results for N=8 (three samples, median as given)."""

    def times(world: int) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {"floats": [29, 16], "bare gathers": [1]}
        names = ("rlmetrics", "bare", "local", "local then bare", "bare pair", "verl")
        for name in (*names, "torchmetrics"):
            us = medians_us[world].get(name, 100.0)
            for prefix in ("", "cpu:"):
                out[prefix + name] = [int(us * 1e3), int(us * 1e3), -1, int(us * 2e3)]
        out["torcheval"] = out["cpu:torcheval"] = [1000, 1000, 1000]
        return out

    return {world: {8: times(world)} for world in medians_us}


def test_sync_target_judges_2_ranks_against_bare_plus_local(bench: dict[str, ModuleType]) -> None:
    sync_bench = bench["sync_bench"]
    results = _sync_results(
        {
            2: {"rlmetrics": 1090.0, "bare": 700.0, "local": 300.0, "local then bare": 1200.0},
            4: {"rlmetrics": 1300.0, "bare": 1000.0, "local": 300.0},  # 1.30x of bare
        }
    )
    ratios = sync_bench.sync_ratios(results)
    assert ratios[2, 8] == pytest.approx((1.09, 1.10)) and ratios[4, 8] == pytest.approx(
        (1.3, 1.25)
    )
    table = "\n".join(sync_bench.sync_target_table(results))
    assert (
        "| 2 | 8 | 1,090 | 700 | 300 | rl / (bare + local) = 1.09x | ≤ 1.10x | met | 1.09x "
        "| 1,200 | 0.91x |"
    ) in table
    assert "| 4 | 8 | 1,300 | 1,000 | 300 | rl / bare = 1.30x | ≤ 1.25x | missed |" in table
    assert "missed at 4 ranks N=8" in sync_bench.verdict(results)[0]


def test_sync_ops_counts_one_compute(bench: dict[str, ModuleType]) -> None:
    """Without a process group: the counts exist and do not grow with the calls."""
    counts = bench["sync_ops"].measure()
    totals = {path: {counts[path, c][0] for c in bench["sync_ops"].CALLS} for path, _ in counts}
    assert all(len(t) == 1 for t in totals.values()), counts


def test_log_bench_runs_end_to_end(
    bench: dict[str, ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torchmetrics")
    bench["log_bench"].main(["--rounds", "1", "--calls", "10", "--no-write"])
    out = capsys.readouterr().out
    assert out.count("torch ops per call") == 4
    assert "| 1k tensor + bool mask |" in out


def test_step_bench_runs_end_to_end_with_agreeing_contenders(
    bench: dict[str, ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torchmetrics")
    args = ["--steps", "1", "--warmup", "0", "--floats", "10", "--scalars", "2"]
    bench["step_bench"].main([*args, "--tensors", "2", "--elements", "50", "--no-write"])
    out = capsys.readouterr().out
    assert all(f"| {name} |" in out for name in bench["step_bench"].CONTENDERS)


def test_step_bench_refuses_contenders_that_disagree(bench: dict[str, ModuleType]) -> None:
    """The check that keeps the contenders doing the same work can fail."""
    good = {"a": 1.0, "token/0": 2.0}
    results = {"torchmetrics": good, "rlmetrics": good, "verl-style": {"a": 1.0, "token/0": 2.5}}
    bench["step_bench"].check_agree(results)  # verl's token means may differ: the drift
    results["rlmetrics"] = {"a": 1.0, "token/0": 2.5}
    with pytest.raises(AssertionError, match="rlmetrics: token/0"):
        bench["step_bench"].check_agree(results)


def test_fold_bench_runs_end_to_end(
    bench: dict[str, ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    """Tiny sizes: every row printed, with its verdict (its checks against numpy passed)."""
    args = ["--rounds", "1", "--calls", "5", "20", "--elements", "10", "--big", "1000"]
    bench["fold_bench"].main([*args, "--evict", "1", "--no-write"])
    out = capsys.readouterr().out
    fold_bench = bench["fold_bench"]
    for calls in (5, 20):
        for case in fold_bench.CASES:
            for condition in fold_bench.CONDITIONS:
                row = f"| {calls} calls, {fold_bench.CASE_NAMES[case]}, {condition}, µs per call |"
                assert row in out
    assert all(f"| {kind}, ns per element |" in out for kind in fold_bench.KINDS)
    assert "| compute of 8 metrics, µs |" in out
    for path in fold_bench.OP_PATHS:  # compute()'s torch ops after 100 and 4,000 calls
        assert f"| {path} | " in out and out.split(f"| {path} | ")[1].split("\n")[0].endswith(
            "yes |"
        )


def test_framework_overhead_pairs_steps_and_alternates_runs(bench: dict[str, ModuleType]) -> None:
    """A pair of steps (one generating, one reusing) is one sample, halved; runs
    alternate the trainer that goes first."""
    overhead = bench["framework_overhead"]
    stamps = [0.0, 0.1, 0.4, 0.5, 0.8, 0.9]  # steps of 0.1 and 0.3 s in turn
    assert overhead.per_step(stamps) == pytest.approx([0.2, 0.2])
    assert overhead.trl_order(3) == ["plain", "exact", "exact", "plain", "plain", "exact"]


def test_framework_overhead_verdict_per_target(bench: dict[str, ModuleType]) -> None:
    overhead = bench["framework_overhead"]

    def run(trainer: str, ms: float) -> dict:
        return {"trainer": trainer, "wall": [ms / 1e3] * 3, "cpu": [ms / 2e3] * 3}

    results = {
        "trl": {"runs": {"2": [run("plain", 100.0), run("exact", 95.0)]}},
        "verl": {"times": {"verl": {"wall": [0.2, 0.1, 0.3], "cpu": [0.1]}}},
    }
    # paired rounds: ratios 1.05, 1.1, 1.2 (median 1.1); the median updates' ratio 1.05
    results["verl"]["times"]["rlmetrics"] = {"wall": [0.21, 0.11, 0.36], "cpu": [0.1]}
    results["verl"]["own"] = {"log calls": [0.001, 0.003, 0.002], "compute": [0.004]}
    rows = overhead.rows_of(results)
    table = "\n".join(overhead.table(rows))
    assert "| TRL | 2 | GRPOTrainer | 6 | 100.0 | 50.0 | ExactGRPOTrainer | 6 | 95.0 |" in table
    assert "| 0.950 | ≤ 1.00 | met |" in table
    assert "| 1.100 | ≤ 1.02 | missed |" in table
    lines = overhead.verdict(rows)
    assert "= 0.950 (median step), target ≤ 1.00 met" in lines[0]
    assert "per-run medians: GRPOTrainer 100 ms; ExactGRPOTrainer 95 ms" in lines[0]
    assert "= 1.100 (median of the per-round ratios), target ≤ 1.02 missed by 7.8%" in lines[1]
    assert "ratio of the median updates 1.050" in lines[1]
    assert "own work per update (medians, rank 0): log calls 2.0 ms, compute 4.0 ms" in lines[1]


def test_framework_overhead_refuses_an_unfair_verl_contest(bench: dict[str, ModuleType]) -> None:
    """The verl part's checks can fail: the plugin loaded by ``import verl``, or the two
    actors computing different losses."""
    check = bench["framework_overhead"].check_verl
    classes = {"verl": "TrainingWorker", "rlmetrics": "ExactTrainingWorker"}
    fair = {"plugin": False, "classes": classes, "losses": {"verl": [0.5], "rlmetrics": [0.5]}}
    check(fair)
    with pytest.raises(AssertionError, match="VERL_USE_EXTERNAL_PLUGINS"):
        check({**fair, "plugin": True})
    with pytest.raises(AssertionError):
        check({**fair, "losses": {"verl": [0.5], "rlmetrics": [0.6]}})
    with pytest.raises(AssertionError):
        check({**fair, "classes": {**classes, "rlmetrics": "TrainingWorker"}})
