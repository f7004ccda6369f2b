"""Pool rows as caches and copies: what chunked prefill and the prefix cache need from the decoding
engine's state pool (an ``EFLACache`` made by ``EFLACache.for_model``).

A pool layer holds either a linear-attention state (``recurrent_state [rows, HV, K, V]`` and the
short-convolution histories ``conv_state``, each ``[rows, D, W]``) or, in a hybrid model, a
softmax-attention key/value buffer (``kv_pool`` and the rows' ``lengths``).
"""

from __future__ import annotations

import torch

from efla.models.cache import EFLACache

__all__ = ["has_attention_layers", "rows_cache", "RowSnapshot", "snapshot_row", "restore_row", "copy_row"]


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


class RowSnapshot:
    """A copy of one pool row of every (linear-attention) layer: recurrent state and convolution
    histories."""

    def __init__(self, layers: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]):
        self.layers = layers
        self.nbytes = sum(t.numel() * t.element_size() for state, conv in layers for t in (state, *conv))


def snapshot_row(pool: EFLACache, slot: int) -> RowSnapshot:
    """Every layer's state of pool row ``slot``, copied (linear-attention pools only)."""
    return RowSnapshot(
        [
            (state["recurrent_state"][slot].clone(), tuple(c[slot].clone() for c in state["conv_state"] or ()))
            for state in pool.states
        ]
    )


def restore_row(pool: EFLACache, slot: int, snapshot: RowSnapshot) -> None:
    """Pool row ``slot`` becomes the snapshot's state."""
    for state, (recurrent, conv) in zip(pool.states, snapshot.layers):
        state["recurrent_state"][slot].copy_(recurrent)
        for dst, src in zip(state["conv_state"] or (), conv):
            dst[slot].copy_(src)


def copy_row(pool: EFLACache, source: int, target: int) -> None:
    """Pool row ``target`` becomes a copy of row ``source`` (linear-attention pools only): a forked
    sequence continues from the same state."""
    for state in pool.states:
        state["recurrent_state"][target].copy_(state["recurrent_state"][source])
        for conv in state["conv_state"] or ():
            conv[target].copy_(conv[source])
