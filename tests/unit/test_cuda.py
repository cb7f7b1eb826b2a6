"""The CUDA paths: no host sync in any log call, results equal to the CPU's, NCCL sync.

Skipped where no GPU is visible (CI here). On a machine with one GPU these run the
device path for real: log calls under ``torch.cuda.set_sync_debug_mode("error")``, then
``compute()`` over a one-rank NCCL group on both of its reduce paths.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist

import rlmetrics._engine.sync as rd
from rlmetrics import Tracker
from rlmetrics.cli import main
from rlmetrics.trainer.launch import free_port, rank_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

X = [1.0, 2.0, 4.0, 8.0, -3.0, 0.5]
W = [1.0, 0.0, 2.0, 1.0, 0.5, 3.0]
M = [True, False, True, True, False, True]
PADDED = [1.0, float("nan"), float("-inf"), 2.0]
PADDED_W = [0.5, 0.0, 0.0, 1.0]
PADDED_M = [True, False, False, True]


def log_battery(t: Tracker, data: Callable[..., torch.Tensor]) -> None:
    """Every log method with tensor values, float weights and bool masks (and a few
    python numbers next to them), built by ``data(values, dtype)``."""
    x, w, m = data(X), data(W), data(M, torch.bool)
    view = t.prefixed("p/")
    t.mean("mean", 0.5)
    t.mean("mean", x, weight=w)
    view.mean("mean", x, weight=m)
    t.mean("scalar_weight", data(2.0), weight=2.0)
    t.sum("sum", data(X, torch.int64), mask=m)
    t.max("max", x, mask=m)
    t.min("min", data(X, torch.bfloat16))
    t.std("std", x, weight=w)
    t.std("std", 16.0)
    t.last("last", 1.0)
    t.last("last", data(0.5))
    t.dist("dist", x, mask=m)
    t.log("log", x, m, kind="sum")
    padded = data(PADDED)  # NaN and -inf where the weight is 0: they change nothing
    t.mean("masked_nan", padded, weight=data(PADDED_W))
    t.std("masked_nan_std", padded, weight=data(PADDED_M, torch.bool))
    t.sum("masked_nan_sum", padded, weight=data(PADDED_W))
    t.last("last_masked", data(PADDED[1:2]), weight=data(PADDED_M[1:2], torch.bool))


def cuda_data(values: object, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device="cuda")


def cpu_data(values: object, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def expected(policy: str) -> dict[str, float]:
    cpu = Tracker(nonfinite=policy)
    log_battery(cpu, cpu_data)
    return cpu.compute()


def assert_close(got: dict[str, float], want: dict[str, float]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


@pytest.mark.parametrize("policy", ["propagate", "skip", "error"])
def test_cuda_log_calls_never_sync_and_match_the_cpu(policy: str) -> None:
    t = Tracker(nonfinite=policy)
    tensors: dict[tuple, torch.Tensor] = {}

    def made_before(values: object, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return tensors[repr(values), dtype]

    for values, dtype in ((X, torch.float32), (W, torch.float32), (M, torch.bool),
                          (X, torch.int64), (X, torch.bfloat16), (2.0, torch.float32),
                          (0.5, torch.float32), (PADDED, torch.float32),
                          (PADDED_W, torch.float32), (PADDED_M, torch.bool),
                          (PADDED[1:2], torch.float32), (PADDED_M[1:2], torch.bool)):  # fmt: skip
        tensors[repr(values), dtype] = cuda_data(values, dtype)  # host-to-device: before
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        log_battery(t, made_before)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert t.device().type == "cuda"
    assert_close(t.compute(), expected(policy))


@pytest.fixture
def nccl_group() -> Iterator[None]:
    tdist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    torch.cuda.set_device(0)
    try:
        yield
    finally:
        tdist.destroy_process_group()


@pytest.mark.parametrize("gather_limit", [rd.GATHER_LIMIT, 0], ids=["gather", "all_reduce"])
def test_nccl_compute_equals_local(
    nccl_group: None, monkeypatch: pytest.MonkeyPatch, gather_limit: int
) -> None:
    monkeypatch.setattr(rd, "GATHER_LIMIT", gather_limit)
    t = Tracker()
    for _ in range(3):  # the first step agrees the schema, later ones reuse it
        log_battery(t, cuda_data)
        synced = t.compute()
    assert rd.comm_device(tdist.group.WORLD).type == "cuda"
    assert_close(synced, expected("propagate"))


def test_demo_trains_on_the_gpu_given_by_device(tmp_path: Path) -> None:
    """``--device cuda`` puts the models on the GPU (its memory metrics are reported);
    ``rank_device`` gives local rank r GPU r mod the GPU count."""
    jsonl = tmp_path / "m.jsonl"
    tiny = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--num-prompts", "2",
            "--samples-per-prompt", "2", "--dp", "1", "--steps", "2", "--loggers", "jsonl",
            "--run-dir", str(tmp_path), "--metrics-jsonl", str(jsonl)]  # fmt: skip
    assert main(["demo", *tiny, "--device", "cuda"]) == 0
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(rows) == 2 and all(row["actor/perf/max_memory_allocated_gb"] > 0 for row in rows)
    count = torch.cuda.device_count()
    assert rank_device("cuda", count + 1) == torch.device("cuda", (count + 1) % count)
    assert rank_device("cuda:0", 5) == torch.device("cuda", 0)
