"""Performance metrics of the reference trainer: model FLOPs utilisation and memory.

Names and meanings follow verl: ``perf/mfu/{actor,critic,actor_infer}`` is the model
FLOPs a stage did per second over the device's peak FLOPs (mean over ranks of each
rank's own ratio), and ``{actor,critic}/perf/{max_memory_allocated_gb,
max_memory_reserved_gb,cpu_memory_used_gb}`` the memory read after that learner's
update (max over ranks, where verl reads rank 0 only). None of these are partition
invariant: they measure the run, not the batch.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rlmetrics.rl import MetricUpdate

GIB = float(2**30)
# dense bf16 peaks by device name (the first key found in the name, longest first); the
# CPU figure is verl's nominal one, so CPU runs report a comparable, if rough, number
PEAK_FLOPS = {
    "GB200": 2.5e15,
    "B200": 2.25e15,
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362.05e12,
    "H20": 148e12,
}
CPU_PEAK_FLOPS = 448e9


def peak_flops(device: torch.device) -> float:
    """The device's peak FLOP/s; inf for an unknown GPU (its MFU reads 0, as in verl)."""
    if device.type != "cuda":
        return CPU_PEAK_FLOPS
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_FLOPS[key]
    return float("inf")


def model_flops(model: nn.Module, seq_lens: Tensor, *, n_layer: int, n_embd: int) -> float:
    """FLOPs of a forward and backward pass over sequences of ``seq_lens`` tokens.

    6 per weight per token for the matrix multiplies (every Linear and the token
    embedding, as verl counts the embedding and the head), plus 6·L·d·T² per sequence
    of T tokens for the attention scores and their use. A forward pass is a third.
    """
    dense = sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, nn.Linear | nn.Embedding) and m is not getattr(model, "wpe", None)
    )
    lens = seq_lens.double()
    return float(6 * dense * lens.sum() + 6 * n_layer * n_embd * lens.square().sum())


def mfu_update(name: str, flops: float, seconds: float, device: torch.device) -> MetricUpdate:
    """``perf/mfu/<name>``: this rank's FLOPs / seconds / peak (mean over ranks)."""
    mfu = flops / max(seconds, 1e-12) / peak_flops(device)
    return MetricUpdate(f"perf/mfu/{name}", "mean", mfu)


def cpu_memory_used_gb() -> float | None:
    """The machine's used memory in GiB (psutil's ``virtual_memory().used``, verl's
    reading); None without psutil (the metric is then omitted)."""
    try:
        import psutil
    except ImportError:
        return None
    return psutil.virtual_memory().used / GIB


def memory_updates(prefix: str, device: torch.device) -> list[MetricUpdate]:
    """``<prefix>/perf/*`` memory figures, max over ranks.

    The CUDA allocator's peaks since the start of the run on a GPU; on the CPU torch
    keeps no allocator statistics, so only cpu_memory_used_gb is reported there.
    """
    out = []
    if device.type == "cuda":
        out += [
            MetricUpdate(
                f"{prefix}/perf/max_memory_allocated_gb",
                "max",
                torch.cuda.max_memory_allocated(device) / GIB,
            ),
            MetricUpdate(
                f"{prefix}/perf/max_memory_reserved_gb",
                "max",
                torch.cuda.max_memory_reserved(device) / GIB,
            ),
        ]
    used = cpu_memory_used_gb()
    if used is not None:
        out.append(MetricUpdate(f"{prefix}/perf/cpu_memory_used_gb", "max", used))
    return out
