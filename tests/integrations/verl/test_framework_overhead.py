"""benchmarks/framework_overhead.py's verl part, tiny: verl's ``update_actor`` without the
plugin (``VERL_USE_EXTERNAL_PLUGINS=none``) and with it, on 2 gloo ranks, in turn."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_verl_part_times_update_actor_with_and_without_the_plugin(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run checks that the first actor was built without the plugin, the second with
    ExactTrainingWorker, and that both computed the same losses (``check_verl``)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import framework_overhead

    framework_overhead.main(["--only", "verl", "--warmup", "1", "--updates", "2", "--no-write"])
    out = capsys.readouterr().out
    assert "| verl | 2 | verl `update_actor` | 2 |" in out
    assert "| with the plugin | 2 |" in out
    assert "- verl, 2 processes: with the plugin / verl `update_actor` = " in out
