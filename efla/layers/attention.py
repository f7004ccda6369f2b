"""``Attention``: causal softmax attention (SDPA) with rotary embeddings, for hybrid models.

Parameter names and shapes follow flash-linear-attention's ``Attention`` layer (``q_proj``,
``k_proj``, ``v_proj`` with an optional bias, ``o_proj``; no rotary parameters), so the attention
layers of its hybrid checkpoints load one-to-one. Rotary embeddings rotate the two halves of each
head (not interleaved pairs), with frequencies ``rope_theta ** (-2i / head_dim)``, as fla's do.

Positions count only real tokens: padding (``attention_mask == 0``) takes no position and is never
attended to, so a left-padded row computes what the unpadded sequence computes, as the linear
layers do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from efla.distributed.context_parallel import current_context

from ._common import check_hidden_states, get_layer_state, padding_mask

__all__ = ["Attention", "apply_rotary"]


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x [B, T, H, D]`` by ``positions [B, T]``: channel ``i`` pairs with ``i + D/2`` and turns
    by ``position * theta ** (-2i / D)``. Angles are computed in float32 (float64 for float64 ``x``)."""
    half = x.shape[-1] // 2
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = theta ** (-torch.arange(0, half, device=x.device, dtype=work) * 2 / x.shape[-1])
    angles = positions.to(work)[..., None, None] * inv_freq  # [B, T, 1, D/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half].to(work), x[..., half:].to(work)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def _packed_segments(cu_seqlens: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token of a packed row: ``(segment index, position within the segment)``, each ``[1, L]``."""
    cu = cu_seqlens.long()
    idx = torch.arange(length, device=cu.device)
    segment = torch.searchsorted(cu[1:], idx, right=True)
    return segment[None], (idx - cu[segment])[None]


def _unpack_rows(x: torch.Tensor, cu_seqlens: torch.Tensor, fill) -> torch.Tensor:
    """``x [1, L, ...]`` packed -> ``[N, max_len, ...]``, one sequence per row, left-padded with ``fill``."""
    cu = cu_seqlens.tolist()
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    out = x.new_full((len(lens), max(lens), *x.shape[2:]), fill)
    for row, (start, n) in enumerate(zip(cu[:-1], lens)):
        if n:
            out[row, -n:] = x[0, start : start + n]
    return out


class Attention(nn.Module):
    r"""Causal multi-head softmax attention with RoPE, grouped keys/values and an optional sliding window.

    Args:
        hidden_size: model width ``D``. Default ``2048``.
        num_heads: query heads ``H``; head dim ``D / H`` (even). Default ``32``.
        num_kv_heads: key/value heads (dividing ``H``; query head ``h`` reads key/value head
            ``h // (H / num_kv_heads)``). Default ``None`` = ``H``.
        qkv_bias: biases on the q/k/v projections. Default ``False``.
        window_size: each query sees itself and the ``window_size - 1`` tokens before it; ``None``
            for full causal attention. Default ``None``.
        rope_theta: rotary base. Default ``10000.0``.
        max_position_embeddings: accepted for flash-linear-attention compatibility; no effect.
        layer_idx: index in the model (needed with a cache). Default ``None``.

    ``forward(hidden_states [B, T, D], attention_mask=None [B, >= T] 0/1, past_key_values=None,
    use_cache=False, cu_seqlens=None)`` returns ``(o [B, T, D], None, past_key_values)``; outputs
    at padded positions are zero. With a cache, the layer keeps its rotated keys and values (only
    the last ``window_size - 1`` positions with a window).

    Examples:
        >>> import torch
        >>> layer = Attention(hidden_size=64, num_heads=4, num_kv_heads=2, window_size=8)
        >>> layer(torch.randn(2, 10, 64))[0].shape
        torch.Size([2, 10, 64])
    """

    def __init__(
        self,
        hidden_size: int = 2048,
        num_heads: int = 32,
        num_kv_heads: int | None = None,
        qkv_bias: bool = False,
        window_size: int | None = None,
        rope_theta: float = 10000.0,
        max_position_embeddings: int | None = None,  # noqa: ARG002 (accepted from the model's configuration)
        layer_idx: int | None = None,
        **kwargs: Any,
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or hidden_size % num_heads or (hidden_size // num_heads) % 2:
            raise ValueError(
                f"num_heads: expected a divisor of hidden_size = {hidden_size} giving an even head dim, got {num_heads}"
            )
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads: expected a divisor of num_heads = {num_heads}, got {num_kv_heads}")
        if window_size is not None and window_size < 1:
            raise ValueError(f"window_size: expected None or a positive int, got {window_size}")
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.window_size, self.rope_theta, self.layer_idx = window_size, float(rope_theta), layer_idx
        kv_dim = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, kv_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.record_stats = False  # the model's stats switch reaches every token mixer; nothing to record here
        self.stats = None

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"window_size={self.window_size}, rope_theta={self.rope_theta}"
        )

    def empty_state(self, num_slots: int, device, dtype: torch.dtype, max_length: int | None = None) -> dict:
        """Key/value buffers for ``num_slots`` rows of ``max_length`` positions (a key's row index is
        its position) and each row's length, zeroed (see ``EFLACache.for_model``)."""
        if max_length is None or max_length < 1:
            raise ValueError(
                "max_length: a model with softmax-attention layers needs the positions to allocate "
                f"for its key/value buffers, got {max_length!r}"
            )
        shape = (num_slots, max_length, self.num_kv_heads, self.head_dim)
        kv = (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
        return {"kv_pool": kv, "lengths": torch.zeros(num_slots, dtype=torch.long, device=device)}

    def _pool_step(self, hidden_states, pool, cache, mask=None):
        """Tokens of each row against the key/value buffers of a slot cache: write the new keys and
        values from the row's length on, attend over the positions up to each query (within the
        window). ``mask [B, T, 1]`` pads rows on the right (a speculative verification's rows of
        different lengths): padded tokens write nothing and do not count in the row's length."""
        B, T = hidden_states.shape[:2]
        keys, values = pool["kv_pool"]
        slots = cache.slots if cache.slots is not None else torch.arange(B, device=hidden_states.device)
        # rows past the buffer's end can only be the engine's scratch row (padding of a batch bucket)
        start = pool["lengths"].index_select(0, slots)
        position = (start[:, None] + torch.arange(T, device=start.device)).clamp(max=keys.shape[1] - 1)
        q = self.q_proj(hidden_states).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(B, T, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, position, self.rope_theta), apply_rotary(k, position, self.rope_theta)
        row_slots = slots[:, None].expand(B, T)
        if mask is None:
            keys.index_put_((row_slots, position), k)
            values.index_put_((row_slots, position), v)
        else:
            real = mask[..., 0].bool()
            keys.index_put_((row_slots[real], position[real]), k[real])
            values.index_put_((row_slots[real], position[real]), v[real])
        # on the CPU (no graph to keep static) only the positions written so far
        span = int(position.max()) + 1 if keys.device.type == "cpu" else keys.shape[1]
        key_position = torch.arange(span, device=keys.device)
        allowed = key_position <= position[..., None]  # [B, T, span]
        if self.window_size is not None:
            allowed &= key_position > position[..., None] - self.window_size
        rows = (lambda t: t[:B, :span]) if cache.slots is None else (lambda t: t[:, :span].index_select(0, slots))
        o = self._attend(q, rows(keys), rows(values), allowed[:, None])
        pool["lengths"].index_copy_(0, slots, start + (T if mask is None else mask[:, :, 0].long().sum(1)))
        cache.advance_layer(self.layer_idx, T)
        o = self.o_proj(o.reshape(B, T, self.hidden_size))
        return o if mask is None else o * mask

    def _positions(self, B, T, mask, last_state, cu_seqlens, device):
        """``positions [B, T]`` of the new tokens (-1 at padding), ``segments [B, T]`` (packed input,
        else ``None``) and every row's ``next_position [B]`` after them."""
        if cu_seqlens is not None:
            if last_state is not None:
                raise ValueError("cu_seqlens: packed input cannot continue a cache that holds attention keys")
            cu_seqlens = cu_seqlens.to(device)
            segment, positions = _packed_segments(cu_seqlens, T)
            return positions, segment, (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        real = torch.ones(B, T, dtype=torch.long, device=device) if mask is None else mask[..., 0].long()
        start = torch.zeros(B, dtype=torch.long, device=device) if last_state is None else last_state["next_position"]
        positions = start[:, None] + real.cumsum(1) - 1
        return positions.masked_fill(real == 0, -1), None, start + real.sum(1)

    def _allowed(self, q_pos, k_pos, segments):
        """Boolean ``[B, 1, T, S]``: which keys each query reads (causal, in the window, same sequence)."""
        allowed = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos[:, :, None])
        if self.window_size is not None:
            allowed &= q_pos[:, :, None] - k_pos[:, None, :] < self.window_size
        if segments is not None:
            allowed &= segments[:, :, None] == segments[:, None, :]
        # a padded query reads nothing; let it read everything instead of a NaN (its output is zeroed)
        allowed |= ~allowed.any(-1, keepdim=True)
        return allowed[:, None]

    def _attend(self, q, k, v, allowed):
        groups = self.num_heads // self.num_kv_heads
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if allowed is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return o.transpose(1, 2)

    def _store(self, cache, k, v, k_pos, next_position, cu_seqlens, offset):
        if cu_seqlens is not None:  # one cache row per packed sequence, as the linear layers keep
            k, v = _unpack_rows(k, cu_seqlens, 0), _unpack_rows(v, cu_seqlens, 0)
            k_pos = _unpack_rows(k_pos, cu_seqlens, -1)
        cache.update_attention_state(
            self.layer_idx,
            keys=k,
            values=v,
            key_positions=k_pos,
            next_position=next_position,
            window_size=self.window_size,
            offset=offset,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = False,
        output_attentions: bool | None = False,  # noqa: ARG002 (accepted from the model's configuration)
        cu_seqlens: torch.Tensor | None = None,
        **kwargs: Any,
    ):
        B, T = check_hidden_states(hidden_states, self.hidden_size, self.q_proj.weight.dtype)
        if cu_seqlens is not None and B != 1:
            raise ValueError(f"cu_seqlens: packed input needs batch size 1, got hidden_states {tuple(hidden_states.shape)}")
        if current_context() is not None:
            raise ValueError("context parallelism: softmax-attention layers (config attn) do not support it")
        mask = padding_mask(attention_mask, B, T, cu_seqlens)
        last_state = get_layer_state(past_key_values, self.layer_idx)
        if last_state is not None and "kv_pool" in last_state:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens: a slot cache's attention layers take rows of tokens, not packed sequences")
            return self._pool_step(hidden_states, last_state, past_key_values, mask), None, past_key_values
        use_cache = bool(use_cache) and past_key_values is not None

        q = self.q_proj(hidden_states).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(B, T, self.num_kv_heads, self.head_dim)
        q_pos, segments, next_position = self._positions(B, T, mask, last_state, cu_seqlens, hidden_states.device)
        q, k = apply_rotary(q, q_pos, self.rope_theta), apply_rotary(k, q_pos, self.rope_theta)
        k_all, v_all, k_pos = k, v, q_pos
        if last_state is not None:
            past_k, past_v = last_state["attn_state"]
            k_all, v_all = torch.cat([past_k, k], 1), torch.cat([past_v, v], 1)
            k_pos = torch.cat([last_state["key_positions"], q_pos], 1)
        if use_cache:
            self._store(past_key_values, k_all, v_all, k_pos, next_position, cu_seqlens, offset=T)

        plain_causal = last_state is None and mask is None and segments is None and self.window_size is None
        o = self._attend(q, k_all, v_all, None if plain_causal else self._allowed(q_pos, k_pos, segments))
        o = self.o_proj(o.reshape(B, T, self.hidden_size))
        if mask is not None:
            o = o * mask
        return o, None, past_key_values
