"""What bends SkyRL 0.4.0 to this CPU-only machine (Python 3.11, torch 2.13.0+cpu, gloo).

Nothing here changes SkyRL's code or its numbers: every piece makes a CUDA-only or
Python-3.12-only call work on the CPU, so that SkyRL's real FSDP workers run on gloo
ranks. ``install_imports()`` runs before the first import of SkyRL's modules in a process (the
tests' conftest), ``install()`` first thing in every spawned rank.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
import typing
from typing import Any

import torch
import torch.distributed
import torch.distributed.device_mesh

_INSTALLED: list[Any] = []


def install_imports() -> None:
    """What importing SkyRL's trainer and worker modules needs (the test process)."""
    _alias_typed_dict()
    _flash_attn_stand_in()


def install() -> None:
    """Every shim below, once per process (a rank that runs SkyRL's workers)."""
    if _INSTALLED:
        return
    install_imports()
    _cuda_calls_on_cpu()
    _cuda_tensors_on_cpu()
    _device_mesh_on_cpu()
    _gloo_for_nccl()
    _INSTALLED.append(True)


def _alias_typed_dict() -> None:
    """SkyRL's pydantic models (``skyrl/tinker/types.py``) use ``typing.TypedDict``,
    which pydantic refuses before Python 3.12 ("Please use typing_extensions.TypedDict");
    skyrl 0.4.0 requires 3.12, and this machine's CPU torch wheel is for 3.11 only."""
    if sys.version_info < (3, 12):
        import typing_extensions

        typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]


def _flash_attn_stand_in() -> None:
    """``skyrl/backends/skyrl_train/workers/model_wrapper.py`` imports
    ``flash_attn.bert_padding`` at module level; flash-attn does not build without
    CUDA. The tests run with ``remove_microbatch_padding=False``, where SkyRL never
    calls these two functions, so the stand-in only has to be importable (and says so
    if it is ever called). ``flash_attn.ops`` stays missing: SkyRL imports its triton
    cross-entropy under ``try/except ImportError`` and falls back to torch."""
    if "flash_attn" in sys.modules:
        return
    package = types.ModuleType("flash_attn")
    package.__path__ = []  # a package: flash_attn.ops then fails with ImportError
    # a spec, for transformers' find_spec("flash_attn"); no distribution metadata, so
    # transformers still reports flash-attention as unavailable
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.__spec__ = importlib.machinery.ModuleSpec("flash_attn.bert_padding", None)

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("flash_attn stand-in: run with remove_microbatch_padding=False")

    padding.pad_input = unavailable  # type: ignore[attr-defined]
    padding.unpad_input = unavailable  # type: ignore[attr-defined]
    package.bert_padding = padding  # type: ignore[attr-defined]
    sys.modules["flash_attn"] = package
    sys.modules["flash_attn.bert_padding"] = padding


def _cuda_calls_on_cpu() -> None:
    """SkyRL calls ``torch.cuda`` directly (``current_device()`` to place every batch,
    ``set_device``, ``synchronize``), which raise on a CPU-only torch: the device
    becomes the CPU and the others do nothing."""
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.set_device = lambda device: None  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]


def _device_mesh_on_cpu() -> None:
    """SkyRL builds its meshes with ``init_device_mesh("cuda", ...)`` (worker.py,
    fsdp_utils.py); the same mesh on the CPU is gloo's."""
    original = torch.distributed.device_mesh.init_device_mesh
    if getattr(original, "on_cpu", False):
        return

    def init_device_mesh(device_type: str, *args: Any, **kwargs: Any) -> Any:
        return original("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    init_device_mesh.on_cpu = True  # type: ignore[attr-defined]
    torch.distributed.device_mesh.init_device_mesh = init_device_mesh


def _gloo_for_nccl() -> None:
    """A SkyRL worker started as a Ray actor makes its process group with
    ``backend="cpu:gloo,cuda:nccl"`` (``init_worker_process_group``); this torch has no
    NCCL, so the group is gloo's alone. (A rank the tests spawn themselves already has
    its gloo group, made by ``gloo_ranks``, and SkyRL keeps it.)"""
    original = torch.distributed.init_process_group
    if getattr(original, "on_cpu", False):
        return

    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(backend, str) and "nccl" in backend:
            backend = "gloo"
        return original(backend, *args, **kwargs)

    init_process_group.on_cpu = True  # type: ignore[attr-defined]
    torch.distributed.init_process_group = init_process_group


def _cuda_tensors_on_cpu() -> None:
    """SkyRL's FSDP loading (``fsdp_utils._sync_non_persistent_buffers``) broadcasts the
    rotary embedding's buffers through ``buf.cuda()`` and
    ``torch.empty(..., device="cuda")``: those tensors stay on (or are made on) the CPU.
    Two patched callables rather than a ``TorchFunctionMode``: a mode is thread-local,
    and a Ray actor runs its methods on threads of its own."""
    if getattr(torch.Tensor.cuda, "on_cpu", False):
        return
    empty = torch.empty

    def on_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    def empty_on_cpu(*args: Any, **kwargs: Any) -> torch.Tensor:
        device = kwargs.get("device")
        if device == "cuda" or getattr(device, "type", None) == "cuda":
            kwargs["device"] = "cpu"
        return empty(*args, **kwargs)

    on_cpu.on_cpu = True  # type: ignore[attr-defined]
    torch.Tensor.cuda = on_cpu  # type: ignore[method-assign]
    torch.empty = empty_on_cpu  # type: ignore[assignment]
