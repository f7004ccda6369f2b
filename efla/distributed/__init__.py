"""Running efla across processes: context parallelism (one sequence split over ranks).

Op level, in every process of the group (same full inputs everywhere, or only the own part)::

    import torch.distributed as dist
    from efla.ops import chunk_gated_efla
    from efla.distributed import context_parallel, shard, shard_layout

    layout = shard_layout(q.shape[1], dist.get_world_size(), dist.get_rank(), cu_seqlens)
    o, S = context_parallel(chunk_gated_efla, *(shard(x, layout) for x in (q, k, v, g, beta)),
                            layout=layout, initial_state=h0[layout.document_rows], output_final_state=True)

``o`` is this rank's part of the single-process output; ``S`` holds the state after each piece
of a document on this rank. Model level: inside ``context_parallel_scope(layout, group)`` the
token mixers run their op through :func:`context_parallel_aware` and take their short-convolution
caches from :func:`context_parallel_conv_states`; :func:`context_parallel_lm_loss` does this for a
causal LM (``efla train --context-parallel N``).
"""

from .context_parallel import (
    ContextParallel,
    ShardLayout,
    context_parallel,
    context_parallel_aware,
    context_parallel_conv_states,
    context_parallel_scope,
    conv_histories,
    current_context,
    recompute_in_scope,
    shard,
    shard_layout,
)
from .context_parallel_lm import ContextParallelTraining, context_parallel_lm_loss, next_token_targets, setup_context_parallel

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
    "recompute_in_scope",
    "setup_context_parallel",
    "shard",
    "shard_layout",
]
