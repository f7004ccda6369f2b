"""Triton kernels of the GPU path (our own; imported only when a CUDA tensor arrives).

* ``coef_fwd_kernel`` / ``coef_bwd_kernel``: per (token, head) row, the exact-flow coefficients
  from ``(k, beta[, g])`` and, backwards, the chain rule from the coefficients' gradients back to
  ``k`` (in place on the chunk kernel's ``dk``), ``beta``, ``g`` and ``v``. One pass each.
* ``gated_dqkwg_kernel``: the one gated backward piece that flash-linear-attention refuses on
  Hopper with Triton < 3.7.1 (its kernel transposes a matrix-unit result, which those Triton
  versions miscompile on sm_90); ours forms the transposed score block by its own product
  instead, so no matrix-unit result is ever transposed.

The token-at-a-time kernels (the recurrent scan and the fused decoding step) are in
``step_kernels.py``.

Math, with ``phi(x) = (1 - e^-x)/x`` and ``lambda = ||k||^2``:
EFLA ``alpha = beta phi(beta lambda)``; Gated EFLA with ``a = e^g``, ``rho = a beta``,
``x1 = rho lambda``: decay log ``expm1(g)``, erase ``c = rho phi(x1)``, write
``w = beta phi(eta)`` with ``eta = -expm1(g) + x1``.
The chunk kernels get erase ``c`` as their ``beta`` and ``v * (w / c)`` as their value;
``w / c = phi(eta) / (a phi(x1))`` is finite (no 0/0).
"""

from __future__ import annotations

import inspect

import triton
import triton.language as tl

from efla import environment

# rho uses exp(max(g, G_FLOOR)): keeps w/c = phi(eta)/(a phi(x1)) finite in float32/bf16 when a
# underflows. For g < G_FLOOR the erase is ~1e-26 either way (numerically nil).
G_FLOOR = -60.0


def autotune_kwargs() -> dict:
    """Keep autotuning results on disk where this Triton can (as flash-linear-attention does)."""

    return {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


def tunable(configs: list) -> list:
    """``configs``, or only the first under Triton's CPU interpreter (there is no GPU to time them on;
    every setting computes the same result)."""
    return configs[:1] if environment.get("TRITON_INTERPRET") else configs


FLOAT32_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _phi(x):
    """(1 - exp(-x)) / x, phi(0) = 1; series for |x| < 0.1 (truncation ~x^5/720)."""
    small = tl.abs(x) < 0.1
    xs = tl.where(small, 1.0, x)
    big = (1.0 - tl.exp(-xs)) / xs
    ser = 1.0 - x * (0.5 - x * (1.0 / 6.0 - x * (1.0 / 24.0 - x * (1.0 / 120.0))))
    return tl.where(small, ser, big)


@triton.jit
def _one_minus_exp_neg(x):
    """1 - exp(-x) = x phi(x), x >= 0, also for x = Inf (where x phi(x) would be Inf * 0)."""
    return tl.where(x < 0.1, x * _phi(x), 1.0 - tl.exp(-x))


@triton.jit
def _expm1(x):
    small = tl.abs(x) < 0.1
    ser = x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0)))))
    return tl.where(small, ser, tl.exp(x) - 1.0)


@triton.jit
def _softplus(x):
    """log(1 + e^x) = max(x, 0) + log1p(e^-|x|) without overflow, to a few ulps: log1p(e) by its
    series below e = 0.1 (truncation below 1e-9 relative), where log(1 + e) would lose e's digits
    to the rounding of 1 + e (and to a fast log's absolute error)."""
    e = tl.exp(-tl.abs(x))
    series = e * (1.0 - e * (0.5 - e * (1.0 / 3 - e * (0.25 - e * (0.2 - e * (1.0 / 6 - e * (1.0 / 7 - e * 0.125)))))))
    log1p_e = tl.where(e < 0.1, series, tl.log(1.0 + e))
    return tl.maximum(x, 0.0) + log1p_e


@triton.jit
def _raw_gate_inputs(
    g, beta, A_log, dt_bias, i_r, m_r, H, GATE_ACT: tl.constexpr, HAS_DT_BIAS: tl.constexpr, BETA_SCALE: tl.constexpr
):
    """Rows' ``(g, beta, x, sigmoid(beta logit), exp(A_log))`` in float32 from what the op was given:
    with ``GATE_ACT`` ``g`` is the raw decay input (``x = g + dt_bias``, log-gate
    ``-exp(A_log) softplus(x)``), with ``BETA_SCALE > 0`` ``beta`` is a logit (step
    ``BETA_SCALE * sigmoid``); otherwise they are taken as given (x, sigmoid and exp(A_log) unused)."""
    b_beta = tl.load(beta + i_r, mask=m_r, other=0.0).to(tl.float32)
    b_sig = tl.sigmoid(b_beta)
    if BETA_SCALE > 0:
        b_beta = BETA_SCALE * b_sig
    b_g = tl.load(g + i_r, mask=m_r, other=0.0).to(tl.float32)
    b_x = b_g
    b_A = tl.zeros_like(b_g)
    if GATE_ACT:
        i_h = i_r % H
        if HAS_DT_BIAS:
            b_x = b_g + tl.load(dt_bias + i_h, mask=m_r, other=0.0).to(tl.float32)
        b_A = tl.exp(tl.load(A_log + i_h, mask=m_r, other=0.0).to(tl.float32))
        b_g = -b_A * _softplus(b_x)
    return b_g, b_beta, b_x, b_sig, b_A


# float64 helpers of the coefficient backward. Its gradients feed d alpha / d beta = exp(-beta
# lambda), whose condition number is beta * lambda (up to 87 where the value is a normal float32):
# lambda and beta * lambda formed in float32 alone would cost that factor times 6e-8, so the row
# scalars are float64 (O(K) flops per row against O(K) loads: free on data-centre GPUs). Every
# formula below avoids cancelling terms; below x = 1e-3 a closed form hands over to its series.


@triton.jit
def _expm1_64(x):
    """exp(x) - 1 to a few ulps for any x (Kahan: (u - 1) x / log u corrects exp's rounding)."""
    u = tl.exp(x)
    um1 = u - 1.0
    same = um1 == 0.0
    log_u = tl.where(same, 1.0, tl.log(tl.where(same, 2.0, u)))
    kahan = tl.where(same, x, um1 * x / log_u)
    return tl.where(tl.abs(x) > 1.0, um1, kahan)  # beyond 1, u - 1 does not cancel


@triton.jit
def _phi_q_dq64(x):
    """For x >= 0: phi(x), q(x) = phi'/phi = 1 / expm1(x) - 1 / x (in [-1/2, 0)) and
    q'(x) = 1 / x^2 - exp(x) / expm1(x)^2 (in (0, 1/12]), each from one pair expm1(-x), expm1(x),
    which are returned too (taken at 1 where x < 1e-3, where the three hand over to their series)."""
    small = x < 1e-3
    xs = tl.where(small, 1.0, x)
    em_neg = _expm1_64(-xs)
    em_pos = _expm1_64(xs)
    inv_x = 1.0 / xs
    inv_em = 1.0 / em_pos
    phi = tl.where(small, 1.0 - x * (0.5 - x * (1.0 / 6.0)), -em_neg * inv_x)
    q = tl.where(small, -0.5 + x * (1.0 / 12.0 - x * x * (1.0 / 720.0)), inv_em - inv_x)
    dq = tl.where(small, 1.0 / 12.0 - x * x * (1.0 / 240.0), inv_x * inv_x + inv_em / em_neg)
    return phi, q, dq, em_neg, em_pos


@triton.jit
def _q_step64(x1, delta, q1, dq1, em_neg1, q_eta, dq_eta, em_pos_eta):
    """q(x1 + delta) - q(x1) for x1, delta >= 0 without cancellation, from what ``_phi_q_dq64``
    gave at both ends: the trapezoid rule for tiny delta (relative error about delta^2 / 12 times
    the ratio of q's third derivative to its first, < 1e-8), the exact two-term form for x1 >= 1
    (its terms differ by a factor >= 1.08), plain subtraction otherwise (there delta > 1e-4 and
    |q| <= 1/2)."""
    eta = x1 + delta
    trapezoid = delta * 0.5 * (dq1 + dq_eta)
    two_term = delta / (eta * x1) - _expm1_64(delta) / (em_pos_eta * -em_neg1)
    plain = q_eta - q1
    return tl.where(delta <= 1e-4, trapezoid, tl.where(x1 >= 1.0, two_term, plain))


# --------------------------------------------------------------------------------------------
# coefficients: forward
# --------------------------------------------------------------------------------------------
@triton.jit
def coef_fwd_kernel(
    k,
    v,
    beta,
    g,  # inputs: k [R, K], v [R, V] (gated only), beta [R], g [R] (gated only)
    A_log,
    dt_bias,  # [H]: with GATE_ACT, g is the decay's raw input (see _raw_gate_inputs)
    erase,
    gl,
    vout,  # outputs: erase [R] f32; gated: gl [R] f32 = expm1(g), vout [R, V]
    overflow,  # FLAG: int32 [1], set to 1 where a key's ||k||^2 overflows float32 (else untouched)
    q,
    q_out,
    q_rstd,  # QNORM: q [R, K] in, q / ||q|| [R, K] and 1 / ||q|| [R] f32 out (fla's l2norm, eps Q_EPS)
    R,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BR: tl.constexpr,
    GATED: tl.constexpr,
    G_MIN: tl.constexpr,
    FLAG: tl.constexpr,
    GATE_ACT: tl.constexpr = False,
    HAS_DT_BIAS: tl.constexpr = False,
    BETA_SCALE: tl.constexpr = 0.0,
    QNORM: tl.constexpr = False,
    Q_EPS: tl.constexpr = 1e-6,
):
    i_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = i_r < R
    o_k = tl.arange(0, BK)
    m_k = m_r[:, None] & (o_k < K)[None, :]
    b_k = tl.load(k + i_r[:, None] * K + o_k[None, :], mask=m_k, other=0.0).to(tl.float32)
    lam = tl.sum(b_k * b_k, 1)
    if QNORM:
        b_q = tl.load(q + i_r[:, None] * K + o_k[None, :], mask=m_k, other=0.0).to(tl.float32)
        r_q = 1.0 / tl.sqrt(tl.sum(b_q * b_q, 1) + Q_EPS)
        tl.store(q_out + i_r[:, None] * K + o_k[None, :], (b_q * r_q[:, None]).to(q_out.dtype.element_ty), mask=m_k)
        tl.store(q_rstd + i_r, r_q, mask=m_r)
    if FLAG:
        n_over = tl.sum((m_r & (lam > FLOAT32_MAX)).to(tl.int32), 0)
        tl.atomic_max(overflow, 1, mask=n_over > 0)
    if GATED:
        b_g, b_beta, _, _, _ = _raw_gate_inputs(g, beta, A_log, dt_bias, i_r, m_r, H, GATE_ACT, HAS_DT_BIAS, BETA_SCALE)
        a_c = tl.exp(tl.maximum(b_g, G_MIN))
        rho = a_c * b_beta
        x1 = rho * lam
        p1 = _phi(x1)
        b_c = rho * p1
        b_gl = _expm1(b_g)
        eta = x1 - b_gl
        r = _phi(eta) / (a_c * p1)
        tl.store(erase + i_r, b_c, mask=m_r)
        tl.store(gl + i_r, b_gl, mask=m_r)
        o_v = tl.arange(0, BV)
        m_v = m_r[:, None] & (o_v < V)[None, :]
        b_v = tl.load(v + i_r[:, None] * V + o_v[None, :], mask=m_v, other=0.0).to(tl.float32)
        tl.store(vout + i_r[:, None] * V + o_v[None, :], (b_v * r[:, None]).to(vout.dtype.element_ty), mask=m_v)
    else:
        b_beta = tl.load(beta + i_r, mask=m_r, other=0.0).to(tl.float32)
        tl.store(erase + i_r, b_beta * _phi(b_beta * lam), mask=m_r)


# --------------------------------------------------------------------------------------------
# coefficients: backward (chain rule; dk updated in place)
# --------------------------------------------------------------------------------------------
# (rows per program BR, columns per block BC, warps). Every thread that holds part of a row computes
# that row's float64 scalar chain (about 15 divisions, 8 exp/log pairs for the gated rule), so the
# settings that matter put one or two threads on a row: BC = 8 or 16 columns (one 16-byte vector per
# thread), rows over the threads. Whole-row blocks spread a row over 16 threads: on an H200 at
# K = V = 128 the gated backward then took 0.59 ms at its best (8 rows, 4 warps) and 1.6 ms at 64
# rows and 2 warps, against 0.14 ms for the plain one (autotuner timings, restoring dk included).
# Register counts from ptxas for sm_90 (no spills at BC <= 16): 48-64 plain, 80-104 gated.
COEF_BWD_CONFIGS = [
    triton.Config({"BR": br, "BC": bc}, num_warps=w)
    for br, bc, w in ((128, 8, 4), (64, 8, 2), (256, 8, 8), (64, 16, 4), (128, 16, 8), (32, 32, 4), (64, 128, 2), (8, 128, 4))
]


@triton.autotune(
    configs=tunable(COEF_BWD_CONFIGS),
    key=["K", "V", "GATED", "GATE_ACT", "BETA_SCALE", "QNORM"],
    restore_value=["dk", "dq"],
    **autotune_kwargs(),
)
@triton.jit(do_not_specialize=["R"])
def coef_bwd_kernel(
    k,
    v,
    beta,
    g,  # inputs as in the forward
    A_log,
    dt_bias,  # as in the forward (GATE_ACT)
    derase,
    dgl,
    dvin,  # grads of erase [R] (the erase's dtype), of gl [R] f32 (gated), of vout [R, V] (gated)
    dk,  # [R, K]: grad of k from the chunk kernels; updated in place
    dk_more,  # [R, K]: a second part of that grad, added in the same pass (HAS_DK_MORE)
    dbeta,
    dg,
    dv,  # outputs: dbeta [R], dg [R] (gated), dv [R, V] (gated; may alias dvin)
    dgate,  # GATE_ACT: [2, R] f32, each row's part of the grads of A_log (first R) and dt_bias (last R)
    q,
    q_rstd,
    dq,  # QNORM: the forward's q / ||q|| [R, K] and 1 / ||q|| [R]; dq [R, K], chained back in place
    R,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    GATED: tl.constexpr,
    G_MIN: tl.constexpr,
    HAS_DK_MORE: tl.constexpr,
    GATE_ACT: tl.constexpr = False,
    HAS_DT_BIAS: tl.constexpr = False,
    BETA_SCALE: tl.constexpr = 0.0,
    QNORM: tl.constexpr = False,
):
    i_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = i_r < R
    lam = tl.zeros([BR], dtype=tl.float64)
    dq_dot_q = tl.zeros([BR], dtype=tl.float32)
    for c in range(0, K, BC):
        o_c = c + tl.arange(0, BC)
        m_c = m_r[:, None] & (o_c < K)[None, :]
        b_k = tl.load(k + i_r[:, None] * K + o_c[None, :], mask=m_c, other=0.0).to(tl.float32).to(tl.float64)
        lam += tl.sum(b_k * b_k, 1)
        if QNORM:
            b_q = tl.load(q + i_r[:, None] * K + o_c[None, :], mask=m_c, other=0.0).to(tl.float32)
            b_dq = tl.load(dq + i_r[:, None] * K + o_c[None, :], mask=m_c, other=0.0).to(tl.float32)
            dq_dot_q += tl.sum(b_dq * b_q, 1)
    # bf16 <-> float64 conversions go through float32 here: Triton's CPU interpreter, which the tests
    # run this kernel on, turns bf16 results of float64 values into zeros and NaNs
    b_de = tl.load(derase + i_r, mask=m_r, other=0.0).to(tl.float32).to(tl.float64)
    if GATED:
        # erase c = (1 - e^-x1) / lam (x1 = rho lam, rho = a_c beta); value v' = v r with
        # r = w / c = phi(eta) / (a_c phi(x1)), eta = x1 + delta, delta = -expm1(g). The gradients of
        # log r are differences q(eta) - q(x1) of q = phi'/phi, taken by _q_step64 (no cancellation).
        g32, beta32, b_x, b_sig, b_A = _raw_gate_inputs(g, beta, A_log, dt_bias, i_r, m_r, H, GATE_ACT, HAS_DT_BIAS, BETA_SCALE)
        b_beta = beta32.to(tl.float64)
        b_g = g32.to(tl.float64)
        s_g = tl.where(b_g > G_MIN, 1.0, 0.0)  # d a_c / dg = s_g * a_c
        a = tl.exp(b_g)
        a_c = tl.exp(tl.maximum(b_g, G_MIN))
        delta = -_expm1_64(b_g)
        rho = a_c * b_beta
        x1 = rho * lam
        p1, q1, dq1, em_neg1, _ = _phi_q_dq64(x1)
        p_eta, q_eta, dq_eta, _, em_pos_eta = _phi_q_dq64(x1 + delta)
        r = p_eta / (a_c * p1)
        r32 = r.to(tl.float32)
        b_dr = tl.zeros([BR], dtype=tl.float64)  # d loss / d r = sum(dvin * v)
        for c in range(0, V, BC):
            o_c = c + tl.arange(0, BC)
            m_c = m_r[:, None] & (o_c < V)[None, :]
            b_v = tl.load(v + i_r[:, None] * V + o_c[None, :], mask=m_c, other=0.0).to(tl.float32)
            b_dvi = tl.load(dvin + i_r[:, None] * V + o_c[None, :], mask=m_c, other=0.0).to(tl.float32)
            b_dr += tl.sum(b_dvi.to(tl.float64) * b_v.to(tl.float64), 1)
            tl.store(dv + i_r[:, None] * V + o_c[None, :], (b_dvi * r32[:, None]).to(dv.dtype.element_ty), mask=m_c)
        ex1 = tl.exp(-x1)
        q_step = _q_step64(x1, delta, q1, dq1, em_neg1, q_eta, dq_eta, em_pos_eta)
        dr_scale = b_dr * r
        d_beta = b_de * a_c * ex1 + dr_scale * a_c * lam * q_step
        d_lam = b_de * rho * rho * q1 * p1 + dr_scale * rho * q_step
        dgl_in = tl.load(dgl + i_r, mask=m_r, other=0.0).to(tl.float32).to(tl.float64)
        d_g = b_de * s_g * rho * ex1 + dr_scale * (s_g * x1 * q_step - a * q_eta - s_g) + dgl_in * a
        if GATE_ACT:  # g = -A softplus(x), A = exp(A_log): dg/dx = -A sigmoid(x), dg/dA_log = g
            d_x = d_g * (-b_A * tl.sigmoid(b_x)).to(tl.float64)
            tl.store(dgate + i_r, (d_g * b_g).to(tl.float32), mask=m_r)
            tl.store(dgate + R + i_r, d_x.to(tl.float32), mask=m_r)
            d_g = d_x
        if BETA_SCALE > 0:  # beta = BETA_SCALE sigmoid(logit)
            d_beta = d_beta * (BETA_SCALE * b_sig * (1.0 - b_sig)).to(tl.float64)
        tl.store(dg + i_r, d_g.to(tl.float32).to(dg.dtype.element_ty), mask=m_r)
    else:
        b_beta = tl.load(beta + i_r, mask=m_r, other=0.0).to(tl.float32).to(tl.float64)
        # alpha = (1 - e^-x) / lam, x = beta lam: d alpha / d beta = e^-x, d alpha / d lam = beta^2 phi'(x)
        x = b_beta * lam
        d_beta = b_de * tl.exp(-x)
        phi, q_x, _, _, _ = _phi_q_dq64(x)
        d_lam = b_de * b_beta * b_beta * q_x * phi
    tl.store(dbeta + i_r, d_beta.to(tl.float32).to(dbeta.dtype.element_ty), mask=m_r)
    two_d_lam = (2.0 * d_lam).to(tl.float32)
    if QNORM:
        r_q = tl.load(q_rstd + i_r, mask=m_r, other=0.0).to(tl.float32)
    for c in range(0, K, BC):
        o_c = c + tl.arange(0, BC)
        m_c = m_r[:, None] & (o_c < K)[None, :]
        b_k = tl.load(k + i_r[:, None] * K + o_c[None, :], mask=m_c, other=0.0).to(tl.float32)
        p_dk = dk + i_r[:, None] * K + o_c[None, :]
        b_dk = tl.load(p_dk, mask=m_c, other=0.0).to(tl.float32) + two_d_lam[:, None] * b_k
        if HAS_DK_MORE:
            b_dk += tl.load(dk_more + i_r[:, None] * K + o_c[None, :], mask=m_c, other=0.0).to(tl.float32)
        tl.store(p_dk, b_dk.to(p_dk.dtype.element_ty), mask=m_c)
        if QNORM:  # fla's l2norm backward: (dq - (dq . q_n) q_n) / ||q||
            b_q = tl.load(q + i_r[:, None] * K + o_c[None, :], mask=m_c, other=0.0).to(tl.float32)
            p_dq = dq + i_r[:, None] * K + o_c[None, :]
            b_dq = tl.load(p_dq, mask=m_c, other=0.0).to(tl.float32)
            b_dq = (b_dq - dq_dot_q[:, None] * b_q) * r_q[:, None]
            tl.store(p_dq, b_dq.to(p_dq.dtype.element_ty), mask=m_c)


# --------------------------------------------------------------------------------------------
# gated chunk backward: dq, dk, dw, dg of one chunk (replaces the piece fla refuses on Hopper)
# --------------------------------------------------------------------------------------------
# Launch settings chosen per (H, K, V) on the first call. Measured on an H200 at K = V = 128: 0.33 ms
# with 8 warps, 3 stages against 0.52 ms for the single fixed setting of earlier versions (4 warps,
# 2 stages); 2 warps took 8-11 ms (the [64, 128] float32 accumulators spill) and are left out.
DQKWG_CONFIGS = [triton.Config({"BV": bv}, num_warps=w, num_stages=s) for bv in (64, 128) for w in (4, 8) for s in (2, 3)]


def dqkwg_configs(V: int, configs=DQKWG_CONFIGS) -> list:
    """``configs`` with value blocks no wider than the value head (the largest power of two <= V, at
    least 16), duplicates dropped. At V = 32 autotuning crashed the H200 with an illegal memory access
    while blocks of 64 and 128 columns were among the settings; every access in the kernel is masked,
    so which setting faulted and why is not known yet (``benchmarks/gpu_launch_faults.py`` finds out):
    no setting wider than the head is tried."""
    fitted = {}
    widest = max(16, 1 << (V.bit_length() - 1))
    for c in configs:
        bv = min(c.kwargs["BV"], widest)
        fitted.setdefault(
            (bv, c.num_warps, c.num_stages), triton.Config({**c.kwargs, "BV": bv}, num_warps=c.num_warps, num_stages=c.num_stages)
        )
    return list(fitted.values())


def _fit_dqkwg_configs(configs, named_args, **kwargs) -> list:  # noqa: ARG001 (Triton's prune hook signature)
    return dqkwg_configs(kwargs["V"], configs)


@triton.autotune(
    configs=tunable(DQKWG_CONFIGS),
    key=["H", "K", "V", "BT", "BK", "IS_VARLEN"],
    prune_configs_by={"early_config_prune": _fit_dqkwg_configs},
    **autotune_kwargs(),
)
@triton.jit(do_not_specialize=["T", "TOT"])
def gated_dqkwg_kernel(
    q,
    k,
    v,
    g,
    h,
    do,
    dh,
    dv,  # v = v_new [B,T,H,V]; g = chunk-local cumsum (log2) [B,T,H] f32
    dq,
    dk,
    dw,
    dg,  # outputs; dg [NK, B, T, H] f32 (per position, before the reverse cumsum)
    cu_seqlens,
    chunk_indices,
    scale,
    T,
    TOT,  # TOT = B * T (all tokens)
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    NTOT = tl.num_programs(1)
    if IS_VARLEN:
        i_tg = i_t.to(tl.int64)
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
        i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        T = (eos - bos).to(tl.int32)
    else:
        i_tg = (i_b * NTOT + i_t).to(tl.int64)
        bos = i_b.to(tl.int64) * T
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    last = tl.minimum(i_t * BT + BT, T) - 1

    h += (i_tg * H + i_h) * K * V
    dh += (i_tg * H + i_h) * K * V
    row_v = (bos + o_t) * H * V + i_h * V  # [BT]
    row_k = (bos + o_t) * H * K + i_h * K

    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)  # ds[i, j]  = do_i . v_j
    b_dst = tl.zeros([BT, BT], dtype=tl.float32)  # dst[j, i] = v_j . do_i (formed directly)
    b_dgl = tl.zeros([1], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        b_v = tl.load(v + row_v[:, None] + o_v[None, :], mask=m_tv, other=0.0)
        b_do = tl.load(do + row_v[:, None] + o_v[None, :], mask=m_tv, other=0.0)
        b_dvv = tl.load(dv + row_v[:, None] + o_v[None, :], mask=m_tv, other=0.0)
        m_vk = m_v[:, None] & m_k[None, :]
        # state blocks stored [K, V]; read as [BV, BK]
        b_h = tl.load(h + o_k[None, :] * V + o_v[:, None], mask=m_vk, other=0.0)
        b_dh = tl.load(dh + o_k[None, :] * V + o_v[:, None], mask=m_vk, other=0.0)
        b_dgl += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32))
        b_ds = tl.dot(b_do, tl.trans(b_v), b_ds)
        b_dst = tl.dot(b_v, tl.trans(b_do), b_dst)
        b_dq = tl.dot(b_do, b_h.to(b_do.dtype), b_dq)
        b_dk = tl.dot(b_v, b_dh.to(b_v.dtype), b_dk)
        b_dw = tl.dot(b_dvv.to(b_v.dtype), b_h.to(b_v.dtype), b_dw)

    tl.store(dw + row_k[:, None] + o_k[None, :], (-b_dw).to(dw.dtype.element_ty), mask=m_tk)

    b_q = tl.load(q + row_k[:, None] + o_k[None, :], mask=m_tk, other=0.0)
    b_k = tl.load(k + row_k[:, None] + o_k[None, :], mask=m_tk, other=0.0)
    p_g = g + (bos + o_t) * H + i_h
    b_g = tl.load(p_g, mask=m_t, other=0.0)
    b_glast = tl.load(g + (bos + last) * H + i_h)

    b_dgl *= tl.exp2(b_glast)
    b_dq = b_dq * (tl.exp2(b_g) * scale)[:, None]
    b_dk = b_dk * tl.where(m_t, tl.exp2(b_glast - b_g), 0.0)[:, None]
    b_dgl += tl.sum(b_dk * b_k.to(tl.float32))

    o_i = tl.arange(0, BT)
    valid = m_t[:, None] & m_t[None, :]
    # ds[i, j], i >= j: decay exp2(g_i - g_j)
    m_low = (o_i[:, None] >= o_i[None, :]) & valid
    b_ds = tl.where(m_low, b_ds * tl.exp2(b_g[:, None] - b_g[None, :]), 0.0) * scale
    # dst[j, i] = ds[i, j], kept where i >= j, i.e. column index >= row index
    m_up = (o_i[None, :] >= o_i[:, None]) & valid
    b_dst = tl.where(m_up, b_dst * tl.exp2(b_g[None, :] - b_g[:, None]), 0.0) * scale
    b_dq = tl.dot(b_ds.to(b_k.dtype), b_k, b_dq)
    b_dk = tl.dot(b_dst.to(b_q.dtype), b_q, b_dk)

    b_dgv = tl.sum(b_dq * b_q.to(tl.float32), 1) - tl.sum(b_dk * b_k.to(tl.float32), 1)
    b_dgv = tl.where(o_t == last, b_dgv + b_dgl, b_dgv)
    tl.store(dq + row_k[:, None] + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + row_k[:, None] + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)
    # dg: [NK, TOT, H], one partial sum per K block
    tl.store(dg + i_k.to(tl.int64) * TOT * H + (bos + o_t) * H + i_h, b_dgv, mask=m_t)
