"""verl on the CPU in the Ray workers verl starts (test support, not shipped).

The Ray test names this module in its workers' ``VERL_USE_EXTERNAL_MODULES``; verl
imports it inside ``import verl`` (before its plugins and before anything imports
``verl.workers``), so each worker process gets ``cpu_verl``'s platform through verl's
own hook. The worker's gloo group is made here too, from the rank environment verl's
``RayWorkerGroup`` gives each worker: verl 0.9.1 asks torch for
``"cpu:gloo,<device>:<backend>"``, which torch refuses when the device is the CPU
itself, and it skips that when a group exists (as the spawned ranks of
``scenarios.init_rank`` also make theirs first).
"""

from __future__ import annotations

import os

import torch.distributed as dist
from cpu_verl import setup_cpu

setup_cpu()
if "RANK" in os.environ and "MASTER_PORT" in os.environ and not dist.is_initialized():
    dist.init_process_group(
        "gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
    )
