"""verl 0.9.1 on the CPU, through verl's own registries (test support, not shipped).

verl 0.9.1 registers its FSDP engines for cuda and npu only and has no CPU platform.
``setup_cpu()`` adds both through verl's extension points (``PlatformRegistry``,
``set_platform``, ``EngineRegistry.register``), so verl's own worker, engine and loss
code runs here unchanged, but for the FSDP wrap of two cases (``CPUWrap``): FSDP1 and
forward-only models (the reference policy). Call it after ``import verl`` and before
anything imports ``verl.workers`` (the FSDP engine module reads the platform at import
time).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

CPU_MEMORY_STATS = (
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
)


class _CPUDeviceModule(SimpleNamespace):
    """``torch.cpu`` plus the cuda-style calls verl makes on its device module."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name in CPU_MEMORY_STATS:
            return lambda *args, **kwargs: 0
        if name == "get_device_name":
            return lambda *args, **kwargs: "CPU"
        if name == "mem_get_info":  # (free, total) bytes, as torch.cuda reports them
            return lambda *args, **kwargs: (1 << 30, 1 << 30)
        return lambda *args, **kwargs: None  # empty_cache, reset_peak_memory_stats, ...


def _cpu_platform_class() -> type:
    from verl.plugin.platform import PlatformBase, PlatformRegistry

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = _CPUDeviceModule()

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return True

        def current_device(self) -> str:  # verl moves tensors with .to(current_device())
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CPU_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    return PlatformCPU


def _load_value_model_eager(local_path: str, torch_dtype: Any, model_config: Any, **kwargs: Any):
    """verl's ``load_valuehead_model`` asks for flash_attention_2 unconditionally (no CPU
    kernel exists); this loads the same ``AutoModelForTokenClassification`` (verl has set
    ``num_labels=1`` on ``model_config``) with eager attention."""
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(
        local_path, torch_dtype=torch_dtype, config=model_config, attn_implementation="eager"
    )


@contextlib.contextmanager
def _cpu_fsdp_wrap(engine_config: Any) -> Iterator[None]:
    """What verl's ``_build_fsdp_module`` needs to wrap a model on the CPU.

    * A forward-only engine (the reference policy) is wrapped as a trained one is, with
      no offload. verl offloads it to pinned host memory (FSDP2:
      ``CPUOffloadPolicy(pin_memory=True)``; FSDP1: ``CPUOffload(offload_params=True)``),
      and pinning needs an accelerator ("Cannot access accelerator device when none is
      available"). On the CPU the weights already are in host memory, where the offload
      would put them. ``forward_only`` is one of the config's mutable fields; it is set
      back after the wrap.
    * FSDP1 (``strategy: fsdp``): verl passes ``sync_module_states=True``, and torch's
      check before that broadcast refuses modules with CPU tensors
      (``_check_module_states_for_sync_module_states``). The broadcast itself runs on
      gloo with CPU tensors, so the check is skipped during the wrap (torch 2.13.0, the
      pinned version; an absent check raises instead of passing silently).
    """
    import torch.distributed.fsdp._init_utils as fsdp_init

    check = "_check_module_states_for_sync_module_states"
    if not hasattr(fsdp_init, check):
        raise RuntimeError(f"torch {torch.__version__} has no FSDP {check}: update cpu_verl.py")
    forward_only = engine_config.forward_only
    original = getattr(fsdp_init, check)
    engine_config.forward_only = False
    setattr(fsdp_init, check, lambda module_states: None)
    try:
        yield
    finally:
        setattr(fsdp_init, check, original)
        engine_config.forward_only = forward_only


class CPUWrap:
    """Mixed into verl's FSDP engines for the CPU: ``_build_fsdp_module`` is verl's,
    run inside ``_cpu_fsdp_wrap``."""

    def _build_fsdp_module(self, module: Any) -> Any:
        with _cpu_fsdp_wrap(self.engine_config):  # type: ignore[attr-defined]
            return super()._build_fsdp_module(module)  # type: ignore[misc]


def setup_cpu() -> None:
    """Register and select a CPU platform, then register verl's FSDP engines for it.

    Deviations from verl's code path: value models load with eager attention (see
    ``_load_value_model_eager``); the FSDP wrap of FSDP1 and forward-only models
    (``_cpu_fsdp_wrap``).
    """
    import verl.utils.model
    from verl.plugin.platform import set_platform

    verl.utils.model.load_valuehead_model = _load_value_model_eager
    os.environ["VERL_PLATFORM"] = "cpu"
    set_platform(_cpu_platform_class()())
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import (
        FSDPEngineWithLMHead,
        FSDPEngineWithValueHead,
    )

    class CPUFSDPEngineWithLMHead(CPUWrap, FSDPEngineWithLMHead):
        pass

    class CPUFSDPEngineWithValueHead(CPUWrap, FSDPEngineWithValueHead):
        pass

    for model_type, engine in (
        ("language_model", CPUFSDPEngineWithLMHead),
        ("value_model", CPUFSDPEngineWithValueHead),
    ):
        EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device=["cpu"])(
            engine
        )


def cpu_resource_pool_manager_class() -> type:
    """verl's ``ResourcePoolManager`` whose pools hold CPUs (``use_gpu=False``) instead
    of the GPUs its ``create_resource_pool`` asks Ray for (``Total available GPUs 0 is
    less than total desired GPUs``); the trainers' pools are otherwise verl's."""
    from verl.single_controller.ray import RayResourcePool
    from verl.single_controller.ray.base import ResourcePoolManager

    class CPUResourcePoolManager(ResourcePoolManager):
        def create_resource_pool(self) -> None:
            for name, process_on_nodes in self.resource_pool_spec.items():
                self.resource_pool_dict[name] = RayResourcePool(
                    process_on_nodes=process_on_nodes,
                    use_gpu=False,
                    max_colocate_count=1,
                    name_prefix=name,
                )

    return CPUResourcePoolManager
