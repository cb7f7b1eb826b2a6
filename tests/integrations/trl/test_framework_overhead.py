"""benchmarks/framework_overhead.py's TRL part, tiny: both trainers in TRL's own loop on
1 and 2 processes, every step timed, the table and its verdicts printed."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_trl_part_times_both_trainers_on_1_and_2_processes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import framework_overhead

    args = ["--only", "trl", "--rounds", "2", "--warmup", "0", "--steps", "2", "--no-write"]
    framework_overhead.main(args)
    out = capsys.readouterr().out
    assert "| TRL | 1 | GRPOTrainer | 4 |" in out  # 2 runs of 2 steps each
    assert "| TRL | 2 | GRPOTrainer | 4 |" in out
    assert out.count("ExactGRPOTrainer | 4 |") == 2
    assert "- TRL, 2 processes: ExactGRPOTrainer / GRPOTrainer = " in out
    assert "| verl |" not in out
