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

__all__ = [
    "ContextParallel",
    "ShardLayout",
    "context_parallel",
    "context_parallel_aware",
    "context_parallel_conv_states",
    "context_parallel_scope",
    "conv_histories",
    "current_context",
    "shard",
    "shard_layout",
]
