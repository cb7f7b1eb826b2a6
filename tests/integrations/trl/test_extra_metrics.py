"""ExactGRPOTrainer's ExtraMetrics against real TRL 1.16, on two processes (torchrun,
gloo; the runs of the shared launch in conftest.py): per value of a dataset column,
quantiles of per-token entropy, importance ratio and KL, tokens per second.

Each process holds one prompt's 4 completions per step and the step's two prompts come
from different sources, so each process holds no sample of one source. Every added key
must equal numpy over the whole step's completions of its source, both processes must
log the same keys and values, the switch must add no collective, and with it off the
logs must be exactly those of the run without it.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("trl", reason="needs the .venv-trl environment (make test-trl)")

sys.path.insert(0, str(Path(__file__).parent))
import grpo_runs
import reference
from grpo_runs import EXTRA, EXTRA_SPLITS, OPTIONS

TOL = 1e-6
NOT_BATCH = {"step_time", "epoch", "step"}
SOURCES = ("long", "short")
TOKEN_QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
# the built-in quantile sketch's stated bound (docs/quantiles.md): relative error ALPHA
# for magnitudes in [MIN_POSITIVE, 1e9], absolute error below MIN_POSITIVE / 2 below it
ALPHA, MIN_POSITIVE = 0.01, 1e-9


def _row_source(prompt_ids: np.ndarray) -> str:
    return grpo_runs.source_of(grpo_runs.prompt_of(prompt_ids))


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=TOL, abs_tol=TOL) or (math.isnan(a) and math.isnan(b))


def _added(key: str) -> bool:
    """A key ExtraMetrics adds: one ending in a source's name, a token quantile, or
    tokens per second."""
    name, _, last = key.rpartition("/")
    quantile = name in ("entropy", "importance_ratio", "kl") and last in (*TOKEN_QUANTILES, "max")
    return last in SOURCES or quantile or key.startswith("tokens_per_second")


def _by_source(key: str) -> bool:
    return key.rsplit("/", 1)[-1] in SOURCES


@pytest.mark.parametrize("split", [f"{p}x{a}" for p, a in EXTRA_SPLITS])
def test_runs_import_the_tree_under_test(split: str, two_processes: dict) -> None:
    """torchrun's processes import this tree's rlmetrics, not another install."""
    for result in two_processes["exact+extra", split]:
        assert Path(result["rlmetrics_file"]).is_relative_to(grpo_runs.SRC)


@pytest.mark.parametrize("split", [f"{p}x{a}" for p, a in EXTRA_SPLITS])
def test_each_process_lacks_a_source(split: str, two_processes: dict) -> None:
    """The premise of the tests below: at step 1 each process generates for one source
    only, and the two processes' sources differ."""
    per_process = [
        {s for item in result["captures"] if "sources" in item for s in item["sources"]}
        for result in two_processes["exact+extra", split]
    ]
    assert per_process[0] | per_process[1] == set(SOURCES)
    assert all(len(sources) == 1 for sources in per_process)


def _check_by_source(result: list[dict]) -> list[int]:
    """Every process's logs: the per-source keys are those numpy finds, with numpy's
    values (and every other key numpy's). The number of per-source keys per step."""
    captures = [rank["captures"] for rank in result]
    counts = []
    for rank in result:
        for entry in rank["logs"]:
            want = reference.expected(captures, entry["step"], rank["spec"])
            want.update(
                reference.expected_by_source(captures, entry["step"], rank["spec"], _row_source)
            )
            added = {key for key in entry if _by_source(key)}
            assert added == {key for key in want if _by_source(key)}, entry["step"]
            wrong = {k: (entry.get(k), v) for k, v in want.items() if not _close(entry.get(k), v)}
            assert not wrong, f"step {entry['step']}: (logged, numpy) {wrong}"
            counts.append(len(added))
    return counts


def _check_token_quantiles(result: list[dict], names: set[str]) -> None:
    """p50, p90, p99 of every completion token of every process within the sketch's
    stated error of numpy's quantile (method "lower", the sketch's definition); max
    exact."""
    captures = [rank["captures"] for rank in result]
    for entry in result[0]["logs"]:
        values = reference.token_values(captures, entry["step"], result[0]["spec"])
        assert set(values) == names
        for name, tokens in values.items():
            assert _close(entry[f"{name}/max"], tokens.max()), name
            for stat, q in TOKEN_QUANTILES.items():
                true = np.quantile(tokens, q, method="lower")
                bound = ALPHA * abs(true) if abs(true) >= MIN_POSITIVE else MIN_POSITIVE / 2
                error = abs(entry[f"{name}/{stat}"] - true)
                assert error <= bound * (1 + 1e-9), (entry["step"], name, stat, error, bound)


def _check_tokens_per_second(result: list[dict]) -> None:
    """tokens_per_second/total = every process's trained tokens (numpy over the captured
    prompt and completion masks) / the slowest process's seconds in the window, which
    is step_time (the slowest process's mean per optimizer step) x steps in it;
    tokens_per_second is that per process."""
    spec = result[0]["spec"]
    for entry in result[0]["logs"]:
        window = range(entry["step"] - spec["logging_steps"] + 1, entry["step"] + 1)
        micro = [
            item
            for rank in result
            for item in rank["captures"]
            if "logp" in item and item["step"] in window
        ]
        tokens = sum(item["prompt_mask"].sum() + item["completion_mask"].sum() for item in micro)
        seconds = entry["step_time"] * spec["logging_steps"]
        total = tokens / seconds
        assert entry["tokens_per_second/total"] == pytest.approx(total, rel=1e-9)
        assert entry["tokens_per_second"] == pytest.approx(total / len(result), rel=1e-9)


@pytest.mark.parametrize("split", [f"{p}x{a}" for p, a in EXTRA_SPLITS])
def test_per_source_keys_equal_whole_batch_numpy(split: str, two_processes: dict) -> None:
    counts = _check_by_source(two_processes["exact+extra", split])
    # x 2 sources: entropy, kl, 5 clip ratios; at the generation step (step 1; step 2
    # reuses its completions) also 4 completion and 7 reward keys; per process
    assert counts == [2 * (7 + 11), 2 * 7] * 2


@pytest.mark.parametrize("split", [f"{p}x{a}" for p, a in EXTRA_SPLITS])
def test_token_quantiles_within_the_sketch_bound(split: str, two_processes: dict) -> None:
    _check_token_quantiles(
        two_processes["exact+extra", split], {"entropy", "importance_ratio", "kl"}
    )


@pytest.mark.parametrize("split", [f"{p}x{a}" for p, a in EXTRA_SPLITS])
def test_tokens_per_second_over_the_slowest_process(split: str, two_processes: dict) -> None:
    _check_tokens_per_second(two_processes["exact+extra", split])


def test_sequence_level_ratio_one_process(model_dir: Path, tmp_path: Path) -> None:
    """One process, grpo with one importance ratio per sequence and beta = 0 (no kl):
    importance_ratio's quantiles are over sequences, the rest as on two processes."""
    options = {**OPTIONS, "beta": 0.0, "loss_type": "grpo", "importance_sampling_level": "sequence"}
    spec = grpo_runs.RunSpec("exact", 4, 2, options, extra=EXTRA)
    result = [grpo_runs.run(spec, model_dir, str(tmp_path))]
    # both sources at both steps (so a label carried to the wrong row would show): 6
    # policy keys (no kl) per source, at step 1 also 4 completion and 7 reward keys
    assert _check_by_source(result) == [2 * (6 + 11), 2 * 6]
    _check_token_quantiles(result, {"entropy", "importance_ratio"})
    _check_tokens_per_second(result)
    assert not any(key.startswith("kl") for entry in result[0]["logs"] for key in entry)


@pytest.mark.parametrize("split", [f"{p}x{a}" for p, a in EXTRA_SPLITS])
def test_processes_log_the_same_keys_and_values(split: str, two_processes: dict) -> None:
    first, second = (
        [_batch(entry) for entry in r["logs"]] for r in two_processes["exact+extra", split]
    )
    assert first == second


def _batch(entry: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in entry.items() if k not in NOT_BATCH and not math.isnan(v)}


@pytest.mark.parametrize("split", [f"{p}x{a}" for p, a in EXTRA_SPLITS])
def test_switch_off_logs_exactly_todays_keys_and_values(split: str, two_processes: dict) -> None:
    """The same run without ExtraMetrics (today's trainer) logs exactly the keys and
    values the run with it logs, less the added keys: the switch changes nothing else."""
    on = [_batch(entry) for entry in two_processes["exact+extra", split][0]["logs"]]
    off = [_batch(entry) for entry in two_processes["exact", split][0]["logs"]]
    assert len(on) == len(off) == 2
    for with_switch, without in zip(on, off, strict=True):
        assert not any(_added(key) for key in without)
        assert {k: v for k, v in with_switch.items() if not _added(k)} == without


@pytest.mark.parametrize("split", [f"{p}x{a}" for p, a in EXTRA_SPLITS])
def test_switch_adds_no_collective(split: str, two_processes: dict) -> None:
    """After the first log(), one collective per log() with the switch as without it,
    and the same collectives and host reads in the loss, generation and elsewhere. In
    this launch the runs without the switch came first, so the names of the run with it
    are new to the process: its first log() agrees them (3 more collectives), which a
    job's first log() does anyway. The first log() of runs that start as a job does is
    compared in ``test_a_source_first_seen_at_step_3_costs_no_collective_from_the_first_step``."""
    for rank in range(2):
        on = two_processes["exact+extra", split][rank]
        off = two_processes["exact", split][rank]
        collectives = [
            [calls.get("log/collectives", 0) for calls in run["log_counts"]] for run in (on, off)
        ]
        assert collectives[0][1:] == collectives[1][1:] == [1, 1]  # step 2, train()'s last
        assert collectives[0][0] <= collectives[1][0] + 3
        for phase in ("loss", "generation", "forward", "other"):
            for what in ("collectives", "host_reads"):
                key = f"{phase}/{what}"
                assert on["counts"].get(key, 0) == off["counts"].get(key, 0), key
        reads = [
            [calls.get("log/host_reads", 0) for calls in run["log_counts"]] for run in (on, off)
        ]
        assert reads[0][1:] == reads[1][1:]


LATE = grpo_runs.LATE_STEPS


def test_a_source_first_seen_at_step_3_costs_no_collective_from_the_first_step(
    first_steps: dict,
) -> None:
    """Runs that each start as a job does (its own launch): the late order, whose first
    two steps hold no "long" completion on any process and whose step 3 brings one.
    Every log(), the first included, takes the same collectives (and host reads) with
    the switch as without it, and so do the other phases: every value of the dataset
    column is named at every step (without that, step 3 would agree the new names: 3
    more collectives). The logged values are numpy's over the whole batch."""
    on, off = first_steps["exact+extra+late", "2x2"], first_steps["exact+late", "2x2"]
    long_at = [[entry["step"] for entry in rank["logs"] if "entropy/long" in entry] for rank in on]
    assert long_at == [[3, 4], [3, 4]]
    for rank in range(2):
        for what in ("collectives", "host_reads"):
            per_log = [
                [calls.get(f"log/{what}", 0) for calls in run[rank]["log_counts"]]
                for run in (on, off)
            ]
            assert per_log[0] == per_log[1], (rank, what)
            assert len(per_log[0]) == LATE + 1  # every step, and train()'s last
            for phase in ("loss", "generation", "forward", "other"):
                key = f"{phase}/{what}"
                assert on[rank]["counts"].get(key, 0) == off[rank]["counts"].get(key, 0), key
    _check_by_source(on)


def test_column_labels_name_a_missing_column_and_a_clashing_value() -> None:
    from rlmetrics.integrations.trl import column_labels

    rows = [{"prompt": "a", "data_source": 3}, {"prompt": "b", "data_source": "max"}]
    assert column_labels(rows, "data_source") == ["3", "max"]
    with pytest.raises(KeyError, match="no column 'source'"):
        column_labels(rows, "source")
    with pytest.raises(ValueError, match=r"values \['max'\] of column 'data_source'"):
        column_labels(rows, "data_source", reserved=("p50", "p90", "p99", "max"))
