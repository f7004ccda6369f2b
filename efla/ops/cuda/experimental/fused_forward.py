"""The chunk forward's state pass and output pass as one kernel (opt-in: ``EFLA_FUSED_FORWARD``).

fla's forward writes every chunk's starting state ``h`` ([B, NT, H, K, V] in the inputs' dtype) and
the new values ``v_new``, and its output kernel reads both back. The backward recomputes them, so
the forward needs neither once the output is formed. Here one program walks one (sequence, head,
value block) through its chunks, holding the state, and forms each chunk's output from it:

    v_new_t = u_t - w_t h_t
    o_t     = scale (Gamma_t q_t h_t + tril(q_t k_t^T Gamma_t / Gamma_t^T) v_new_t)
    h_t+1   = gamma_t h_t + k_t^T (gamma_t / Gamma_t) v_new_t

(``Gamma`` the gate's cumulative decay inside the chunk, ``gamma`` at its last row; no gate: ones.)
``w`` and ``u`` come from fla's kernel. The state and the new values enter the products rounded to
the inputs' dtype, as fla's kernels round them when they store them, so the result is fla's up to
the order of float32 sums.

What it costs: the output's products move onto the chunk-by-chunk walk, which has one program per
(sequence, head, value block), where fla's output kernel has one per chunk besides. It saves the
traffic of ``h`` and ``v_new``, each written once and read once. The backward is unchanged: it
recomputes the state with fla's pass. So it cannot go with ``EFLA_SPLIT_STATE`` (there is no state
pass here to cut into pieces, while the backward's would be cut): ``state_output`` refuses the pair.

On a GPU: its GPU tests passed on an H200 (2026-12-04: the ops against the float64 reference and
against the ops without it; every launch setting against fla's kernels at K x V = 128 x 128, the
64 x 96 and 256 x 256 cases cut off by the call's limit). Timed once, one round
(``docs/performance.md``): faster where the host or the head count sets the pace (EFLA forward
0.91x of the default at [8, 2K, 16] and [1, 8K, 96]), slower where few sequences x heads walk many
chunks (1.13x at [4, 4K, 16] and [1, 16K, 16], Gated EFLA's forward 1.10-1.28x at the three
largest shapes). Decided at the next GPU visit by
``PYTEST_K=fused_forward OPS_ARGS="--skip-decode --skip-model --skip-correctness --rounds 3 --variants
fusedfwd" bash scripts/device.sh optests ops``: the default with a measured dispatch rule (the shapes
where three rounds show it faster), or deleted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from efla import environment

from ..kernels import autotune_kwargs, tunable
from ..launch import launch


# Triton's type of each argument as the chunk ops pass it (bf16 inputs), to compile the kernel ahead
# of time without a GPU (the sm_90 compile test, benchmarks/kernel_resources.py)
ARGUMENT_TYPES = {
    "q": "*bf16",
    "k": "*bf16",
    "w": "*bf16",
    "u": "*bf16",
    "g": "*fp32",
    "o": "*bf16",
    "h0": "*fp32",
    "ht": "*fp32",
    "cu_seqlens": "*i32",
    "scale": "fp32",
    "T": "i32",
}

STATE_ELEMENTS_PER_PROGRAM = 64 * 64  # state held by one program: wider blocks spill on sm_90 (kernel_resources.py)


def _settings_that_hold_their_state(configs, named_args, **kwargs):
    """The settings whose value block keeps the program's state within ``STATE_ELEMENTS_PER_PROGRAM``
    (the narrowest where none does), of 4 or 8 warps (2 spill on sm_90); on Blackwell of 2 warps, as
    fla runs its state pass there (a race in loop-carried products before Triton 3.8)."""
    K = {**named_args, **kwargs}["K"]
    two_warps = _on_blackwell()
    configs = [c for c in configs if (c.num_warps == 2) == two_warps] or configs
    fitting = [c for c in configs if c.kwargs["BV"] * max(triton.next_power_of_2(K), 16) <= STATE_ELEMENTS_PER_PROGRAM]
    return fitting or [min(configs, key=lambda c: c.kwargs["BV"])]


def _on_blackwell() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 10


@triton.heuristics(
    {
        "USE_G": lambda args: args["g"] is not None,
        "USE_INITIAL_STATE": lambda args: args["h0"] is not None,
        "STORE_FINAL_STATE": lambda args: args["ht"] is not None,
        "IS_VARLEN": lambda args: args["cu_seqlens"] is not None,
    }
)
@triton.autotune(
    configs=tunable(
        [
            triton.Config({"BV": bv}, num_warps=warps, num_stages=stages)
            for bv in (32, 64, 16)
            for warps in (4, 8, 2)
            for stages in (2, 3)
        ]
    ),
    key=["H", "K", "V", "BT", "USE_G"],
    prune_configs_by={"early_config_prune": _settings_that_hold_their_state},
    **autotune_kwargs(),
)
@triton.jit(do_not_specialize=["T"])
def state_output_fwd_kernel(
    q,
    k,
    w,
    u,
    g,
    o,
    h0,
    ht,
    cu_seqlens,
    scale,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_G: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # one axis: a grid's second is capped at 65,535 (sequences x heads)
    NV = tl.cdiv(V, BV)
    i_v, i_nh = pid % NV, pid // NV
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        bos = i_n * T
    NT = tl.cdiv(T, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_state = m_k[:, None] & m_v[None, :]
    p_state = i_nh * K * V + o_k[:, None] * V + o_v[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + p_state, mask=m_state, other=0.0).to(tl.float32)

    for i_t in range(NT):
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        rows = bos + o_t
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_k_rows = (rows[:, None] * H + i_h) * K + o_k[None, :]
        p_v_rows = (rows[:, None] * H + i_h) * V + o_v[None, :]
        b_q = tl.load(q + p_k_rows, mask=m_tk, other=0.0)
        b_k = tl.load(k + p_k_rows, mask=m_tk, other=0.0)
        b_kt = tl.trans(b_k)  # [BK, BT]
        if USE_G:
            b_g = tl.load(g + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
            b_g_last = tl.load(g + (bos + tl.minimum((i_t + 1) * BT, T) - 1) * H + i_h).to(tl.float32)
        b_w = tl.load(w + p_k_rows, mask=m_tk, other=0.0)
        b_u = tl.load(u + p_v_rows, mask=m_tv, other=0.0)
        b_h_in = b_h.to(b_w.dtype)

        b_v_new = b_u.to(tl.float32) - tl.dot(b_w, b_h_in)
        b_o = tl.dot(b_q, b_h_in)
        b_qk = tl.dot(b_q, b_kt)
        if USE_G:
            b_o = b_o * tl.exp2(b_g)[:, None]
            b_qk = b_qk * tl.exp2(b_g[:, None] - b_g[None, :])
        b_qk = tl.where((o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :], b_qk, 0.0)
        b_v_stored = b_v_new.to(b_w.dtype)
        b_o = (b_o + tl.dot(b_qk.to(b_w.dtype), b_v_stored)) * scale
        tl.store(o + p_v_rows, b_o.to(o.dtype.element_ty), mask=m_tv)

        if USE_G:
            b_v_stored = (b_v_new * tl.where(m_t, tl.exp2(b_g_last - b_g), 0.0)[:, None]).to(b_w.dtype)
            b_h *= tl.exp2(b_g_last)
        b_h = tl.dot(b_kt, b_v_stored, b_h)

    if STORE_FINAL_STATE:
        tl.store(ht + p_state, b_h.to(ht.dtype.element_ty), mask=m_state)


def state_output(q, k, w, u, g, h0, scale, cu_seqlens, output_final_state):
    """``(o, final state or None)`` of the chunk forward from its WY form ``(w, u)``; ``g`` the gate's
    chunk-local cumsum in base 2, or ``None``. Shapes: ``q``, ``k``, ``w`` ``[B, T, H, K]``, ``u``
    ``[B, T, H, V]``."""
    refuse_split_state()
    B, T, H, K = k.shape
    V = u.shape[-1]
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    o = q.new_empty(B, T, H, V)
    final = k.new_zeros(N, H, K, V, dtype=torch.float32) if output_final_state else None
    launch(
        state_output_fwd_kernel,
        lambda meta: (triton.cdiv(V, meta["BV"]) * N * H,),
        q=q,
        k=k,
        w=w,
        u=u,
        g=g,
        o=o,
        h0=h0,
        ht=final,
        cu_seqlens=cu_seqlens,
        scale=scale,
        T=T,
        H=H,
        K=K,
        V=V,
        BT=64,
        BK=max(triton.next_power_of_2(K), 16),
    )
    return o, final


def refuse_split_state() -> None:
    """Raise where ``EFLA_SPLIT_STATE`` asks for pieces: the forward here has no state pass to cut,
    while the backward's passes would be cut, one switch half applied."""
    pieces = environment.get("EFLA_SPLIT_STATE")
    if pieces > 1:
        raise ValueError(
            f"EFLA_FUSED_FORWARD=1 and EFLA_SPLIT_STATE={pieces} cannot be combined: the fused forward has no "
            "state pass to split, while the backward's would be split; turn one of them off"
        )
