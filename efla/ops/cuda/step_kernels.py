"""Triton kernels that take one token at a time (imported only when a CUDA tensor arrives).

* ``recurrent_kernel``: fused per-token scan for decoding / inference, all four rules, the
  coefficient computed in-kernel, state kept in registers.
* ``decode_step_kernel``: one decoding step of a whole token mixer from its input projections:
  short-convolution updates, activations, q/k normalisation, beta and gate, the state update and
  the output norm (gated or not), the cache's convolution histories and states updated in place;
  ``decode_norm_kernel`` finishes it when value heads are split over programs.

The coefficients' math is in ``kernels.py``, whose helpers these kernels share.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernels import _expm1, _one_minus_exp_neg, _phi, _softplus


@triton.jit
def _delta_step(b_s, b_k, b_v, b_b, b_g, EXACT: tl.constexpr, GATED: tl.constexpr, G_MIN: tl.constexpr):
    """One token of any of the four rules on a ``[BK, BV]`` float32 state block: ``b_k [BK]``,
    ``b_v [BV]``, scalar ``b_b`` (beta) and ``b_g`` (log gate, read only when ``GATED``)."""
    if EXACT:
        # k = m u with max |u| = 1: lambda = m^2 ||u||^2 may overflow float32 where the step
        # S += k (w v - e k^T S)^T = u (lambda w / (m s) v - lambda e / s u^T S)^T stays finite
        # (s = ||u||^2 in [1, K]; lambda e and lambda w are bounded fractions)
        m = tl.max(tl.abs(b_k), 0)
        m1 = tl.where(m > 0, m, 1.0)
        b_u = b_k / m1
        s = tl.sum(b_u * b_u)
        s1 = tl.where(s > 0, s, 1.0)
        # beta * lambda in an order that stays 0 for beta = 0 and finite wherever it is
        # (lambda = m^2 s itself may be Inf)
        if GATED:
            a_c = tl.exp(tl.maximum(b_g, G_MIN))
            x1 = (b_b * m) * (a_c * m) * s
            b_gl = _expm1(b_g)
            frac_e = _one_minus_exp_neg(x1)
            eta = x1 - b_gl
            big = tl.maximum(x1, 1.0)
            frac_w = tl.where(x1 < 1.0, x1 / a_c * _phi(eta), _one_minus_exp_neg(eta) / (a_c * (1.0 - b_gl / big)))
            b_s = b_s * tl.exp(b_gl)
        else:
            frac_e = _one_minus_exp_neg((b_b * m) * m * s)
            frac_w = frac_e
        b_uh = tl.sum(b_s * b_u[:, None], 0)  # [BV]
        b_s += b_u[:, None] * (frac_w / (m1 * s1) * b_v - frac_e / s1 * b_uh)[None, :]
    else:
        if GATED:
            b_s = b_s * tl.exp(b_g)
        b_kh = tl.sum(b_s * b_k[:, None], 0)  # [BV]
        b_s += b_k[:, None] * (b_b * b_v - b_b * b_kh)[None, :]
    return b_s


@triton.jit
def recurrent_kernel(
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
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    EXACT: tl.constexpr,
    GATED: tl.constexpr,
    HAS_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    G_MIN: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = i_n.to(tl.int64) * T
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_s = (i_nh.to(tl.int64) * K + o_k[:, None]) * V + o_v[None, :]
    if HAS_H0:
        b_s = tl.load(h0 + p_s, mask=m_kv, other=0.0).to(tl.float32)
    else:
        b_s = tl.zeros([BK, BV], dtype=tl.float32)
    for i_t in range(0, T):
        t = bos + i_t
        b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (t * H + i_h) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_b = tl.load(beta + t * H + i_h).to(tl.float32)
        b_g = 0.0
        if GATED:
            b_g = tl.load(g + t * H + i_h).to(tl.float32)
        b_s = _delta_step(b_s, b_k, b_v, b_b, b_g, EXACT, GATED, G_MIN)
        b_o = tl.sum(b_s * b_q[:, None], 0) * scale
        tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_HT:
        tl.store(ht + p_s, b_s, mask=m_kv)


# --------------------------------------------------------------------------------------------
# one decoding step of a whole token mixer: short convolutions, activations, gates, the state
# update and the output norm, in place on the cache's slots
# --------------------------------------------------------------------------------------------
@triton.jit
def _shifted_history(x_row, p_hist, m_c, o_w, W: tl.constexpr):
    """A short convolution's history ``[BC, BW]`` at ``p_hist`` (oldest first) with ``x_row`` pushed in."""
    older = tl.load(p_hist + 1, mask=m_c[:, None] & (o_w[None, :] + 1 < W), other=0.0).to(tl.float32)
    return tl.where(o_w[None, :] == W - 1, x_row[:, None], older)


@triton.jit
def _conv_step(
    x_row,
    pool,
    row_base,
    o_c,
    m_c,
    weight,
    bias,
    o_w,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    PUSH: tl.constexpr,
):
    """The short convolution's output for ``x_row [BC]`` (SiLU'd if asked) after its history
    (``pool + row_base``, ``[C, W]`` row-major, oldest first); ``PUSH``: ``x_row`` also goes into
    that history, in place."""
    m_cw = m_c[:, None] & (o_w[None, :] < W)
    p_hist = pool + row_base + o_c[:, None] * W + o_w[None, :]
    hist = _shifted_history(x_row, p_hist, m_c, o_w, W)
    if PUSH:
        tl.store(p_hist, hist.to(pool.dtype.element_ty), mask=m_cw)
    b_w = tl.load(weight + o_c[:, None] * W + o_w[None, :], mask=m_cw, other=0.0).to(tl.float32)
    y = tl.sum(hist * b_w, 1)
    if HAS_BIAS:
        y += tl.load(bias + o_c, mask=m_c, other=0.0).to(tl.float32)
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    return y


@triton.jit
def _push_history(x_row, pool, row_base, o_c, m_c, o_w, W: tl.constexpr):
    """``_conv_step``'s push alone."""
    p_hist = pool + row_base + o_c[:, None] * W + o_w[None, :]
    hist = _shifted_history(x_row, p_hist, m_c, o_w, W)
    tl.store(p_hist, hist.to(pool.dtype.element_ty), mask=m_c[:, None] & (o_w[None, :] < W))


@triton.jit
def _norm_gate(b_o, o_v, m_v, norm_w, xg, row_g, V: tl.constexpr, norm_eps, OUT_GATE: tl.constexpr):
    """RMS-normalise a value head's output ``b_o [BV]`` over its ``V`` values (and gate it)."""
    b_o = tl.where(m_v, b_o, 0.0)
    b_o = b_o * tl.rsqrt(tl.sum(b_o * b_o) / V + norm_eps) * tl.load(norm_w + o_v, mask=m_v, other=0.0).to(tl.float32)
    if OUT_GATE > 0:
        b_gate = tl.load(xg + row_g + o_v, mask=m_v, other=0.0).to(tl.float32)
        if OUT_GATE == 1:
            b_o = b_o * (b_gate / (1.0 + tl.exp(-b_gate)))
        else:
            b_o = b_o / (1.0 + tl.exp(-b_gate))
    return b_o


@triton.jit
def decode_step_kernel(
    xq,
    xk,
    xv,
    xb,
    xa,
    xg,
    sxq,
    sxk,
    sxv,
    sxb,
    sxa,
    sxg,
    wq,
    wk,
    wv,
    bq,
    bk,
    bv,
    cq,
    ck,
    cv,
    state,
    slots,
    A_log,
    dt_bias,
    norm_w,
    out,
    scale,
    norm_eps,
    l2_eps,
    H: tl.constexpr,
    G: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    W: tl.constexpr,
    BW: tl.constexpr,
    EXACT: tl.constexpr,
    GATED: tl.constexpr,
    HAS_CONV: tl.constexpr,
    HAS_CONV_BIAS: tl.constexpr,
    QK_SILU: tl.constexpr,
    USE_BETA: tl.constexpr,
    BETA_SCALE: tl.constexpr,
    K_L2: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    OUT_GATE: tl.constexpr,
    G_MIN: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """One program per (row, q/k head, block of ``BV`` value columns): its ``G`` value heads one
    after the other, so every state block and value-convolution channel has one writer. Whole
    value heads (not ``SPLIT``): the program also pushes the q/k convolution histories and writes
    the normalised output; ``SPLIT``: it writes the raw float32 output to ``out`` and leaves the
    pushes and the norm to ``decode_norm_kernel`` (the q/k histories are read by every block)."""
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n64 = i_n.to(tl.int64)
    slot = tl.load(slots + i_n).to(tl.int64) if HAS_SLOTS else i_n64
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_w = tl.arange(0, BW)
    m_k = o_k < K
    m_v = o_v < V
    HK: tl.constexpr = H * K
    HVV: tl.constexpr = H * G * V
    b_q = tl.load(xq + i_n64 * sxq + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(xk + i_n64 * sxk + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    if HAS_CONV:
        b_q = _conv_step(b_q, cq, slot * HK * W, i_h * K + o_k, m_k, wq, bq, o_w, W, HAS_CONV_BIAS, QK_SILU, not SPLIT)
        b_k = _conv_step(b_k, ck, slot * HK * W, i_h * K + o_k, m_k, wk, bk, o_w, W, HAS_CONV_BIAS, QK_SILU, not SPLIT)
    elif QK_SILU:
        b_q = b_q / (1.0 + tl.exp(-b_q))
        b_k = b_k / (1.0 + tl.exp(-b_k))
    b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + l2_eps) * scale
    if K_L2:
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + l2_eps)
    for j in range(G):
        i_hv = i_h * G + j
        b_v = tl.load(xv + i_n64 * sxv + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        if HAS_CONV:
            b_v = _conv_step(b_v, cv, slot * HVV * W, i_hv * V + o_v, m_v, wv, bv, o_w, W, HAS_CONV_BIAS, True, True)
        else:
            b_v = b_v / (1.0 + tl.exp(-b_v))
        if USE_BETA:
            b_b = tl.load(xb + i_n64 * sxb + i_hv).to(tl.float32)
            b_b = BETA_SCALE / (1.0 + tl.exp(-b_b))
        else:
            b_b = BETA_SCALE
        b_g = 0.0
        if GATED:
            b_a = tl.load(xa + i_n64 * sxa + i_hv).to(tl.float32)
            b_g = -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * _softplus(b_a + tl.load(dt_bias + i_hv).to(tl.float32))
        p_s = state + ((slot * H * G + i_hv) * K + o_k[:, None]) * V + o_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        b_s = tl.load(p_s, mask=m_kv, other=0.0)
        b_s = _delta_step(b_s, b_k, b_v, b_b, b_g, EXACT, GATED, G_MIN)
        tl.store(p_s, b_s, mask=m_kv)
        b_o = tl.sum(b_s * b_q[:, None], 0)
        if not SPLIT:
            b_o = _norm_gate(b_o, o_v, m_v, norm_w, xg, i_n64 * sxg + i_hv * V, V, norm_eps, OUT_GATE)
        tl.store(out + i_n64 * HVV + i_hv * V + o_v, b_o.to(out.dtype.element_ty), mask=m_v)


@triton.jit
def decode_norm_kernel(
    raw,
    xq,
    xk,
    xg,
    sxq,
    sxk,
    sxg,
    cq,
    ck,
    slots,
    norm_w,
    out,
    norm_eps,
    H: tl.constexpr,
    G: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    W: tl.constexpr,
    BW: tl.constexpr,
    HAS_CONV: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    OUT_GATE: tl.constexpr,
):
    """The rest of a ``SPLIT`` decoding step, one program per (row, q/k head): the output norm (and
    gate) of its ``G`` value heads and the push of its q/k convolution histories."""
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    i_n64 = i_n.to(tl.int64)
    o_v = tl.arange(0, BV)
    m_v = o_v < V
    HVV: tl.constexpr = H * G * V
    for j in range(G):
        i_hv = i_h * G + j
        b_o = tl.load(raw + i_n64 * HVV + i_hv * V + o_v, mask=m_v, other=0.0)
        b_o = _norm_gate(b_o, o_v, m_v, norm_w, xg, i_n64 * sxg + i_hv * V, V, norm_eps, OUT_GATE)
        tl.store(out + i_n64 * HVV + i_hv * V + o_v, b_o.to(out.dtype.element_ty), mask=m_v)
    if HAS_CONV:
        slot = tl.load(slots + i_n).to(tl.int64) if HAS_SLOTS else i_n64
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        o_w = tl.arange(0, BW)
        HK: tl.constexpr = H * K
        b_q = tl.load(xq + i_n64 * sxq + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(xk + i_n64 * sxk + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        _push_history(b_q, cq, slot * HK * W, i_h * K + o_k, m_k, o_w, W)
        _push_history(b_k, ck, slot * HK * W, i_h * K + o_k, m_k, o_w, W)
