"""The token mixers' single-token step: one token per row, states updated in place.

On the GPU a step of an EFLA / Gated EFLA layer is its input projections (optionally one matrix
product over a stacked copy of their weights, see ``set_merged_projections``), the fused step
kernel (``efla.ops.fused_decode_step``: convolutions, activations, beta and gate, the state
update, the output norm) and the output projection; on the CPU the same step in PyTorch. The
layers take this path for a one-token call without autograd whose cache already holds the
layer's state; every other call runs their general code, which gives the same results (to
rounding); so does every call under ``efla.layers.fla_kernels.disabled()`` (``EFLA_FLA_KERNELS=0``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from efla.distributed.context_parallel import context_parallel_inactive
from efla.ops import fused_decode_available, fused_decode_step

from . import fla_kernels
from ._common import _bare_linear

__all__ = [
    "stacked_projections",
    "refresh_stacked_weights",
    "merged_projections",
    "set_merged_projections",
    "decode_pool",
    "fused_decode",
]

_merge = True
_STACK = "_decode_stacked_weight"


def set_merged_projections(flag: bool) -> None:
    """Decode with one product over stacked projection weights (True, the default: fewer launches, one
    extra copy of those weights on the GPU; on an H200 a captured 340M step at batch 1 takes 0.96
    instead of 1.30 ms) or one product per projection (False)."""
    global _merge
    _merge = bool(flag)


@contextlib.contextmanager
def merged_projections(flag: bool):
    before = _merge
    set_merged_projections(flag)
    try:
        yield
    finally:
        set_merged_projections(before)


def _weights_key(layers) -> tuple:
    return tuple((layer.weight.data_ptr(), layer.weight._version) for layer in layers)


def _stacked_weight(owner: nn.Module, layers: list[nn.Module]) -> torch.Tensor:
    """``cat([layer.weight ...])``, kept on ``owner`` and refilled in place when a weight changes (so a
    captured CUDA graph keeps reading the right address)."""
    key = _weights_key(layers)
    held = owner.__dict__.get(_STACK)
    if held is not None and held[1] == key:
        return held[2]
    rows = sum(layer.weight.shape[0] for layer in layers)
    first = layers[0].weight
    stacked = held[2] if held is not None else None
    if (
        stacked is None
        or stacked.shape != (rows, first.shape[1])
        or stacked.dtype != first.dtype
        or stacked.device != first.device
    ):
        stacked = torch.empty(rows, first.shape[1], dtype=first.dtype, device=first.device)
    start = 0
    with torch.no_grad():
        for layer in layers:
            stacked[start : start + layer.weight.shape[0]].copy_(layer.weight)
            start += layer.weight.shape[0]
    owner.__dict__[_STACK] = (layers, key, stacked)
    return stacked


def stacked_projections(owner: nn.Module, x: torch.Tensor, layers: list[nn.Module]) -> list[torch.Tensor]:
    """Each of ``layers`` (linear projections) applied to ``x``: on the GPU, without autograd, one
    product over a stacked copy of their weights (the outputs are slices of it); else one by one."""
    if not (_merge and x.is_cuda and not torch.is_grad_enabled() and all(map(_bare_linear, layers))):
        return [layer(x) for layer in layers]
    out = F.linear(x, _stacked_weight(owner, layers))
    return list(out.split([layer.out_features for layer in layers], dim=-1))


def refresh_stacked_weights(model: nn.Module) -> None:
    """Refill every stacked weight copy whose source weights changed since it was made (before
    replaying a captured graph, which never runs that check itself)."""
    for module in model.modules():
        held = module.__dict__.get(_STACK)
        if held is not None:
            _stacked_weight(module, held[0])


def decode_pool(layer, hidden_states, attention_mask, cache, use_cache, cu_seqlens) -> dict | None:
    """The layer's stored state when this call can take the fused decoding step, else ``None``."""
    if not (
        use_cache
        and fla_kernels.enabled()
        and hidden_states.shape[1] == 1
        and cu_seqlens is None
        and attention_mask is None
        and cache is not None
        and layer.layer_idx is not None
        and not torch.is_grad_enabled()
        and not layer.record_stats
        and context_parallel_inactive()
    ):
        return None
    pool = cache.layer_pool(layer.layer_idx) if hasattr(cache, "layer_pool") else None
    spec = layer.decode_spec()
    if pool is None or pool.get("recurrent_state") is None or spec is None:
        return None
    if not fused_decode_available(spec, hidden_states, pool["recurrent_state"]):
        return None
    conv = pool.get("conv_state")
    if layer.use_short_conv and (conv is None or not all(c.is_contiguous() for c in conv)):
        return None
    return pool


def fused_decode(layer, hidden_states, cache, pool, projections: list[str], gates: dict) -> torch.Tensor:
    """``o [B, 1, D]`` of one step through the fused kernel (where ``decode_pool`` gave a pool).
    ``projections``: the layer's input projections in the order q, k, v, then those of ``gates``
    (names of the kernel's ``beta``, ``a`` and ``gate`` inputs)."""
    x = hidden_states[:, 0]
    layers = [getattr(layer, name) for name in projections]
    outputs = dict(zip(projections, stacked_projections(layer, x, layers)))
    conv = None
    if layer.use_short_conv:
        convs = (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)
        conv = (tuple(c.weight.squeeze(1) for c in convs), tuple(c.bias for c in convs), pool["conv_state"])
    named = {role: outputs.get(name) for role, name in gates.items()}
    o = fused_decode_step(
        layer.decode_spec(),
        outputs["q_proj"],
        outputs["k_proj"],
        outputs["v_proj"],
        named.get("beta"),
        named.get("a"),
        named.get("gate"),
        conv,
        pool["recurrent_state"],
        getattr(cache, "slots", None),
        getattr(layer, "A_log", None),
        getattr(layer, "dt_bias", None),
        layer.o_norm.weight,
    )
    cache.advance_layer(layer.layer_idx)
    return layer.o_proj(o)[:, None]
