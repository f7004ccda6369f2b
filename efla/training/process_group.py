"""Training on several processes (torchrun): the process group, full states of DDP/FSDP models, and
per-GPU memory."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from efla import environment

__all__ = ["Dist", "init_dist", "unwrap", "full_model_state", "full_optim_state", "peak_memory_per_gpu", "main_ddp_cleanup"]


@dataclass
class Dist:
    """This process's place among the training processes (one process: rank 0 of 1, not enabled)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    enabled: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self):
        if self.enabled:
            torch.distributed.barrier()

    def broadcast(self, obj):
        if not self.enabled:
            return obj
        lst = [obj]
        torch.distributed.broadcast_object_list(lst, src=0)
        return lst[0]

    def all_gather(self, obj) -> list:
        if not self.enabled:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out


def init_dist(device_kind: str) -> Dist:
    """Joins the process group that torchrun describes (``WORLD_SIZE`` > 1); else a single process."""
    world = environment.get("WORLD_SIZE")
    if world <= 1:
        return Dist()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend="nccl" if device_kind == "cuda" else "gloo")
    return Dist(
        rank=torch.distributed.get_rank(),
        world=torch.distributed.get_world_size(),
        local_rank=environment.get("LOCAL_RANK"),
        enabled=True,
    )


def unwrap(model):
    return model.module if hasattr(model, "module") else model


def full_model_state(model, fsdp: bool) -> dict:
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: PLC0415 (lazy: torch.distributed's checkpoint code only for sharded runs)

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().to("cpu") for k, v in unwrap(model).state_dict().items()}


def full_optim_state(model, optimizer, fsdp: bool) -> dict:
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415 (lazy: torch.distributed's checkpoint code only for sharded runs)
            StateDictOptions,
            get_optimizer_state_dict,
        )

        return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return optimizer.state_dict()


def peak_memory_per_gpu(device: torch.device, dist) -> list[float] | None:
    """Each rank's peak allocated GPU memory (GiB) over the training steps; ``None`` off the GPU."""
    if device.type != "cuda":
        return None
    mine = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], device=device, dtype=torch.float64)
    if not dist.enabled:
        return [float(mine)]
    every = [torch.zeros_like(mine) for _ in range(dist.world)]
    torch.distributed.all_gather(every, mine)
    return [float(x) for x in every]


def main_ddp_cleanup(finished: bool = False) -> None:
    """Destroy the process group if this process created one (call at exit under torchrun).
    ``finished``: every rank completed its work, so wait for the others first: a rank that tears its
    connections down while a peer still uses them can abort that peer at exit (seen with gloo)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # A finished train()'s DDP wrapper lives on in a reference cycle that holds the process group and
        # its pending work; left to the collection at interpreter exit, gloo's teardown can abort the
        # process (SIGABRT). Free it while the interpreter is whole.
        gc.collect()
        if finished:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()
