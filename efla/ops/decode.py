"""One decoding step of a whole token mixer, fused into one GPU kernel.

A decoding step of an EFLA / DeltaNet (gated or not) layer, after its input projections, is a
chain of small operations on a few vectors per row: push the new q, k, v into the short
convolutions' histories and convolve, activate, L2-normalise q (and k for the Euler rules), form
beta (and the decay gate), update the ``[K, V]`` state of every value head, read it out with q,
and RMS-normalise (and gate) the output. ``fused_decode_step`` does all of it in one launch,
updating the cache's convolution histories and states in place (in the pool rows ``slots``).
Everything else (CPU tensors, Triton missing, head dims whose state block does not fit in
registers; see ``fused_decode_available``) runs the layer's own code instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DecodeSpec", "fused_decode_available", "fused_decode_step"]


@dataclass(frozen=True)
class DecodeSpec:
    """What a token mixer's decoding step computes (the constants of the fused kernel)."""

    num_heads: int  # query/key heads
    groups: int  # value heads per query/key head
    head_k_dim: int
    head_v_dim: int
    exact: bool  # exact flow (EFLA) or the Euler step (DeltaNet)
    gated: bool  # decay gate -exp(A_log) softplus(a + dt_bias)
    qk_silu: bool  # SiLU on q and k after their convolutions
    beta_scale: float  # beta = beta_scale * sigmoid(b) (2 with negative eigenvalues allowed)
    k_l2: bool  # L2-normalise k (the Euler rules; q always)
    out_gate: str | None  # output gate activation ("swish" / "sigmoid") or None
    norm_eps: float
    conv_size: int


def fused_decode_available(spec: DecodeSpec, x: torch.Tensor, state: torch.Tensor) -> bool:
    """Whether ``fused_decode_step`` runs for inputs like ``x`` and this state pool."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    from .api import _cuda

    if _cuda() is None:
        return False
    from .cuda import decode

    return decode.supported(spec, state)


def fused_decode_step(spec: DecodeSpec, q, k, v, beta, a, gate, conv, state, slots, A_log=None, dt_bias=None,
                      norm_weight=None) -> torch.Tensor:
    """``o [N, HV * V]``: the normalised (and gated) output of one token per row (where
    ``fused_decode_available``).

    ``q, k [N, H * K]``, ``v [N, HV * V]``: the raw projections (before convolution); ``beta``,
    ``a [N, HV]``: the raw beta and gate projections (``beta`` ``None``: beta = 1; ``a`` used when
    ``spec.gated``); ``gate [N, HV * V]``: the output gate's projection or ``None``; ``conv``:
    ``((wq, wk, wv), (bq, bk, bv), (cq, ck, cv))`` weights ``[D, W]``, biases or ``None`` and the
    histories ``[S, D, W]`` (advanced in place), or ``None`` without convolutions; ``state``:
    ``[S, HV, K, V]`` float32 (advanced in place); ``slots``: ``[N]`` pool rows or ``None``
    (row ``n`` is pool row ``n``)."""
    from .cuda import decode

    return decode.decode_step(spec, q, k, v, beta, a, gate, conv, state, slots, A_log, dt_bias, norm_weight)
