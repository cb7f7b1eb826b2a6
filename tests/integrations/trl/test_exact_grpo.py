"""ExactGRPOTrainer against real TRL 1.16: its logged metrics do not depend on the split.

Each configuration trains a tiny local Qwen2 for 2 steps of 8 completions (beta > 0, so
``kl`` is logged; num_iterations=2, so step 2 reuses step 1's generations and clips).
The same global batch is split 8x1, 4x2, 2x4 (per-device batch x accumulation) in one
process and 4x1, 2x2, 1x4 in two (one torchrun launch, gloo). ExactGRPOTrainer must log
the same value for every split (to 1e-6) and the value numpy computes over the whole
step from the same per-token values; plain GRPOTrainer must show the drift.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("trl", reason="needs the .venv-trl environment (make test-trl)")

sys.path.insert(0, str(Path(__file__).parent))
import grpo_runs
import reference
from grpo_runs import ONE_PROCESS, OPTIONS, TWO_PROCESSES, RunSpec
from reference import TOL, close, logged, spread


def _specs(splits: list[tuple[int, int]], trainer: str, options: dict) -> list[RunSpec]:
    return [RunSpec(trainer, per_device, acc, options) for per_device, acc in splits]


@pytest.fixture(scope="module")
def one_process(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every single-process run, by (trainer, split): one result per process (one)."""
    out = tmp_path_factory.mktemp("out")
    runs = {}
    for spec in _specs(ONE_PROCESS, "exact", OPTIONS) + _specs(ONE_PROCESS, "plain", OPTIONS):
        runs[spec.key] = [grpo_runs.run(spec, model_dir, str(out))]
    return runs


@pytest.mark.parametrize("group", ["one_process", "two_processes"])
def test_exact_metrics_equal_across_splits(group: str, request: pytest.FixtureRequest) -> None:
    runs = request.getfixturevalue(group)
    splits = ONE_PROCESS if group == "one_process" else TWO_PROCESSES
    gaps = spread(runs, "exact", splits)
    keys = {key for _, key in gaps}
    assert {"kl", "entropy", "loss", "clip_ratio/high_max", "reward_std"} <= keys
    assert any(v > 0 for (step, key), v in spread(runs, "plain", splits).items())
    drifting = {k: v for k, v in gaps.items() if not v <= TOL}
    assert not drifting, f"ExactGRPOTrainer's metrics changed with the split: {drifting}"


@pytest.mark.parametrize("group", ["one_process", "two_processes"])
def test_exact_metrics_equal_whole_batch_numpy(group: str, request: pytest.FixtureRequest) -> None:
    runs = request.getfixturevalue(group)
    splits = ONE_PROCESS if group == "one_process" else TWO_PROCESSES
    for per_device, acc in splits:
        result = runs["exact", f"{per_device}x{acc}"]
        captures = [rank["captures"] for rank in result]
        for entry in result[0]["logs"]:
            want = reference.expected(captures, entry["step"], result[0]["spec"])
            wrong = {k: (entry.get(k), v) for k, v in want.items() if not close(entry.get(k), v)}
            assert not wrong, f"{per_device}x{acc} step {entry['step']}: (logged, numpy) {wrong}"


@pytest.mark.parametrize("group", ["one_process", "two_processes"])
def test_plain_grpo_trainer_drifts(group: str, request: pytest.FixtureRequest) -> None:
    """The same runs with trl.GRPOTrainer: entropy and the clip ratios change with the
    split and differ from the whole-batch value (this is what ExactGRPOTrainer fixes)."""
    runs = request.getfixturevalue(group)
    splits = ONE_PROCESS if group == "one_process" else TWO_PROCESSES
    gaps = spread(runs, "plain", splits)
    assert gaps[1, "entropy"] > 1e-5
    assert gaps[2, "clip_ratio/high_max"] > 0.05
    p, a = splits[-1]
    result = runs["plain", f"{p}x{a}"]
    want = reference.expected([rank["captures"] for rank in result], 1, result[0]["spec"])
    assert abs(logged(result)[0]["entropy"] - want["entropy"]) > 1e-5


@pytest.mark.parametrize("group", ["one_process", "two_processes"])
def test_training_is_unchanged(group: str, request: pytest.FixtureRequest) -> None:
    """ExactGRPOTrainer computes the same loss, so it trains exactly as GRPOTrainer:
    same gradient norms, same rewards, same (split-invariant under dapo) loss."""
    runs = request.getfixturevalue(group)
    splits = ONE_PROCESS if group == "one_process" else TWO_PROCESSES
    for per_device, acc in splits:
        exact, plain = (logged(runs[t, f"{per_device}x{acc}"]) for t in ("exact", "plain"))
        for mine, theirs in zip(exact, plain, strict=True):
            for key in ("grad_norm", "loss", "reward", "completions/mean_length"):
                if key in theirs:
                    assert close(mine[key], theirs[key]), (per_device, acc, key)


def test_two_step_logging_window(model_dir: Path, tmp_path: Path) -> None:
    """logging_steps=2: one log covers two optimizer steps, each with its own generation
    batch; still equal across splits and to numpy over the whole window."""
    logs = []
    for per_device, acc in [(8, 1), (2, 4)]:
        spec = RunSpec("exact", per_device, acc, {"beta": 0.04}, max_steps=2, logging_steps=2)
        result = grpo_runs.run(spec, model_dir, str(tmp_path))
        (entry,) = result["logs"]
        want = reference.expected([result["captures"]], entry["step"], result["spec"])
        wrong = {k: (entry.get(k), v) for k, v in want.items() if not close(entry.get(k), v)}
        assert not wrong, f"{spec.split}: (logged, numpy) {wrong}"
        logs.append(logged([result])[0])
    assert {k for k in logs[0] if not close(logs[0][k], logs[1][k])} == set()


@pytest.mark.parametrize(
    "options",
    [
        {"loss_type": "grpo", "importance_sampling_level": "sequence"},
        {"loss_type": "dr_grpo", "delta": 1.25},
    ],
    ids=["grpo-sequence", "dr_grpo-delta"],
)
def test_other_loss_types_train_as_trl_and_log_exactly(
    options: dict, model_dir: Path, tmp_path: Path
) -> None:
    """grpo with sequence-level ratios, dr_grpo with two-sided clipping: ExactGRPOTrainer
    trains as GRPOTrainer (same gradient norms and losses; TRL's loss is split-invariant
    for these) and logs the numpy values (split 4x2, one process)."""
    options = {**OPTIONS, **options}
    exact, plain = (
        grpo_runs.run(RunSpec(trainer, 4, 2, options), model_dir, str(tmp_path))
        for trainer in ("exact", "plain")
    )
    for mine, theirs in zip(logged([exact]), logged([plain]), strict=True):
        for key in ("grad_norm", "loss", "reward"):
            if key in theirs:
                assert close(mine[key], theirs[key]), key
    for entry in exact["logs"]:
        want = reference.expected([exact["captures"]], entry["step"], exact["spec"])
        wrong = {k: (entry.get(k), v) for k, v in want.items() if not close(entry.get(k), v)}
        assert not wrong, f"step {entry['step']}: (logged, numpy) {wrong}"


def test_sync_counts_per_logged_step(two_processes: dict) -> None:
    """Two processes. GRPOTrainer's loss gathers and reads every metric each micro-batch
    (7 collectives, 9 host reads with beta > 0); ExactGRPOTrainer's loss does neither,
    and its log() syncs once (after the first, which also agrees on the schema)."""
    for p, a in TWO_PROCESSES:
        exact = two_processes["exact", f"{p}x{a}"][0]
        plain = two_processes["plain", f"{p}x{a}"][0]["counts"]
        micro_batches = 2 * a  # 2 steps
        assert plain["loss/collectives"] == 7 * micro_batches
        assert plain["loss/host_reads"] == 9 * micro_batches
        counts = exact["counts"]
        assert counts.get("loss/collectives", 0) == 0 and counts.get("loss/host_reads", 0) == 0
        first, second = exact["log_counts"][:2]
        assert first.get("log/collectives", 0) <= 3
        # a count that never rose is absent from the per-call dicts
        assert (second.get("log/collectives", 0), second.get("log/host_reads", 0)) == (1, 0)


def test_bnpo_loss_is_split_dependent_and_says_so(model_dir: Path, tmp_path: Path) -> None:
    """Under bnpo the loss (and so its gradient) depends on the split: it is logged as
    the mean of micro-batch token means it is, with a warning. At step 1 (same weights
    for both splits) every other metric is equal; later steps train differently."""
    options = {**OPTIONS, "loss_type": "bnpo"}
    results = []
    for spec in _specs([(8, 1), (2, 4)], "exact", options):
        with pytest.warns(UserWarning, match="loss_type='bnpo'"):
            results.append([grpo_runs.run(spec, model_dir, str(tmp_path), warn=True)])
    first, second = (logged(result)[0] for result in results)
    assert {k for k in first if not close(first[k], second[k])} == {"loss", "grad_norm"}
    for result in results:
        want = reference.expected([result[0]["captures"]], 1, result[0]["spec"])
        assert close(logged(result)[0]["loss"], want["loss"])


def test_untested_trl_version_is_refused() -> None:
    from rlmetrics.integrations.trl import check_trl_version

    check_trl_version("1.16.0")
    with pytest.raises(RuntimeError, match=r"with trl 1\.16\.0, but trl 1\.17\.0 is"):
        check_trl_version("1.17.0")


def test_vllm_is_refused_with_the_reason() -> None:
    """vLLM cannot run here (no GPU, no vLLM), so TRL itself refuses use_vllm=True before
    the trainer's own check; the check's answer, on the attribute it reads."""
    from rlmetrics.integrations.trl import _unsupported

    assert _unsupported(SimpleNamespace(use_vllm=False)) == {}
    (reason,) = _unsupported(SimpleNamespace(use_vllm=True)).values()
    assert "importance-sampling correction" in reason and "CPU" in reason


def test_import_without_trl_names_what_to_install() -> None:
    code = "import sys; sys.modules['trl'] = None; import rlmetrics.integrations.trl"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0
    assert "pip install 'rlmetrics[trl]'" in done.stderr


def test_numpy_reference_is_not_trivial() -> None:
    """The reference must tell a mean of micro-batch means from the whole-batch mean."""
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0]], float)
    values = np.array([[1.0, 1.0, 1.0, 0.0], [5.0, 0.0, 0.0, 0.0]])
    items = [
        {"completion_mask": mask[i : i + 1], "logp": np.zeros((1, 4)), "entropy": values[i : i + 1]}
        for i in range(2)
    ]
    for item in items:
        item["advantages"] = np.zeros(1)
    assert reference.policy_metrics(items, {})["entropy"] == pytest.approx(2.0)  # not 3.0
