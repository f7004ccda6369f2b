"""The fused decoding step of a token mixer on the GPU (see ``kernels.decode_step_kernel``)."""

from __future__ import annotations

import torch
import triton

from ..normalize import L2NORM_EPS
from . import kernels as kn

# the state block of one value head lives in registers: beyond this many float32 values it spills
MAX_STATE_BLOCK = 128 * 128
_OUT_GATES = {None: 0, "swish": 1, "silu": 1, "sigmoid": 2}


def supported(spec, state: torch.Tensor) -> bool:
    """Whether the kernel takes a mixer of this shape and a state pool of this layout."""
    block = triton.next_power_of_2(spec.head_k_dim) * triton.next_power_of_2(spec.head_v_dim)
    return block <= MAX_STATE_BLOCK and state.is_contiguous() and state.dtype == torch.float32


def _row_stride(x: torch.Tensor | None) -> int:
    return 0 if x is None else x.stride(0)


def decode_step(spec, q, k, v, beta, a, gate, conv, state, slots, A_log, dt_bias, norm_weight):
    """``o [N, HV * V]`` of one token per row, normalised (and gated); the convolution histories
    and ``state`` rows (``slots[n]``, or row ``n``) advance in place. ``q, k, v, beta, a, gate``
    are the raw projections ``[N, ...]`` (row strides may differ: slices of one product)."""
    N = q.shape[0]
    H, G, K, V = spec.num_heads, spec.groups, spec.head_k_dim, spec.head_v_dim
    out = torch.empty(N, H * G * V, device=q.device, dtype=q.dtype)
    weights, biases, pools = conv if conv is not None else ((None,) * 3, (None,) * 3, (None,) * 3)
    W = spec.conv_size if conv is not None else 1
    BK, BV = triton.next_power_of_2(K), triton.next_power_of_2(V)
    kn.decode_step_kernel[(N, H)](
        q, k, v, beta, a, gate,
        q.stride(0), k.stride(0), v.stride(0), _row_stride(beta), _row_stride(a), _row_stride(gate),
        *weights, *biases, *pools,
        state, slots, A_log, dt_bias, norm_weight, out, K ** -0.5, spec.norm_eps, L2NORM_EPS,
        H=H, G=G, K=K, V=V, BK=BK, BV=BV, W=W, BW=triton.next_power_of_2(W), EXACT=spec.exact, GATED=spec.gated,
        HAS_CONV=conv is not None, HAS_CONV_BIAS=biases[0] is not None, QK_SILU=spec.qk_silu,
        USE_BETA=beta is not None, BETA_SCALE=spec.beta_scale, K_L2=spec.k_l2, HAS_SLOTS=slots is not None,
        OUT_GATE=_OUT_GATES[spec.out_gate], G_MIN=kn.G_FLOOR,
        num_warps=8 if BK * BV >= 128 * 128 else 4,
    )
    return out
