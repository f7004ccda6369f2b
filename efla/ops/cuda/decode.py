"""The fused decoding step of a token mixer on the GPU (see ``step_kernels.decode_step_kernel``)."""

from __future__ import annotations

import contextlib

import torch
import triton

from ..normalize import L2NORM_EPS
from . import step_kernels as kn
from .kernels import G_FLOOR

# the state block of one value head lives in registers: beyond this many float32 values it spills
MAX_STATE_BLOCK = 128 * 128
_OUT_GATES = {None: 0, "swish": 1, "silu": 1, "sigmoid": 2}


def supported(spec, state: torch.Tensor) -> bool:
    """Whether the kernel takes a mixer of this shape and a state pool of this layout."""
    block = triton.next_power_of_2(spec.head_k_dim) * triton.next_power_of_2(spec.head_v_dim)
    return block <= MAX_STATE_BLOCK and state.is_contiguous() and state.dtype == torch.float32


def _row_stride(x: torch.Tensor | None) -> int:
    return 0 if x is None else x.stride(0)


_forced_blocks: int | None = None
# value columns per program: on an H200 halves of 128-column heads beat whole heads at every batch
# (340M layer step at batch 64: 47.7 vs 58.5 us; 256: 107 vs 152) and quarters (47.7 / 115)
SPLIT_COLUMNS = 64


@contextlib.contextmanager
def value_blocks(n: int | None):
    """Run every step with ``n`` blocks of value columns per head (``None``: chosen by shape)."""
    global _forced_blocks
    before, _forced_blocks = _forced_blocks, n
    try:
        yield
    finally:
        _forced_blocks = before


def _value_blocks(BV: int) -> int:
    if _forced_blocks is not None:
        return max(1, min(_forced_blocks, BV))
    return max(1, BV // SPLIT_COLUMNS)


def decode_step(spec, q, k, v, beta, a, gate, conv, state, slots, A_log, dt_bias, norm_weight):
    """``o [N, HV * V]`` of one token per row, normalised (and gated); the convolution histories
    and ``state`` rows (``slots[n]``, or row ``n``) advance in place. ``q, k, v, beta, a, gate``
    are the raw projections ``[N, ...]`` (row strides may differ: slices of one product).

    Wide value heads are split over several programs (more of them share the state's traffic), and
    a second small kernel normalises the output."""
    N = q.shape[0]
    H, G, K, V = spec.num_heads, spec.groups, spec.head_k_dim, spec.head_v_dim
    out = torch.empty(N, H * G * V, device=q.device, dtype=q.dtype)
    weights, biases, pools = conv if conv is not None else ((None,) * 3, (None,) * 3, (None,) * 3)
    W = spec.conv_size if conv is not None else 1
    BK, BV = triton.next_power_of_2(K), triton.next_power_of_2(V)
    blocks = _value_blocks(BV)
    split = blocks > 1
    raw = torch.empty(N, H * G * V, device=q.device, dtype=torch.float32) if split else out
    BW = triton.next_power_of_2(W)
    kn.decode_step_kernel[(N, H, blocks)](
        q,
        k,
        v,
        beta,
        a,
        gate,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        _row_stride(beta),
        _row_stride(a),
        _row_stride(gate),
        *weights,
        *biases,
        *pools,
        state,
        slots,
        A_log,
        dt_bias,
        norm_weight,
        raw,
        K**-0.5,
        spec.norm_eps,
        L2NORM_EPS,
        H=H,
        G=G,
        K=K,
        V=V,
        BK=BK,
        BV=BV // blocks,
        W=W,
        BW=BW,
        EXACT=spec.exact,
        GATED=spec.gated,
        HAS_CONV=conv is not None,
        HAS_CONV_BIAS=biases[0] is not None,
        QK_SILU=spec.qk_silu,
        USE_BETA=beta is not None,
        BETA_SCALE=spec.beta_scale,
        K_L2=spec.k_l2,
        HAS_SLOTS=slots is not None,
        OUT_GATE=_OUT_GATES[spec.out_gate],
        G_MIN=G_FLOOR,
        SPLIT=split,
        num_warps=8 if BK * BV // blocks >= 128 * 128 else 4,
    )
    if split:
        kn.decode_norm_kernel[(N, H)](
            raw,
            q,
            k,
            gate,
            q.stride(0),
            k.stride(0),
            _row_stride(gate),
            pools[0],
            pools[1],
            slots,
            norm_weight,
            out,
            spec.norm_eps,
            H=H,
            G=G,
            K=K,
            V=V,
            BK=BK,
            BV=BV,
            W=W,
            BW=BW,
            HAS_CONV=conv is not None,
            HAS_SLOTS=slots is not None,
            OUT_GATE=_OUT_GATES[spec.out_gate],
            num_warps=4,
        )
    return out
