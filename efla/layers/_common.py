"""Shared plumbing of the token mixers: input checks, padding masks, the cache protocol, stats."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from efla.errors import NonFiniteValues
from efla.ops import efla_coefficient
from efla.ops.validate import all_finite, check_cu_seqlens, values_checked

UPDATE_RULES = ("exact", "euler")


def check_update_rule(update_rule: str) -> str:
    if update_rule not in UPDATE_RULES:
        raise ValueError(f"update_rule: expected one of {UPDATE_RULES}, got {update_rule!r}")
    return update_rule


def _bare_linear(layer: nn.Module) -> bool:
    """Whether ``layer`` computes ``x @ weight.T`` and nothing else: a wrapped or hooked projection
    (PEFT's LoRA, accelerate's offloading, weight norm, a quantised weight) must run itself."""
    module = nn.modules.module
    hooked = (
        layer._forward_hooks
        or layer._forward_pre_hooks
        or "forward" in layer.__dict__
        or layer._backward_hooks
        or layer._backward_pre_hooks
        or module._global_forward_hooks
        or module._global_forward_pre_hooks
        or module._global_backward_hooks
        or module._global_backward_pre_hooks
    )
    return type(layer) is nn.Linear and type(layer.weight) is nn.Parameter and layer.bias is None and not hooked


class _StackedLinear(torch.autograd.Function):
    """``x @ cat(weights).T``, keeping only ``x`` and the separate weights for backward: the
    stacked copy lives for one product each way and autograd keeps nothing the separate products
    would not."""

    @staticmethod
    def forward(ctx, x, *weights):
        ctx.save_for_backward(x, *weights)
        out = F.linear(x, torch.cat(weights))
        ctx.compute_dtype = out.dtype  # under autocast not the inputs': backward computes in it too
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, *weights = ctx.saved_tensors
        dt = ctx.compute_dtype
        grad_out, xc = grad_out.to(dt), x.to(dt)
        grad_x = (grad_out @ torch.cat(weights).to(dt)).to(x.dtype) if ctx.needs_input_grad[0] else None
        needed = ctx.needs_input_grad[1:]
        if not any(needed):  # frozen projections (prompt tuning, adapters elsewhere)
            return grad_x, *(None for _ in weights)
        grad_stacked = grad_out.reshape(-1, grad_out.shape[-1]).T @ xc.reshape(-1, xc.shape[-1])
        grads = grad_stacked.split([w.shape[0] for w in weights])
        return grad_x, *(g.to(w.dtype) if need else None for g, w, need in zip(grads, weights, needed))


def project(x: torch.Tensor, layers: list, fuse: bool) -> list[torch.Tensor]:
    """Each of ``layers`` (linear projections) applied to ``x``. With ``fuse``, in training, as one
    matrix product over their stacked weights: the same results, one product instead of
    ``len(layers)`` forward and two instead of ``2 * len(layers)`` backward (and one gradient for
    ``x`` instead of a sum of ``len(layers)``), the stacked weights formed once each way. Without
    gradients (decoding above all, where reading the weights dominates) and for wrapped or hooked
    projections they run one by one."""
    if fuse and torch.is_grad_enabled() and all(map(_bare_linear, layers)):
        stacked = _StackedLinear.apply(x, *(layer.weight for layer in layers))
        return list(stacked.split([layer.out_features for layer in layers], dim=-1))
    return [layer(x) for layer in layers]


def check_hidden_states(
    hidden_states: torch.Tensor, hidden_size: int, expected_dtype: torch.dtype | None = None
) -> tuple[int, int]:
    """``(B, T)`` of ``hidden_states [B, T, hidden_size]``; ``expected_dtype`` is the layer's own
    (its projections fail on another with an unrelated error)."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        shape = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
        raise ValueError(f"hidden_states: expected a tensor [B, T, {hidden_size}], got {shape}")
    B, T, D = hidden_states.shape
    if hidden_size != D:
        raise ValueError(f"hidden_states: expected last dim hidden_size = {hidden_size}, got shape {(B, T, D)}")
    if T < 1:
        raise ValueError(f"hidden_states: expected at least one token, got shape {(B, T, D)}")
    if not hidden_states.is_floating_point():
        raise ValueError(f"hidden_states: expected a floating-point tensor, got dtype {hidden_states.dtype}")
    if expected_dtype is not None and hidden_states.dtype != expected_dtype:
        raise ValueError(f"hidden_states: expected dtype {expected_dtype} (the layer's parameters), got {hidden_states.dtype}")
    # checked here, not only by the op: a NaN or Inf would otherwise surface as a message about q or k
    if values_checked(hidden_states) and not all_finite(hidden_states):
        bad = (~torch.isfinite(hidden_states)).sum().item()
        raise NonFiniteValues(f"hidden_states: contains {bad} non-finite value(s) (NaN or Inf)")
    return B, T


def check_num_v_heads(num_v_heads: int | None, num_heads: int) -> int:
    """The number of value heads (``None`` = ``num_heads``): a positive multiple of ``num_heads``."""
    if num_v_heads is None:
        return num_heads
    is_count = isinstance(num_v_heads, int) and not isinstance(num_v_heads, bool)
    if not is_count or num_v_heads < 1 or num_v_heads % num_heads != 0:
        raise ValueError(
            f"num_v_heads: expected a positive multiple of num_heads = {num_heads} (or None for num_heads), got {num_v_heads!r}"
        )
    return num_v_heads


def per_value_head(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """``[B, T, H, ...] -> [B, T, num_v_heads, ...]``: value head ``i`` gets head ``i // (num_v_heads // H)``,
    the grouping the ops apply to q and k."""
    groups = num_v_heads // x.shape[2]
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def padding_mask(attention_mask: torch.Tensor | None, B: int, T: int, cu_seqlens) -> torch.Tensor | None:
    """The last ``T`` columns of a 0/1 padding mask ``[B, L >= T]`` as ``[B, T, 1]`` (or ``None``
    when absent or all ones; while a CUDA graph is captured, unchecked and never ``None``). Padded
    positions become identity steps of the recurrence.

    Also checks ``cu_seqlens``: the layers call this before the short convolutions, which index
    with ``cu_seqlens`` and would fail on malformed offsets with an unrelated error."""
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, B, T)
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(
            f"attention_mask: expected a 0/1 padding mask of shape [B, T] (0 = padding), got {shape}; "
            "arbitrary [B, T, T] masks are not supported by linear attention"
        )
    if attention_mask.shape[0] != B or attention_mask.shape[1] < T:
        raise ValueError(f"attention_mask: expected shape ({B}, >= {T}), got {tuple(attention_mask.shape)}")
    if cu_seqlens is not None:
        raise ValueError("attention_mask: cannot be combined with cu_seqlens (packed input has no padding)")
    m = attention_mask[:, -T:]
    if m.dtype == torch.bool:
        m = m.long()
    if m.is_cuda and torch.cuda.is_current_stream_capturing():  # no value can be read: taken as given
        return m[..., None]
    if bool(((m != 0) & (m != 1)).any()):
        raise ValueError("attention_mask: expected only 0 and 1 values")
    if bool((m == 1).all()):
        return None
    return m[..., None]


def get_layer_state(cache: Any, layer_idx: int | None) -> dict | None:
    """Cache protocol: any object with ``get_layer_state(idx)`` and ``update_layer_state(idx, ...)``
    (``efla.models.EFLACache`` implements it)."""
    if cache is None:
        return None
    if layer_idx is None:
        raise ValueError("layer_idx: a layer used with a cache needs its layer_idx set at construction")
    if not hasattr(cache, "get_layer_state") or not hasattr(cache, "update_layer_state"):
        raise ValueError(f"past_key_values: expected an efla cache (efla.models.EFLACache), got {type(cache).__name__}")
    return cache.get_layer_state(layer_idx)


def empty_recurrent_state(layer, num_slots: int, device, dtype: torch.dtype) -> dict:
    """A linear-attention layer's decoding state for ``num_slots`` rows, zeroed: the ``[S, HV, K, V]``
    matrix states in float32 (float64 for float64 models) and the q, k, v convolution histories
    ``[S, D, W]`` in the model's dtype (``None`` without short convolutions)."""
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    state = torch.zeros(num_slots, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, device=device, dtype=state_dtype)
    conv = None
    if layer.use_short_conv:
        conv = tuple(
            torch.zeros(num_slots, width, layer.conv_size, device=device, dtype=dtype)
            for width in (layer.key_dim, layer.key_dim, layer.value_dim)
        )
    return {"recurrent_state": state, "conv_state": conv}


def stiffness_stats(k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None, update_rule: str) -> dict:
    """Detached per-head statistics of one forward (all ``[B, T, H]``, float32).

    ``key_norm_sq`` is ``lambda = ||k||^2`` of the keys fed to the recurrence, ``stiffness`` is
    ``beta * lambda`` (where the exact and Euler steps differ), ``erase`` is the coefficient that
    multiplies ``k k^T`` (exact: ``(1 - exp(-beta' lambda)) / lambda`` with ``beta' = beta * exp(g)``
    for the gated rule; Euler: ``beta``) and ``transition_eig = 1 - erase * lambda`` is the state
    transition's eigenvalue along ``k`` (before the gate; negative means the Euler step overshoots).
    """
    with torch.no_grad():
        kf, bf = k.detach().float(), beta.detach().float()
        lam = (kf * kf).sum(-1)
        stats = {"beta": bf, "key_norm_sq": lam, "stiffness": bf * lam}
        if update_rule == "exact":
            b_eff = bf if g is None else bf * g.detach().float().exp()
            erase = efla_coefficient(b_eff, kf)
        else:
            erase = bf
        stats["erase"] = erase
        stats["transition_eig"] = 1.0 - erase * lam
        if g is not None:
            stats["g"] = g.detach().float()
    return stats
