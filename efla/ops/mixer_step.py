"""One decoding step of a whole token mixer, fused into one GPU kernel.

A decoding step of an EFLA / DeltaNet (gated or not) layer, after its input projections, is a
chain of small operations on a few vectors per row: push the new q, k, v into the short
convolutions' histories and convolve, activate, L2-normalise q (and k for the Euler rules), form
beta (and the decay gate), update the ``[K, V]`` state of every value head, read it out with q,
and RMS-normalise (and gate) the output. ``fused_decode_step`` does all of it in one launch,
updating the cache's convolution histories and states in place (in the pool rows ``slots``).
On the CPU the same step runs as a short chain of PyTorch operations (without the general
code's checks, layouts and autograd machinery, which cost a one-token step more than its
arithmetic). Where neither applies (a GPU without Triton, head dims whose state block does not
fit in registers; see ``fused_decode_available``) the layer runs its own code instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .coefficients import coefficients
from .normalize import l2_normalize

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
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.float64) and state.dtype in (torch.float32, torch.float64)
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    from .api import _cuda  # noqa: PLC0415 (lazy: the GPU backend imports triton)

    if _cuda() is None:
        return False
    from .cuda import decode  # noqa: PLC0415 (lazy: the GPU backend imports triton)

    return decode.supported(spec, state)


def fused_decode_step(
    spec: DecodeSpec, q, k, v, beta, a, gate, conv, state, slots, A_log=None, dt_bias=None, norm_weight=None
) -> torch.Tensor:
    """``o [N, HV * V]``: the normalised (and gated) output of one token per row (where
    ``fused_decode_available``).

    ``q, k [N, H * K]``, ``v [N, HV * V]``: the raw projections (before convolution); ``beta``,
    ``a [N, HV]``: the raw beta and gate projections (``beta`` ``None``: beta = 1; ``a`` used when
    ``spec.gated``); ``gate [N, HV * V]``: the output gate's projection or ``None``; ``conv``:
    ``((wq, wk, wv), (bq, bk, bv), (cq, ck, cv))`` weights ``[D, W]``, biases or ``None`` and the
    histories ``[S, D, W]`` (advanced in place), or ``None`` without convolutions; ``state``:
    ``[S, HV, K, V]`` float32 (advanced in place); ``slots``: ``[N]`` pool rows or ``None``
    (row ``n`` is pool row ``n``)."""
    if q.device.type == "cpu":
        return _decode_step_torch(spec, q, k, v, beta, a, gate, conv, state, slots, A_log, dt_bias, norm_weight)
    from .cuda import decode  # noqa: PLC0415 (lazy: the GPU backend imports triton)

    return decode.decode_step(spec, q, k, v, beta, a, gate, conv, state, slots, A_log, dt_bias, norm_weight)


def _rows(pool: torch.Tensor, slots) -> torch.Tensor:
    return pool if slots is None else pool.index_select(0, slots)


def _store(pool: torch.Tensor, slots, rows: torch.Tensor) -> None:
    if slots is None:
        pool.copy_(rows)
    else:
        pool.index_copy_(0, slots, rows.to(pool.dtype))


def _conv_push(x, weight, bias, pool, slots, silu: bool) -> torch.Tensor:
    """Push ``x [N, D]`` into the histories ``[S, D, W]`` and return the convolution's output."""
    history = torch.cat([_rows(pool, slots)[..., 1:], x.to(pool.dtype)[..., None]], dim=-1)
    _store(pool, slots, history)
    y = (history.to(x.dtype) * weight.to(x.dtype)).sum(-1)
    y = y + bias.to(x.dtype) if bias is not None else y
    return F.silu(y) if silu else y


def _decode_step_torch(spec, q, k, v, beta, a, gate, conv, state, slots, A_log, dt_bias, norm_weight):
    """``fused_decode_step`` in PyTorch, in the state's precision (the same arithmetic as the
    layers' general path: coefficients from ``efla.ops.coefficients``)."""
    N, H, G, K, V = q.shape[0], spec.num_heads, spec.groups, spec.head_k_dim, spec.head_v_dim
    cdt, out_dtype = state.dtype, q.dtype
    q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
    if conv is not None:
        (wq, wk, wv), (bq, bk, bv), (cq, ck, cv) = conv
        q = _conv_push(q, wq, bq, cq, slots, spec.qk_silu)
        k = _conv_push(k, wk, bk, ck, slots, spec.qk_silu)
        v = _conv_push(v, wv, bv, cv, slots, True)
    else:
        q, k, v = (F.silu(q), F.silu(k), F.silu(v)) if spec.qk_silu else (q, k, F.silu(v))
    q = (l2_normalize(q.view(N, H, K)) * K**-0.5).repeat_interleave(G, dim=1)  # [N, HV, K]
    k = (l2_normalize(k.view(N, H, K)) if spec.k_l2 else k.view(N, H, K)).repeat_interleave(G, dim=1)
    v = v.view(N, H * G, V)
    b = spec.beta_scale * torch.sigmoid(beta.to(cdt)) if beta is not None else torch.full((N, H * G), spec.beta_scale, dtype=cdt)
    g = -A_log.to(cdt).exp() * F.softplus(a.to(cdt) + dt_bias.to(cdt)) if spec.gated else None
    rule = ("gated_efla" if spec.gated else "efla") if spec.exact else ("gated_delta_rule" if spec.gated else "delta_rule")
    gamma, erase, write = coefficients(rule, k[:, None], b[:, None], None if g is None else g[:, None])
    S = _rows(state, slots)
    decay = torch.ones_like(b) if gamma is None else gamma[:, 0].exp()
    predicted = torch.einsum("nhk,nhkv->nhv", k, S)
    correction = write[:, 0, :, None] * v - (decay * erase[:, 0])[..., None] * predicted
    S = S * decay[..., None, None] + k[..., None] * correction[..., None, :]
    _store(state, slots, S)
    o = torch.einsum("nhk,nhkv->nhv", q, S)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + spec.norm_eps) * norm_weight.to(cdt)
    if spec.out_gate is not None:
        gate = gate.to(cdt).view(N, H * G, V)
        o = o * (torch.sigmoid(gate) if spec.out_gate == "sigmoid" else F.silu(gate))
    return o.reshape(N, H * G * V).to(out_dtype)
