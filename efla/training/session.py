"""What the phases of one ``efla train`` process share (:class:`Session`) and the training loop's
running totals (:class:`Progress`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from efla.training.config import Sizes, TrainConfig
from efla.training.process_group import Dist

if TYPE_CHECKING:  # annotations only: these import transformers and the model at call time
    from transformers import PreTrainedTokenizerBase

    from efla.data.text import PackedData, SequenceOrder
    from efla.distributed import ContextParallelTraining
    from efla.models import EFLAConfig, EFLAForCausalLM

__all__ = ["Session", "Progress", "log_nothing"]


def log_nothing(message: str) -> None:
    pass


@dataclass
class Session:
    """What the phases of one training process share: the settings, the process group, and the
    tokenizer, data, model and optimizer built for the run."""

    cfg: TrainConfig
    dist: Dist
    device: torch.device
    r: Sizes
    ckpt: str | None  # the checkpoint resumed from
    cp: ContextParallelTraining | None = None
    log: Callable[[str], None] = log_nothing  # told of each long phase (rank 0)
    precision: str = "fp32"
    schedule: dict = field(default_factory=dict)
    saved: dict | None = None  # the checkpoint's trainer_state.json
    tok: PreTrainedTokenizerBase | None = None
    eos_id: int = 0
    train_data: PackedData | None = None
    val_data: PackedData | None = None
    order: SequenceOrder | None = None
    mconf: EFLAConfig | None = None
    model: EFLAForCausalLM | None = None
    wrapped: torch.nn.Module | None = None  # the model as DDP/FSDP wrap it (the model itself on one process)
    n_params: int = 0
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    start_step: int = 0
    started: float = field(default_factory=time.perf_counter)  # when the process began this run

    def autocast(self):
        if self.precision == "bf16" and not self.cfg.fsdp:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


@dataclass
class Progress:
    """The loop's running totals."""

    step: int
    last_good: str | None  # the newest checkpoint written or resumed from
    val_loss: float | None = None
    train_time: float = 0.0
    step_seconds: list = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    stopped_early: bool = False  # by --time-limit, before the last step
