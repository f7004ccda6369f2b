"""Chunkwise GPU path: flash-linear-attention's public delta-rule kernels plus our own kernels.

EFLA is a delta-rule step with ``beta -> alpha``; Gated EFLA is a gated delta-rule step with decay
log ``expm1(g)``, erase ``c`` and value ``v * (w / c)`` (see ``kernels.py``). So the heavy WY/UT
chunk kernels are fla's; ours compute the coefficients (one pass over k, and over v for the gated
rescaling) and, backwards, fold the coefficients' gradients into ``dk`` (in place), ``dbeta``,
``dg`` and ``dv`` in one pass. EFLA keys are raw; the queries' L2 normalisation that EFLA's layers ask
for is done in the same passes (forward and, on ``dq``, backward), not by fla's separate kernels.

The delta-rule forward takes the WY preparation of fla's gated path (``k k^T`` and the triangular
solve in one kernel; fla's own delta-rule forward spends three launches on it), and its backward runs
fla's delta-rule stages one by one so that the keys' gradient through the WY form is added in our
coefficient pass rather than by a pass of its own. The fused solve merges its blocks in TF32 where
the GPU has it (fla's separate solve in full float32), well inside bf16's rounding (the GPU tests'
float64 comparisons); the Euler DeltaNet runs fla's own function in eager mode, these stages under
``torch.compile``.

fla's kernels are launched by the stage functions of ``stages.py`` (fla's own wrappers would add
their dispatch Python to every launch), ours and theirs through ``launch.py``. The stages
(``delta_fwd`` / ``delta_bwd``, ``gated_fwd`` / ``gated_bwd``) run eagerly through the autograd
Functions below and under ``torch.compile`` through the custom ops of ``custom_ops.py``.

Gated backward: fla's ``chunk_gated_delta_rule`` refuses to run its backward on Hopper with
Triton in [3.4.0, 3.7.1) because one kernel (``chunk_bwd_dqkwg`` with a gate) is miscompiled
there (a transpose of a matrix-unit result). We therefore compose the gated backward from fla's
other stages and our own ``gated_dqkwg_kernel`` for that stage.
"""

from __future__ import annotations

import threading

import torch
import triton

from efla import environment

from ..gates import RawGates
from ..validate import key_energy_error
from . import kernels as kn
from . import stages as st
from .launch import launch as launch_kernel
from .key_checks import check_flag_later, defer_key_check, key_checks_enabled, raise_earlier_overflows, read_each_call, reset_flag

CHUNK = 64
COEF_DTYPE = {torch.bfloat16: torch.bfloat16}


def _fla():
    """fla's functions that the op calls as they are (flash-linear-attention==0.6.0), or raise; its
    chunk kernels are launched by ``stages.py``."""
    from fla.modules.l2norm import l2norm, l2norm_bwd, l2norm_fwd
    from fla.ops.utils.index import prepare_chunk_indices

    st.kernels()  # every kernel imports, or fla counts as absent
    return dict(prepare_chunk_indices=prepare_chunk_indices, l2norm=l2norm, l2norm_fwd=l2norm_fwd, l2norm_bwd=l2norm_bwd)


FLA = None  # flash-linear-attention's functions by name, filled by load()


def load():
    global FLA
    if FLA is None:
        FLA = _fla()
    return FLA


# ------------------------------------------------------------------ coefficient launches
def _rows_cfg(K, V):
    BK = triton.next_power_of_2(K)
    BV = triton.next_power_of_2(V)
    width = max(BK, BV)
    BR = max(1, min(64, 4096 // width))
    return BK, BV, BR, (4 if width <= 128 else 8)


def _gate_launch_args(gates) -> tuple[tuple, dict]:
    """The coefficient kernels' ``(A_log, dt_bias)`` and constants for raw gates (``efla.ops.gates``)."""
    if gates is None:
        return (None, None), {}
    # the kernels index the parameters as flat arrays; a strided or expanded one is copied (autograd
    # gives the copy's gradient back to it)
    params = tuple(x.contiguous() if x is not None else None for x in (gates.A_log, gates.dt_bias))
    consts = dict(GATE_ACT=gates.gate_in_kernel, HAS_DT_BIAS=gates.dt_bias is not None, BETA_SCALE=float(gates.beta_scale or 0.0))
    return params, consts


def coef_fwd(k, beta, g=None, v=None, launch=None, overflow=None, gates=None, q=None):
    """EFLA: alpha [B,T,H] f32. Gated: (c f32, gl f32, v' like v). ``launch``: ``(BR, num_warps)``
    instead of the default rows per program and warps (benchmarks compare them). ``overflow``: an
    int32 tensor of one element, set to 1 when a key's ``||k||^2`` overflows float32. ``gates``
    (gated only): ``g`` and ``beta`` are raw, activated in the kernel. ``q``: also L2-normalise the
    queries in the same pass (fla's ``l2norm_fwd``); the result is then ``(coefficients, q_normed,
    q_rstd)``."""
    B, T, H, K = k.shape
    R = B * T * H
    V = v.shape[-1] if v is not None else K
    BK, BV, BR, nw = _rows_cfg(K, V)
    BR, nw = launch or (BR, nw)
    # bf16 inputs: the coefficient is stored in bf16, exactly like fla DeltaNet's beta (same kernel
    # specialisations, no extra autotuning); fp16 keeps float32 (alpha ~ 1/lambda underflows fp16).
    erase = torch.empty(B, T, H, device=k.device, dtype=COEF_DTYPE.get(k.dtype, torch.float32))
    gated = g is not None
    gl = torch.empty(B, T, H, device=k.device, dtype=torch.float32) if gated else None  # gate cumsum in float32
    vout = torch.empty_like(v) if gated else None
    gate_params, gate_consts = _gate_launch_args(gates)
    if q is not None:  # read and written as rows of K like k
        if q.shape != k.shape:
            raise ValueError(f"q: expected shape {tuple(k.shape)} (as k), got {tuple(q.shape)}")
        q = q.contiguous()
    q_out = torch.empty_like(q) if q is not None else None
    q_rstd = torch.empty(B, T, H, device=k.device, dtype=torch.float32) if q is not None else None
    A_log, dt_bias = gate_params
    launch_kernel(
        kn.coef_fwd_kernel,
        (triton.cdiv(R, BR),),
        k=k,
        v=v,
        beta=beta,
        g=g,
        A_log=A_log,
        dt_bias=dt_bias,
        erase=erase,
        gl=gl,
        vout=vout,
        overflow=overflow,
        q=q,
        q_out=q_out,
        q_rstd=q_rstd,
        R=R,
        H=H,
        K=K,
        V=V,
        BK=BK,
        BV=BV,
        BR=BR,
        GATED=gated,
        G_MIN=kn.G_FLOOR,
        FLAG=overflow is not None,
        num_warps=nw,
        QNORM=q is not None,
        **gate_consts,
    )
    coefficients = (erase, gl, vout) if gated else erase
    return coefficients if q is None else (coefficients, q_out, q_rstd)


def coef_bwd(
    k, beta, derase, dk, g=None, v=None, dgl=None, dvin=None, launch=None, dk_more=None, gates=None, q=None, q_rstd=None, dq=None
):
    """Fold coefficient grads (and ``dk_more``, a second part of k's grad) into dk (in place); return
    dbeta (, dg, dv) in the inputs' dtypes; with raw ``gates`` (gated only) the grads are those of the
    raw inputs, followed by those of ``A_log`` and ``dt_bias`` (``None`` where absent). With the
    forward's normalised ``q`` and ``q_rstd``, ``dq`` (the normalised queries' grad) is chained back
    through the normalisation in place (fla's ``l2norm_bwd``).
    ``launch``: ``(BR, num_warps)`` or ``(BR, num_warps, BC)`` (rows per program, warps, columns per
    block; whole rows by default) instead of the autotuned setting (benchmarks compare them)."""
    B, T, H, K = k.shape
    R = B * T * H
    gated = g is not None
    V = v.shape[-1] if gated else K
    dbeta = torch.empty_like(beta)
    dg = torch.empty_like(g) if gated else None
    dv = torch.empty_like(v) if gated else None
    gate_params, gate_consts = _gate_launch_args(gates)
    dgate = torch.empty(2, R, device=k.device, dtype=torch.float32) if gate_consts.get("GATE_ACT") else None
    qnorm = dq is not None
    # the autotuner restores dq between its trials: an empty stand-in where there is none
    dq_arg = dq if qnorm else k.new_empty(0)
    A_log, dt_bias = gate_params
    args = dict(k=k, v=v, beta=beta, g=g, A_log=A_log, dt_bias=dt_bias, derase=derase, dgl=dgl, dvin=dvin, dk=dk)
    args.update(dk_more=dk_more, dbeta=dbeta, dg=dg, dv=dv, dgate=dgate, q=q, q_rstd=q_rstd, dq=dq_arg, R=R, H=H)
    consts = dict(K=K, V=V, GATED=gated, G_MIN=kn.G_FLOOR, HAS_DK_MORE=dk_more is not None, QNORM=qnorm, **gate_consts)
    if launch is None:
        launch_kernel(kn.coef_bwd_kernel, lambda meta: (triton.cdiv(R, meta["BR"]),), **args, **consts)
    else:
        BR, nw, BC = (*launch, triton.next_power_of_2(max(K, V)))[:3]
        kn.coef_bwd_kernel.fn[(triton.cdiv(R, BR),)](**args, **consts, BR=BR, BC=BC, num_warps=nw)
    if not gated:
        return dbeta
    if gates is None:
        return dbeta, dg, dv
    return (dbeta, dg, dv, *gate_parameter_grads(dgate, gates, H))


def gate_parameter_grads(dgate, gates, heads: int):
    """Grads of ``A_log`` and ``dt_bias`` from the rows' parts the backward kernel wrote (``None``
    where the parameter is absent)."""
    if dgate is None:
        return None, None
    sums = dgate.view(2, -1, heads).sum(1)
    d_A_log = sums[0].to(gates.A_log.dtype)
    d_dt_bias = sums[1].to(gates.dt_bias.dtype) if gates.dt_bias is not None else None
    return d_A_log, d_dt_bias


def gated_dqkwg(q, k, v_new, g, h, do, dh, dv, scale, cu_seqlens, chunk_indices, launch=None):
    """``launch``: fixed settings ``dict(BV=, num_warps=, num_stages=)`` instead of the autotuned ones
    (benchmarks compare them)."""
    B, T, H, K = k.shape
    V = v_new.shape[-1]
    BT = CHUNK
    NT = triton.cdiv(T, BT) if cu_seqlens is None else len(chunk_indices)
    BK = min(triton.next_power_of_2(K), 128)
    NK = triton.cdiv(K, BK)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dw = torch.empty_like(k)
    dg = torch.empty(NK, B, T, H, device=k.device, dtype=torch.float32)
    args = dict(q=q, k=k, v=v_new, g=g, h=h, do=do, dh=dh, dv=dv, dq=dq, dk=dk, dw=dw, dg=dg)
    args.update(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=scale, T=T, TOT=B * T)
    consts = dict(H=H, K=K, V=V, BT=BT, BK=BK, IS_VARLEN=cu_seqlens is not None)
    if launch is None:
        launch_kernel(kn.gated_dqkwg_kernel, (NK, NT, B * H), **args, **consts)
    else:
        kn.gated_dqkwg_kernel.fn[(NK, NT, B * H)](**args, **consts, **launch)
    return dq, dk, dw, (dg[0] if NK == 1 else dg.sum(0))


# ------------------------------------------------------------------ in-op q/k normalisation
def l2norm_inputs(q, k, q_l2norm, k_l2norm):
    """Normalised (q, k) and their inverse norms (``None`` where not normalised)."""
    q_rstd = k_rstd = None
    if q_l2norm:
        q, q_rstd = FLA["l2norm_fwd"](q)
    if k_l2norm:
        k, k_rstd = FLA["l2norm_fwd"](k)
    return q, q_rstd, k, k_rstd


def l2norm_grads(q, q_rstd, dq, k, k_rstd, dk):
    """Chain (dq, dk) back through the normalisation done by ``l2norm_inputs``."""
    if q_rstd is not None:
        dq = FLA["l2norm_bwd"](q, q_rstd, dq)
    if k_rstd is not None:
        dk = FLA["l2norm_bwd"](k, k_rstd, dk)
    return dq, dk


def _fold_q_norm(exact: bool, q_l2norm: bool, k_l2norm: bool) -> bool:
    """Whether the coefficient pass normalises the queries too (EFLA's layers: unit queries, raw keys),
    forward and backward, in place of fla's separate ``l2norm`` kernels."""
    return exact and q_l2norm and not k_l2norm


def _q_norm_grad_args(fold_q: bool, q, q_rstd, dq) -> dict:
    return dict(q=q, q_rstd=q_rstd, dq=dq) if fold_q else {}


# ------------------------------------------------------------------ keys whose ||k||^2 overflows
_flags = threading.local()  # per thread: (device, stream) -> int32 [1], 0 until a pass finds an overflowing key


def overflow_flag(k):
    """The coefficient pass's flag for overflowing keys: one zeroed buffer per thread, device and
    stream (calls in one stream run, and are read, in order), kept from call to call (no fill per
    call) since the kernel only ever writes 1 into it; ``None`` (no flag, no sync) with the checks
    off or while a CUDA graph is captured, where the flag could not be read."""
    if not key_checks_enabled() or (k.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    stream = torch.cuda.current_stream(k.device).cuda_stream if k.is_cuda else None
    flags = getattr(_flags, "by_stream", None)
    if flags is None:
        flags = _flags.by_stream = {}
    flag = flags.get((k.device, stream))
    if flag is None:
        flag = flags[(k.device, stream)] = torch.zeros(1, dtype=torch.int32, device=k.device)
    return flag


def refuse_overflowing_keys(overflow, k):
    """Refuse a key whose ``||k||^2`` overflows float32 (fla's kernels would form ``k k^T`` = Inf and
    return NaN) with the CPU path's ``ValueError``, as ``efla.ops.validate`` describes: by default
    without stalling the host (this call's flag goes to the host behind its kernels, and a set flag
    raises at a later call of this thread, or at ``check_keys()``), at this call's end with
    ``EFLA_CHECK_KEYS=sync`` (one device sync), or at the end of an enclosing ``deferred_key_checks()``."""
    if overflow is None or defer_key_check(overflow):
        return
    if read_each_call():
        if overflow.item():
            reset_flag(overflow)
            raise key_energy_error(k)
        return
    raise_earlier_overflows()
    check_flag_later(overflow)


# ------------------------------------------------------------------ forward and backward stages
# Shared by the eager autograd Functions below and the custom ops of ``custom_ops.py`` (torch.compile).
def chunk_indices(cu_seqlens):
    """fla's per-chunk (sequence, chunk) table of a varlen batch; memoised by fla on the tensor."""
    return FLA["prepare_chunk_indices"](cu_seqlens, CHUNK) if cu_seqlens is not None else None


def delta_fwd(q, k, v, beta, h0, scale, output_final_state, cu_seqlens, exact, q_l2norm, k_l2norm):
    """EFLA (``exact``) or DeltaNet chunk forward. Returns ``(o, ht, A, alpha, q, q_rstd, k, k_rstd)``:
    ``alpha`` is ``beta`` for DeltaNet, ``q``/``k`` the normalised inputs (the inputs where not
    normalised), ``None`` for what is absent."""
    fold_q = _fold_q_norm(exact, q_l2norm, k_l2norm)
    q, q_rstd, k, k_rstd = l2norm_inputs(q, k, q_l2norm and not fold_q, k_l2norm)
    if exact:
        overflow = overflow_flag(k)
        if fold_q:
            alpha, q, q_rstd = coef_fwd(k, beta, overflow=overflow, q=q)
        else:
            alpha = coef_fwd(k, beta, overflow=overflow)
        refuse_overflowing_keys(overflow, k)
    else:
        alpha = beta
    o, A, ht = delta_rule_fwd(q, k, v, alpha, scale, h0, output_final_state, cu_seqlens)
    return o, ht, A, alpha, q, q_rstd, k, k_rstd


def delta_rule_fwd(q, k, v, beta, scale, h0, output_final_state, cu_seqlens):
    """fla's delta-rule chunk forward, ``(o, A, final state)`` as its ``chunk_delta_rule_fwd``
    returns them, but with the WY preparation of its gated path: ``k k^T`` and the triangular solve
    in one kernel (the same ``A = (I + diag(beta) strict_tril(k k^T))^{-1}``), so one launch and
    one pass of ``A`` through memory fewer."""
    ci = chunk_indices(cu_seqlens)
    A = st.wy_solve(k, beta, None, cu_seqlens, ci)
    o, ht = _state_and_output(q, k, v, beta, A, None, h0, scale, cu_seqlens, ci, output_final_state)
    return o, A, ht


def _state_and_output(q, k, v, beta, A, gcum, h0, scale, cu_seqlens, ci, output_final_state):
    """``(o, final state)`` from the solved ``A``: fla's ``w``/``u``, state and output kernels, or
    with ``EFLA_FUSED_FORWARD=1`` the last two as one kernel (``experimental/fused_forward.py``)."""
    w, u = st.gated_w_u(k, v, beta, A, gcum, cu_seqlens, ci)
    if environment.get("EFLA_FUSED_FORWARD"):
        from .experimental import fused_forward  # noqa: PLC0415 (the default path never imports the experiments)

        return fused_forward.state_output(q, k, w, u, gcum, h0, scale, cu_seqlens, output_final_state)
    h, v_new, ht = st.state_pass(k, w, u, gcum, h0, cu_seqlens, ci, output_final_state)
    return st.output(q, k, v_new, h, gcum, scale, cu_seqlens, ci), ht


def delta_bwd(q, q_rstd, k, k_rstd, v, beta, alpha, A, h0, cu_seqlens, do, dht, scale, exact):
    """Gradients ``(dq, dk, dv, dbeta, dh0)`` of ``delta_fwd`` (its saved tensors as it returned them)."""
    dq, dk, dk_wy, dv, dalpha, dh0 = delta_rule_bwd(q, k, v, alpha, A, scale, h0, do, dht, cu_seqlens)
    if exact:  # the coefficient pass reads and writes dk anyway: the WY part joins it there
        dk = dk.contiguous()
        fold_q = _fold_q_norm(exact, q_rstd is not None, k_rstd is not None)
        dq = dq.contiguous() if fold_q else dq
        dk_more = dk_wy.contiguous()
        dbeta = coef_bwd(k, beta, dalpha.contiguous(), dk, dk_more=dk_more, **_q_norm_grad_args(fold_q, q, q_rstd, dq))
        q_rstd = None if fold_q else q_rstd
    else:
        dk.add_(dk_wy)
        dbeta = dalpha
    dq, dk = l2norm_grads(q, q_rstd, dq, k, k_rstd, dk)
    return dq, dk, dv, dbeta, dh0


def delta_rule_bwd(q, k, v, beta, A, scale, h0, do, dht, cu_seqlens):
    """fla's ``chunk_delta_rule_bwd`` stage by stage, with the keys' gradient in its two parts
    (through the chunk's products and through the WY preparation) left apart: ``(dq, dk, dk_wy, dv,
    dbeta, dh0)``."""
    cu, ci = cu_seqlens, chunk_indices(cu_seqlens)
    do = do.contiguous()
    dht = dht.contiguous() if dht is not None else None
    w, u = st.delta_w_u(k, v, beta, A, cu, ci)
    h, v_new, _ = st.state_pass(k, w, u, None, h0, cu, ci)
    dv = st.local_dv(q, k, do, None, scale, cu, ci)
    dh, dh0, dv = st.state_grads(q, k, w, None, h0, dht, do, dv, scale, cu, ci)
    dq, dk, dw = st.delta_dqkw(q, k, v_new, w, h, do, dh, dv, scale, cu, ci)
    dk_wy, dv, dbeta = st.delta_wy_grads(k, v, beta, A, dw, dv, cu, ci)
    return dq, dk, dk_wy, dv, dbeta, dh0


def gated_fwd(q, k, v, g, beta, h0, scale, output_final_state, cu_seqlens, exact, q_l2norm, k_l2norm, gates=None):
    """Gated EFLA (``exact``) or Gated DeltaNet chunk forward. Returns
    ``(o, ht, A, gcum, c, vp, q, q_rstd, k, k_rstd)``: ``gcum`` the chunk-local gate cumsum, ``c``
    the erase (``beta`` for Gated DeltaNet), ``vp`` the rescaled value (``v`` for Gated DeltaNet).
    ``gates``: raw ``g`` and ``beta`` (Gated EFLA only), activated in the coefficient pass."""
    fold_q = _fold_q_norm(exact, q_l2norm, k_l2norm)
    q, q_rstd, k, k_rstd = l2norm_inputs(q, k, q_l2norm and not fold_q, k_l2norm)
    if exact:
        overflow = overflow_flag(k)
        if fold_q:
            (c, gl, vp), q, q_rstd = coef_fwd(k, beta, g=g, v=v, overflow=overflow, gates=gates, q=q)
        else:
            c, gl, vp = coef_fwd(k, beta, g=g, v=v, overflow=overflow, gates=gates)
        refuse_overflowing_keys(overflow, k)
    else:
        c, gl, vp = beta, g.float(), v
    cu, ci = cu_seqlens, chunk_indices(cu_seqlens)
    gcum = st.local_cumsum(gl, cu, ci, scale=st.RCP_LN2)
    A = st.wy_solve(k, c, gcum, cu, ci)
    o, ht = _state_and_output(q, k, vp, c, A, gcum, h0, scale, cu, ci, output_final_state)
    return o, ht, A, gcum, c, vp, q, q_rstd, k, k_rstd


def gated_bwd(q, q_rstd, k, k_rstd, v, vp, g, beta, c, gcum, A, h0, cu_seqlens, do, dht, scale, exact, gates=None):
    """Gradients ``(dq, dk, dv, dg, dbeta, dh0)`` of ``gated_fwd``, then, with ``gates``, those of
    ``A_log`` and ``dt_bias``."""
    cu, ci = cu_seqlens, chunk_indices(cu_seqlens)
    do = do.contiguous()
    dht = dht.contiguous() if dht is not None else None
    w, u = st.gated_w_u(k, vp, c, A, gcum, cu, ci)
    h, v_new, _ = st.state_pass(k, w, u, gcum, h0, cu, ci)
    dv = st.local_dv(q, k, do, gcum, scale, cu, ci)
    dh, dh0, dv = st.state_grads(q, k, w, gcum, h0, dht, do, dv, scale, cu, ci)
    dq, dk, dw, dgc = gated_dqkwg(q, k, v_new, gcum, h, do, dh, dv, scale, cu, ci)
    dk2, dvp, dc, dg2 = st.gated_wy_grads(k, vp, c, A, gcum, dw, dv, cu, ci)
    dgc.add_(dg2)
    dgl = st.local_cumsum(dgc, cu, ci, reverse=True)
    d_gate_params = ()
    if exact:  # the coefficient pass reads and writes dk anyway: dk2 joins it there, and dq's normalisation
        fold_q = _fold_q_norm(exact, q_rstd is not None, k_rstd is not None)
        dq = dq.contiguous() if fold_q else dq
        dbeta, dg, dv_out, *d_gate_params = coef_bwd(
            k,
            beta,
            dc.contiguous(),
            dk,
            g=g,
            v=v,
            dgl=dgl.contiguous(),
            dvin=dvp.contiguous(),
            dk_more=dk2.contiguous(),
            gates=gates,
            **_q_norm_grad_args(fold_q, q, q_rstd, dq),
        )
        q_rstd = None if fold_q else q_rstd
    else:
        dk.add_(dk2)
        dbeta, dg, dv_out = dc.to(beta.dtype), dgl.to(g.dtype), dvp
    dq, dk = l2norm_grads(q, q_rstd, dq, k, k_rstd, dk)
    return (dq, dk, dv_out, dg, dbeta, dh0, *d_gate_params)


# ------------------------------------------------------------------ autograd Functions (eager)
class ChunkEFLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, h0, scale, output_final_state, cu_seqlens, q_l2norm, k_l2norm):
        o, ht, A, alpha, q, q_rstd, k, k_rstd = delta_fwd(
            q, k, v, beta, h0, scale, output_final_state, cu_seqlens, True, q_l2norm, k_l2norm
        )
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, beta, alpha, A, h0)
        ctx.scale, ctx.cu = scale, cu_seqlens
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, q_rstd, k, k_rstd, v, beta, alpha, A, h0 = ctx.saved_tensors
        dq, dk, dv, dbeta, dh0 = delta_bwd(q, q_rstd, k, k_rstd, v, beta, alpha, A, h0, ctx.cu, do, dht, ctx.scale, True)
        return dq, dk, dv, dbeta, (dh0 if h0 is not None else None), None, None, None, None, None


class ChunkGated(torch.autograd.Function):
    """Gated chunk op: ``exact`` = Gated EFLA, else Gated DeltaNet (Euler), with our backward.
    ``A_log``, ``dt_bias``, ``beta_scale``: raw gates (``efla.ops.gates.RawGates``), Gated EFLA only."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        g,
        beta,
        h0,
        scale,
        output_final_state,
        cu_seqlens,
        exact,
        q_l2norm,
        k_l2norm,
        A_log=None,
        dt_bias=None,
        beta_scale=None,
    ):
        gates = _raw_gates(A_log, dt_bias, beta_scale)
        o, ht, A, gcum, c, vp, q, q_rstd, k, k_rstd = gated_fwd(
            q, k, v, g, beta, h0, scale, output_final_state, cu_seqlens, exact, q_l2norm, k_l2norm, gates
        )
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, vp, g, beta, c, gcum, A, h0, A_log, dt_bias)
        ctx.scale, ctx.cu, ctx.exact, ctx.beta_scale = scale, cu_seqlens, exact, beta_scale
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, q_rstd, k, k_rstd, v, vp, g, beta, c, gcum, A, h0, A_log, dt_bias = ctx.saved_tensors
        gates = _raw_gates(A_log, dt_bias, ctx.beta_scale)
        dq, dk, dv, dg, dbeta, dh0, *d_gate_params = gated_bwd(
            q, q_rstd, k, k_rstd, v, vp, g, beta, c, gcum, A, h0, ctx.cu, do, dht, ctx.scale, ctx.exact, gates
        )
        d_A_log, d_dt_bias = d_gate_params or (None, None)
        return (
            dq,
            dk,
            dv,
            dg,
            dbeta,
            (dh0 if h0 is not None else None),
            None,
            None,
            None,
            None,
            None,
            None,
            d_A_log,
            d_dt_bias,
            None,
        )


def _raw_gates(A_log, dt_bias, beta_scale):
    if A_log is None and beta_scale is None:
        return None
    return RawGates(A_log, dt_bias, beta_scale)


def eager_chunk_forward(kind, q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, q_l2norm, k_l2norm, gates=None):
    """``(o, final_state or None)`` through the autograd Functions (and fla's DeltaNet as is);
    ``gates``: raw gate inputs, for ``gated_efla`` only."""
    if kind == "efla":
        o, ht = ChunkEFLA.apply(q, k, v, beta, h0, scale, output_final_state, cu_seqlens, q_l2norm, k_l2norm)
    elif kind == "delta_rule":
        # the Euler baseline is fla's DeltaNet as is
        from fla.ops.delta_rule import chunk_delta_rule

        both = q_l2norm and k_l2norm
        if q_l2norm and not both:
            q = FLA["l2norm"](q)
        if k_l2norm and not both:
            k = FLA["l2norm"](k)
        o, ht = chunk_delta_rule(
            q,
            k,
            v,
            beta,
            scale=scale,
            initial_state=h0,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=both,
        )
    else:
        raw = (gates.A_log, gates.dt_bias, gates.beta_scale) if gates is not None else ()
        o, ht = ChunkGated.apply(
            q, k, v, g, beta, h0, scale, output_final_state, cu_seqlens, kind == "gated_efla", q_l2norm, k_l2norm, *raw
        )
    return o, (ht if output_final_state else None)
