"""Running efla across processes: context parallelism (one sequence split over ranks)."""

from .context_parallel import (
    ContextParallel,
    ShardLayout,
    context_parallel,
    context_parallel_aware,
    context_parallel_conv_states,
    context_parallel_scope,
    conv_histories,
    current_context,
    shard,
    shard_layout,
)
from .training import ContextParallelTraining, context_parallel_lm_loss, next_token_targets, setup_context_parallel

__all__ = [
    "ContextParallel",
    "ContextParallelTraining",
    "ShardLayout",
    "context_parallel",
    "context_parallel_aware",
    "context_parallel_lm_loss",
    "context_parallel_conv_states",
    "context_parallel_scope",
    "conv_histories",
    "current_context",
    "next_token_targets",
    "setup_context_parallel",
    "shard",
    "shard_layout",
]
