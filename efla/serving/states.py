"""Pool rows as caches and copies: what chunked prefill and the prefix cache need from the decoding
engine's state pool (an ``EFLACache`` made by ``EFLACache.for_model``).

A pool layer holds either a linear-attention state (``recurrent_state [rows, HV, K, V]`` and the
short-convolution histories ``conv_state``, each ``[rows, D, W]``) or, in a hybrid model, a
softmax-attention key/value buffer (``kv_pool`` and the rows' ``lengths``).
"""

from __future__ import annotations

import functools

import torch

from efla.models.cache import EFLACache

__all__ = ["has_attention_layers", "rows_cache", "snapshot_row", "restore_row", "copy_row"]


def has_attention_layers(pool: EFLACache) -> bool:
    return any(state is not None and "kv_pool" in state for state in pool.states)


def rows_cache(pool: EFLACache, slots: torch.Tensor, lengths: list[int]) -> EFLACache:
    """A cache holding copies of the pool rows ``slots`` (tokens seen: ``lengths``), from which a
    forward continues those rows' sequences; ``pool.write_slots(slots, cache)`` stores the result.
    Attention layers get the keys written so far, at their positions."""
    cache = EFLACache(len(pool.states))
    for i, state in enumerate(pool.states):
        if state is None:
            continue
        if "kv_pool" in state:
            cache.states[i] = _attention_rows(state, slots, lengths)
            continue
        conv = state["conv_state"]
        cache.states[i] = {
            "recurrent_state": state["recurrent_state"].index_select(0, slots),
            "conv_state": tuple(c.index_select(0, slots) for c in conv) if conv is not None else None,
        }
    return cache


def _attention_rows(state: dict, slots: torch.Tensor, lengths: list[int]) -> dict:
    """The dynamic attention state of ``slots`` (keys/values up to the longest row, ``-1`` positions
    past each row's end, never read)."""
    keys, values = state["kv_pool"]
    span = max(lengths)
    positions = torch.arange(span, device=keys.device).expand(len(lengths), span)
    row_lengths = torch.tensor(lengths, device=keys.device)
    positions = positions.masked_fill(positions >= row_lengths[:, None], -1)
    return {
        "attn_state": (keys[:, :span].index_select(0, slots), values[:, :span].index_select(0, slots)),
        "key_positions": positions,
        "next_position": row_lengths,
    }


def _row_tensors(pool: EFLACache) -> list[torch.Tensor]:
    """Each (linear-attention) layer's pool tensors, in snapshot order: recurrent state, then
    convolution histories."""
    return [t for state in pool.states for t in (state["recurrent_state"], *(state["conv_state"] or ()))]


def snapshot_row(pool: EFLACache, slot: int) -> torch.Tensor:
    """Every layer's state of pool row ``slot``, copied into one new flat tensor (linear-attention
    pools only): a single allocation per snapshot, which keeps nothing of the pool alive, in the type
    that holds every layer's values exactly (convolution histories in a half-precision model are
    widened to the float32 of the recurrent states)."""
    rows = [t[slot].reshape(-1) for t in _row_tensors(pool)]
    dtype = functools.reduce(torch.promote_types, (row.dtype for row in rows))
    return torch.cat([row.to(dtype) for row in rows])


def restore_row(pool: EFLACache, slot: int, snapshot: torch.Tensor) -> None:
    """Pool row ``slot`` becomes the state ``snapshot_row`` copied."""
    offset = 0
    for tensor in _row_tensors(pool):
        row = tensor[slot]
        row.copy_(snapshot[offset : offset + row.numel()].view_as(row))
        offset += row.numel()


def copy_row(pool: EFLACache, source: int, target: int) -> None:
    """Pool row ``target`` becomes a copy of row ``source`` (linear-attention pools only): a forked
    sequence continues from the same state."""
    for state in pool.states:
        state["recurrent_state"][target].copy_(state["recurrent_state"][source])
        for conv in state["conv_state"] or ():
            conv[target].copy_(conv[source])
