"""The Ray launcher: `rlmetrics demo --launcher ray` logs what the spawn launcher logs.

One local Ray (2 CPUs, no dashboard) for the module. A tiny float64 run (dp=2, 2 steps,
the opt-in metrics on) goes through the CLI three times: spawn, Ray with the collective
metrics path, Ray with the driver merge. Every metric but timings and throughput agrees
with spawn within 1e-9 at step 1 (1e-6 later), and the two Ray paths agree bit for bit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import pytest

from rlmetrics.cli import main

from helpers import run_python
from local_ray import local_ray

try:
    import ray
except ImportError:  # the no-Ray test below still runs
    ray = None

needs_ray = pytest.mark.skipif(
    ray is None, reason="ray is not installed (pip install 'rlmetrics[ray]')"
)
SKIP = ("timing_s/", "timing_per_token_ms/", "perf/", "actor/perf/", "critic/perf/",
        "actor/update_time_s", "critic/update_time_s")  # fmt: skip
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--num-symbols", "3",
        "--max-prompt-len", "3", "--num-prompts", "4", "--samples-per-prompt", "3",
        "--mini-batches", "2", "--epochs", "2", "--micro-batch-size", "2", "--warmup-steps", "1",
        "--dtype", "float64", "--steps", "2", "--seed", "3", "--dp", "2", "--no-progress",
        "--log-every", "0", "--loggers", "jsonl", "--per-source", "--token-quantiles",
        "--update-timing"]  # fmt: skip
RUNS = {
    "spawn": [],
    "ray-collective": ["--launcher", "ray", "--metrics-path", "collective"],
    "ray-driver": ["--launcher", "ray", "--metrics-path", "driver"],
}


def strip(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics that must not depend on the launcher (no timings, no throughput)."""
    return {k: v for k, v in metrics.items() if not k.startswith(SKIP)}


def assert_close(name: str, got: dict, want: dict, rtol: float, step: int) -> None:
    assert set(got) == set(want), f"{name} step {step}: names differ: {set(got) ^ set(want)}"
    for key, b in want.items():
        a = got[key]
        ok = (math.isnan(a) and math.isnan(b)) or abs(a - b) <= rtol * max(1.0, abs(b))
        assert ok, f"{name} step {step}: {key} = {a!r}, spawn: {b!r}"


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    """One local Ray for the module (see tests/_support/local_ray.py)."""
    with local_ray(num_cpus=2):
        yield


@pytest.fixture(scope="module")
def histories(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    """{run name: the JSONL rows its driver (or rank 0) wrote}, each through the CLI."""
    out = {}
    for name, flags in RUNS.items():
        folder = tmp_path_factory.mktemp(name)
        path = folder / "metrics.jsonl"
        args = [*TINY, *flags, "--run-dir", str(folder), "--metrics-jsonl", str(path)]
        assert main(["demo", *args]) == 0
        out[name] = [json.loads(line) for line in path.read_text().splitlines()]
        assert [row.pop("step") for row in out[name]] == [1, 2]
    return out


@needs_ray
@pytest.mark.parametrize("run", ["ray-collective", "ray-driver"])
def test_ray_launcher_matches_spawn(histories: dict[str, list], run: str) -> None:
    spawned = histories["spawn"]
    assert "actor/pg_clipfrac" in spawned[0] and "critic/score/mean" in spawned[0]
    for step, (got, want) in enumerate(zip(histories[run], spawned, strict=True), start=1):
        assert "timing_s/metrics" in got and "perf/throughput" in got
        assert {"actor/pg_clipfrac/short", "actor/token_entropy/p50"} <= set(got)
        # update timing: the exact MFU is worked out after the sync (on the driver's merge
        # too) and its hidden sum is gone
        assert got["perf/mfu/actor"] > 0 and got["actor/update_time_s"] > 0
        assert not any(key.startswith("perf/_") for key in got)
        assert_close(run, strip(got), strip(want), 1e-9 if step == 1 else 1e-6, step)


@needs_ray
def test_metrics_paths_agree_bit_for_bit(histories: dict[str, list]) -> None:
    collective, driver = histories["ray-collective"], histories["ray-driver"]
    for got, want in zip(driver, collective, strict=True):
        assert json.dumps(strip(got), sort_keys=True) == json.dumps(strip(want), sort_keys=True)


@needs_ray
def test_collective_results_must_agree() -> None:
    from rlmetrics.trainer import TrainConfig
    from rlmetrics.trainer.ray_launch import agreed, launch

    same = [{"a": math.nan, "timing_s/metrics": 1.0}, {"a": math.nan, "timing_s/metrics": 2.0}]
    assert agreed(same) is same[0]
    with pytest.raises(RuntimeError, match=r"rank 1's metrics differ from rank 0's: \['a', 'b'\]"):
        agreed([{"a": 1.0}, {"a": 2.0, "b": 0.0}])
    with pytest.raises(ValueError, match="metrics_path must be one of"):
        launch(TrainConfig(), metrics_path="gather")


def test_trainer_works_without_ray() -> None:
    """Without Ray, the trainer imports and `--launcher ray` fails with a clear message."""
    code = (
        "import sys\n"
        "sys.modules['ray'] = None  # as if ray were not installed\n"
        "import rlmetrics.trainer\n"
        "from rlmetrics.cli import main\n"
        "main(['demo', '--launcher', 'ray', '--steps', '1'])\n"
    )
    out = run_python(code)
    assert out.returncode == 2, out.stderr
    assert "the Ray launcher needs Ray" in out.stderr
    assert "pip install 'rlmetrics[ray]'" in out.stderr
