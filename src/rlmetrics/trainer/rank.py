"""What one rank of the reference trainer holds during a run (``setup`` builds it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from rlmetrics.trainer.config import TrainConfig
    from rlmetrics.trainer.model import TinyGPT
    from rlmetrics.trainer.task import Task
    from rlmetrics.trainer.update import Learner


@dataclass
class Rank:
    """What one rank holds during a run."""

    cfg: TrainConfig
    rank: int
    world_size: int
    group: Any
    device: torch.device
    task: Task
    actor: Learner
    ref: TinyGPT
    critic: Learner | None
