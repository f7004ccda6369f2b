"""Language-model training with every sequence split over several ranks (context parallelism).

The world is cut into groups of ``size`` consecutive ranks; a group shares its sequences, each rank
running one contiguous part of every sequence. Data parallelism runs across the groups. Gradients
are averaged over the whole world as usual (DDP): each rank's loss is its share of the micro-batch's
mean loss, so the average over ranks, times the world size, is the data-parallel mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .context_parallel import ContextParallel, context_parallel_scope, shard, shard_layout

__all__ = ["ContextParallelTraining", "setup_context_parallel", "next_token_targets", "context_parallel_lm_loss"]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class ContextParallelTraining:
    """This rank's place: its group of ``size`` ranks sharing sequences, its ``rank`` in that group,
    and the group's index ``data_rank`` among the ``data_world`` data-parallel replicas."""

    size: int
    group: object
    rank: int
    data_rank: int
    data_world: int


def setup_context_parallel(size: int, *, fsdp: bool = False) -> ContextParallelTraining:
    """Create the context-parallel groups (every rank must call this, in the same order)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("context_parallel: needs several processes (torchrun --nproc_per_node N)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if size < 2 or world % size:
        raise ValueError(f"context_parallel: expected a divisor > 1 of the world size {world}, got {size}")
    if fsdp:
        raise ValueError("context_parallel: not supported with fsdp (use DDP)")
    groups = [dist.new_group(list(range(first, first + size))) for first in range(0, world, size)]
    return ContextParallelTraining(
        size=size, group=groups[rank // size], rank=rank % size, data_rank=rank // size, data_world=world // size
    )


def next_token_targets(labels: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Position ``t``'s target ``labels[t + 1]``; ``-100`` after each row's last token and, in packed
    input, at every document's last token (no prediction across a boundary)."""
    target = torch.full_like(labels, IGNORE_INDEX)
    target[:, :-1] = labels[:, 1:]
    if cu_seqlens is not None:
        ends = cu_seqlens[1:].to(labels.device).long() - 1
        target[0, ends[ends >= 0]] = IGNORE_INDEX
    return target


def _token_mixer_count(model) -> tuple[int, bool]:
    config = getattr(model, "module", model).config
    return config.num_hidden_layers, bool(getattr(config, "use_short_conv", False))


def _check_routed(context: ContextParallel, model) -> None:
    layers, short_conv = _token_mixer_count(model)
    expected = (layers, layers if short_conv else 0)
    if (context.op_calls, context.conv_calls) != expected:
        raise RuntimeError(
            f"context_parallel: the forward ran {context.op_calls} recurrence op(s) and {context.conv_calls} "
            f"convolution history exchange(s) through the split, expected {expected[0]} and {expected[1]}: the "
            "token mixers must call their op through efla.distributed.context_parallel_aware and take their "
            "convolution caches from efla.distributed.context_parallel_conv_states"
        )


def context_parallel_lm_loss(model, batch: dict, cp: ContextParallelTraining) -> torch.Tensor:
    """This rank's share of the micro-batch's mean next-token loss.

    ``batch`` is the whole micro-batch (``input_ids``, optional ``labels`` and ``cu_seqlens``), the
    same on every rank of the group; the model runs this rank's part of every sequence. Returns the
    model's own cross-entropy (fused on the GPU: no float32 copy of the logits) summed over the part's
    predictions divided by the micro-batch's predictions, so the group's losses add up to the
    micro-batch's mean loss.
    """
    ids = batch["input_ids"]
    cu_seqlens = batch.get("cu_seqlens")
    target = next_token_targets(batch.get("labels", ids), cu_seqlens)
    layout = shard_layout(ids.shape[1], cp.size, cp.rank, cu_seqlens)
    with context_parallel_scope(layout, cp.group) as context:
        loss = model(
            input_ids=shard(ids, layout),
            cu_seqlens=layout.local_cu_seqlens(ids.device),
            shift_labels=shard(target, layout),
            num_items_in_batch=(target != IGNORE_INDEX).sum().clamp_min(1),
            use_cache=False,
        ).loss
    _check_routed(context, model)
    return loss
