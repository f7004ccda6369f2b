"""Fused recurrent scan on the GPU (decoding and short inference inputs; no autograd).

One Triton program per (sequence, head, block of V columns) keeps its ``[K, BV]`` slice of the
state in registers and walks the tokens; the exact-flow coefficient is computed in-kernel, so a
decoding step is a single launch for every rule.
"""

from __future__ import annotations

import torch
import triton

from . import step_kernels as kn
from .kernels import G_FLOOR

_RULES = {"efla": (True, False), "gated_efla": (True, True), "delta_rule": (False, False), "gated_delta_rule": (False, True)}


def recurrent_forward(kind, q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens):
    exact, gated = _RULES[kind]
    B, T, H, K = k.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 32 if BK <= 128 else 16)
    o = torch.empty_like(v)
    ht = torch.empty(N, H, K, V, device=k.device, dtype=torch.float32) if output_final_state else None
    kn.recurrent_kernel[(triton.cdiv(V, BV), N * H)](
        q,
        k,
        v,
        beta,
        g,
        h0,
        ht,
        o,
        cu_seqlens,
        scale,
        T,
        H=H,
        K=K,
        V=V,
        BK=BK,
        BV=BV,
        EXACT=exact,
        GATED=gated,
        HAS_H0=h0 is not None,
        STORE_HT=output_final_state,
        IS_VARLEN=cu_seqlens is not None,
        G_MIN=G_FLOOR,
        num_warps=4 if BK * BV <= 4096 else 8,
    )
    return o, ht
