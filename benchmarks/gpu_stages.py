"""Where the GPU chunk ops spend their time: every stage of EFLA's and Gated EFLA's forward and
backward, timed alone, next to what flash-linear-attention's DeltaNet / Gated DeltaNet run in its
place.

For each [B, T, H] shape (K = V = 128, bf16, stiff keys as in ``gpu_ops.py``) it prints one table of
stage times (``triton.testing.do_bench`` medians, alternated, median over rounds):

* EFLA: the coefficient pass (with the queries' normalisation), the delta-rule forward (fla's fused
  WY preparation, its state and output kernels) and backward (fla's stages), the coefficient
  backward, each beside what DeltaNet runs in its place (fla's ``chunk_delta_rule_fwd`` / ``_bwd``,
  its q and k normalisation); rows in brackets are parts or alternatives, left out of the sum;
* Gated EFLA: the coefficient pass, fla's gated forward, then each backward stage; the one stage
  fla refuses on Hopper with Triton < 3.7.1 (``chunk_bwd_dqkwg`` with a gate) is timed three ways:
  ours autotuned (the default), ours at the single launch setting of earlier versions, and (with
  ``--with-fla-dqkwg``) fla's own kernel forced to run (its results may be wrong there; only its time
  is of interest);
* the whole op's fwd+bwd through autograd, against the sum of its stages (the rest is launch and
  Python overhead), and the host time of the op calls (forward, and forward and backward): from an
  idle GPU until the call returns;
* at the first shape, the coefficient kernels at other launch settings (rows per program, warps).

Usage (GPU machine): ``python benchmarks/gpu_stages.py --shapes "8,2048,16;2,16384,16" --out DIR``;
writes ``DIR/gpu_stages.md``.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import efla.ops as ops
from gpu_ops import make_inputs, with_settings, with_triton_launches

LINES: list[str] = []
OLD_DQKWG_LAUNCH = dict(BV=64, num_warps=4, num_stages=2)
WITH_FLA_DQKWG = False  # --with-fla-dqkwg (its autotuning takes a minute on a fresh machine)


def emit(out: str, s: str = "") -> None:
    print(s, flush=True)
    LINES.append(s)
    with open(os.path.join(out, "gpu_stages.md"), "w") as fh:
        fh.write("\n".join(LINES) + "\n")


def bench(fns: dict, rounds: int, rep: float) -> dict:
    from triton.testing import do_bench

    res = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            res[n].append(do_bench(f, warmup=10, rep=rep, return_mode="median"))
    return {n: statistics.median(v) for n, v in res.items()}


def fla_functions() -> dict:
    """fla's stage functions by name, as its own ops call them (the stages beside ours)."""
    from fla.modules.l2norm import l2norm_bwd, l2norm_fwd
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dv_local
    from fla.ops.delta_rule.chunk import chunk_delta_rule_bwd, chunk_delta_rule_fwd
    from fla.ops.delta_rule.wy_fast import prepare_wy_repr_fwd
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd, recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum

    return dict(
        l2norm_fwd=l2norm_fwd,
        l2norm_bwd=l2norm_bwd,
        chunk_gated_delta_rule_bwd_dhu=chunk_gated_delta_rule_bwd_dhu,
        chunk_gated_delta_rule_fwd_h=chunk_gated_delta_rule_fwd_h,
        chunk_bwd_dv_local=chunk_bwd_dv_local,
        chunk_delta_rule_fwd=chunk_delta_rule_fwd,
        chunk_delta_rule_bwd=chunk_delta_rule_bwd,
        prepare_wy_repr_fwd=prepare_wy_repr_fwd,
        chunk_gated_delta_rule_fwd=chunk_gated_delta_rule_fwd,
        chunk_gated_delta_rule_fwd_intra=chunk_gated_delta_rule_fwd_intra,
        prepare_wy_repr_bwd=prepare_wy_repr_bwd,
        recompute_w_u_fwd=recompute_w_u_fwd,
        chunk_local_cumsum=chunk_local_cumsum,
    )


def efla_stages(ch, F, q, k, v, beta, do, scale):
    """name -> callable for each EFLA stage (inputs prepared by running the forward once); the
    names in brackets are not what the op runs (parts of it, or DeltaNet's) and stay out of the sum."""
    o, ht, A, alpha, qn, q_rstd, _, _ = ch.delta_fwd(q, k, v, beta, None, scale, False, None, True, True, False)
    kn, k_rstd = F["l2norm_fwd"](k)
    dq, dk, dk_wy, _, dalpha, _ = ch.delta_rule_bwd(qn, k, v, alpha, A, scale, None, do, None, None)
    dk, dk_wy = dk.contiguous(), dk_wy.contiguous()
    w, u = ch.st.delta_w_u(k, v, alpha, A, None, None)
    dv_local = ch.st.local_dv(qn, k, do, None, scale, None, None)

    # each tuned per sequences x heads: fla tunes these kernels per head count only, so the whole and
    # the split passes would otherwise share the setting the first of them was tuned at
    def state_pass_in(pieces: str):
        settings = {"EFLA_SPLIT_STATE": pieces, "EFLA_STATE_TUNING": "1"}
        return with_settings(lambda: ch.st.state_pass(k, w, u, None, None, None, None), settings)

    def state_grads_in(pieces: str):
        settings = {"EFLA_SPLIT_STATE": pieces, "EFLA_STATE_TUNING": "1"}
        return with_settings(lambda: ch.st.state_grads(qn, k, w, None, None, None, do, dv_local, scale, None, None), settings)

    # the coefficient passes flag overflowing keys as the model's do (the flag's read is not timed)
    return {
        "(q l2norm fwd alone)": lambda: F["l2norm_fwd"](q),
        "(coefficient fwd alone)": lambda: ch.coef_fwd(k, beta, overflow=ch.overflow_flag(k)),
        "coefficient fwd with q l2norm (what the op runs)": lambda: ch.coef_fwd(k, beta, overflow=ch.overflow_flag(k), q=q),
        "(DeltaNet: k l2norm fwd)": lambda: F["l2norm_fwd"](k),
        "delta_rule_fwd: fla's fused kkt + solve, then its w/u, h and o (what the op runs)": lambda: ch.delta_rule_fwd(
            qn, k, v, alpha, scale, None, False, None
        ),
        "(DeltaNet: fla chunk_delta_rule_fwd)": lambda: F["chunk_delta_rule_fwd"](
            q=qn, k=k, v=v, beta=alpha, scale=scale, initial_state=None, output_final_state=False
        ),
        "(delta_rule_fwd with its state and output passes in one kernel, EFLA_FUSED_FORWARD=1)": with_settings(
            lambda: ch.delta_rule_fwd(qn, k, v, alpha, scale, None, False, None), {"EFLA_FUSED_FORWARD": "1"}
        ),
        "(its state pass alone: fla's h kernel, tuned per sequences x heads)": state_pass_in("0"),
        "(its state pass, sequences in 4 pieces side by side, EFLA_SPLIT_STATE=4)": state_pass_in("4"),
        "(its state pass, sequences in 8 pieces side by side, EFLA_SPLIT_STATE=8)": state_pass_in("8"),
        "(the backward's reverse state pass alone: fla's dh kernel, tuned per sequences x heads)": state_grads_in("0"),
        "(the reverse state pass, sequences in 4 pieces side by side, EFLA_SPLIT_STATE=4)": state_grads_in("4"),
        "(the reverse state pass, sequences in 8 pieces side by side, EFLA_SPLIT_STATE=8)": state_grads_in("8"),
        "(its WY preparation: fla's fused kkt + solve, w/u)": lambda: F["chunk_gated_delta_rule_fwd_intra"](
            k=k, v=v, g=None, beta=alpha, chunk_size=ch.CHUNK
        ),
        "(DeltaNet's WY preparation: kkt, solve, w/u)": lambda: F["prepare_wy_repr_fwd"](k=k, v=v, beta=alpha, cu_seqlens=None),
        "delta_rule_bwd: fla's delta-rule backward stages, the WY part of dk apart (what the op runs)": lambda: ch.delta_rule_bwd(
            qn, k, v, alpha, A, scale, None, do, None, None
        ),
        "(DeltaNet: fla chunk_delta_rule_bwd)": lambda: F["chunk_delta_rule_bwd"](
            q=qn, k=k, v=v, beta=alpha, A=A, scale=scale, initial_state=None, do=do, dht=None
        ),
        "(coefficient bwd alone)": lambda: ch.coef_bwd(k, beta, dalpha, dk),
        "(q l2norm bwd alone)": lambda: F["l2norm_bwd"](qn, q_rstd, dq),
        # dk and dq are updated in place call after call: their values drift, the work does not
        "coefficient bwd with q l2norm bwd and the WY part of dk (what the op runs)": lambda: ch.coef_bwd(
            k, beta, dalpha, dk, dk_more=dk_wy, q=qn, q_rstd=q_rstd, dq=dq
        ),
        "(DeltaNet: k l2norm bwd)": lambda: F["l2norm_bwd"](kn, k_rstd, dk),
    }


def gated_stages(ch, F, q, k, v, g, beta, do, scale):
    import fla.ops.common.chunk_o as fla_chunk_o

    o, ht, A, gcum, c, vp, qn, q_rstd, _, _ = ch.gated_fwd(q, k, v, g, beta, None, scale, False, None, True, True, False)
    w, u = F["recompute_w_u_fwd"](k=k, v=vp, beta=c, A=A, g=gcum)
    h, v_new, _ = F["chunk_gated_delta_rule_fwd_h"](
        k=k, w=w, u=u, g=gcum, initial_state=None, output_final_state=False, chunk_size=ch.CHUNK
    )
    dv = F["chunk_bwd_dv_local"](q=qn, k=k, do=do, g=gcum, scale=scale, chunk_size=ch.CHUNK)
    dh, _, dv = F["chunk_gated_delta_rule_bwd_dhu"](
        q=qn, k=k, w=w, do=do, dv=dv, g=gcum, h0=None, dht=None, scale=scale, chunk_size=ch.CHUNK
    )
    dq, dk, dw, dgc = ch.gated_dqkwg(qn, k, v_new, gcum, h, do, dh, dv, scale, None, None)
    dk2, dvp, dc, dg2 = F["prepare_wy_repr_bwd"](k=k, v=vp, beta=c, A=A, dw=dw, du=dv, g=gcum)
    dgl = F["chunk_local_cumsum"](dgc, chunk_size=ch.CHUNK, reverse=True)

    def fla_dqkwg():  # fla refuses this stage on Hopper with Triton < 3.7.1; forced here for its time only
        before = fla_chunk_o.TRITON_ABOVE_3_7_1
        fla_chunk_o.TRITON_ABOVE_3_7_1 = True
        try:
            return fla_chunk_o.chunk_bwd_dqkwg(
                q=qn, k=k, v=v_new, w=w, g=gcum, h=h, dv=dv, do=do, dh=dh, scale=scale, chunk_size=ch.CHUNK
            )
        finally:
            fla_chunk_o.TRITON_ABOVE_3_7_1 = before

    return {
        "(q l2norm fwd alone)": lambda: F["l2norm_fwd"](q),
        "(coefficient fwd (gated) alone)": lambda: ch.coef_fwd(k, beta, g=g, v=v, overflow=ch.overflow_flag(k)),
        "coefficient fwd (gated) with q l2norm (what the op runs)": lambda: ch.coef_fwd(
            k, beta, g=g, v=v, overflow=ch.overflow_flag(k), q=q
        ),
        "fla chunk_gated_delta_rule_fwd": lambda: F["chunk_gated_delta_rule_fwd"](
            q=qn,
            k=k,
            v=vp,
            g=ch.coef_fwd(k, beta, g=g, v=v)[1],
            beta=c,
            scale=scale,
            initial_state=None,
            output_final_state=False,
            chunk_size=ch.CHUNK,
        ),
        "bwd: recompute_w_u_fwd": lambda: F["recompute_w_u_fwd"](k=k, v=vp, beta=c, A=A, g=gcum),
        "bwd: chunk_gated_delta_rule_fwd_h": lambda: F["chunk_gated_delta_rule_fwd_h"](
            k=k, w=w, u=u, g=gcum, initial_state=None, output_final_state=False, chunk_size=ch.CHUNK
        ),
        "bwd: chunk_bwd_dv_local": lambda: F["chunk_bwd_dv_local"](q=qn, k=k, do=do, g=gcum, scale=scale, chunk_size=ch.CHUNK),
        "bwd: chunk_gated_delta_rule_bwd_dhu": lambda: F["chunk_gated_delta_rule_bwd_dhu"](
            q=qn, k=k, w=w, do=do, dv=dv, g=gcum, h0=None, dht=None, scale=scale, chunk_size=ch.CHUNK
        ),
        "bwd: dqkwg, ours autotuned": lambda: ch.gated_dqkwg(qn, k, v_new, gcum, h, do, dh, dv, scale, None, None),
        "bwd: dqkwg, ours fixed (BV 64, 4 warps, 2 stages)": lambda: ch.gated_dqkwg(
            qn, k, v_new, gcum, h, do, dh, dv, scale, None, None, launch=OLD_DQKWG_LAUNCH
        ),
        **({"(bwd: dqkwg, fla's kernel forced)": fla_dqkwg} if WITH_FLA_DQKWG else {}),
        "bwd: prepare_wy_repr_bwd": lambda: F["prepare_wy_repr_bwd"](k=k, v=vp, beta=c, A=A, dw=dw, du=dv, g=gcum),
        "bwd: reverse cumsum of dg": lambda: F["chunk_local_cumsum"](dgc, chunk_size=ch.CHUNK, reverse=True),
        "(bwd: coefficient bwd (gated) alone)": lambda: ch.coef_bwd(
            k, beta, dc, dk, g=g, v=v, dgl=dgl, dvin=dvp, dk_more=dk2.contiguous()
        ),
        "(bwd: q l2norm bwd alone)": lambda: F["l2norm_bwd"](qn, q_rstd, dq),
        "bwd: coefficient bwd (gated) with q l2norm bwd (what the op runs)": lambda: ch.coef_bwd(
            k, beta, dc, dk, g=g, v=v, dgl=dgl, dvin=dvp, dk_more=dk2.contiguous(), q=qn, q_rstd=q_rstd, dq=dq
        ),
    }


COEF_LAUNCHES = [(br, w) for br in (8, 16, 32, 64) for w in (2, 4, 8)]


def coef_sweep(out, ch, q, k, v, g, beta, scale, rounds, rep):
    """The coefficient kernels at other (rows per program, warps) settings than the default."""
    with torch.no_grad():
        o, ht, A, alpha, *_ = ch.delta_fwd(q, k, v, beta, None, scale, False, None, True, True, False)
        dk = torch.randn_like(k)
        dalpha = torch.randn_like(alpha)
        c, gl, vp = ch.coef_fwd(k, beta, g=g, v=v)
        dc, dgl, dvp = torch.randn_like(c), torch.randn_like(gl), torch.randn_like(vp)
        kernels = {
            "fwd": lambda lc: ch.coef_fwd(k, beta, launch=lc, overflow=ch.overflow_flag(k)),
            "bwd": lambda lc: ch.coef_bwd(k, beta, dalpha, dk, launch=lc),
            "gated fwd": lambda lc: ch.coef_fwd(k, beta, g=g, v=v, launch=lc, overflow=ch.overflow_flag(k)),
            "gated bwd": lambda lc: ch.coef_bwd(k, beta, dc, dk, g=g, v=v, dgl=dgl, dvin=dvp, launch=lc),
        }
        emit(out, "| coefficient kernel | default | best (rows, warps) | best ms | all (rows, warps): ms |")
        emit(out, "| --- | --- | --- | --- | --- |")
        for name, f in kernels.items():
            fns = {None: lambda f=f: f(None)}
            fns.update({lc: (lambda f=f, lc=lc: f(lc)) for lc in COEF_LAUNCHES})
            for fn in fns.values():
                fn()
            times = bench(fns, rounds, rep)
            best = min((lc for lc in times if lc is not None), key=times.get)
            every = ", ".join(f"{lc[0]}/{lc[1]}: {t:.3f}" for lc, t in times.items() if lc is not None)
            emit(out, f"| {name} | {times[None]:.3f} | {best} | {times[best]:.3f} | {every} |")
    emit(out, "")


def host_ms(fn, calls: int = 30) -> float:
    """Median host time (ms) of one call from an idle GPU until the call returns: where it exceeds
    the call's GPU time, the op is bound by its host side (Python and launches)."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def host_functions(fn, calls: int = 20, top: int = 25) -> list[tuple[str, float]]:
    """The functions with the most cumulative host time over ``calls`` calls of ``fn`` (cProfile),
    as ``(file:line(function), ms per call)``."""
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats
    rows = [
        (f"{os.path.basename(path)}:{line}({func})", cumulative / calls * 1e3)
        for (path, line, func), (_, _, _, cumulative, _) in stats.items()
    ]
    return sorted(rows, key=lambda row: -row[1])[:top]


H200_BYTES_PER_S = 4.8e12  # HBM3e, NVIDIA's figure


def efla_stage_bytes(B: int, T: int, H: int, K: int, V: int) -> dict:
    """The least HBM traffic of each EFLA stage the op runs (each input read once, each output
    written once; bf16 tensors, float32 inverse norms), by the stage names of ``efla_stages``."""
    n, chunk = B * T * H, 64
    qk, vv, row, row32, a = n * K * 2, n * V * 2, n * 2, n * 4, n * chunk * 2
    states = B * -(-T // chunk) * H * K * V * 2  # one bf16 state per chunk (h, dh)
    w_u = (qk + vv + row + a) + (qk + vv)  # k, v, beta, A -> w, u
    state_pass = (qk + qk + vv) + (states + vv)  # k, w, u -> h, v_new
    forward = (
        (qk + row)
        + a  # k, beta -> A (k k^T and the solve)
        + w_u
        + state_pass
        + (qk + qk + vv + states)
        + vv  # q, k, v_new, h -> o
    )
    backward = (
        w_u
        + state_pass
        + (qk + qk + vv)
        + vv  # q, k, do -> dv within chunks
        + (qk + qk + qk + vv + vv)
        + (states + vv)  # q, k, w, do, dv -> dh, dv
        + (qk + qk + vv + states + vv + states + vv)
        + 3 * qk  # q, k, v_new, h, do, dh, dv -> dq, dk, dw
        + (qk + vv + row + a + qk + vv)
        + (qk + vv + row)  # k, v, beta, A, dw, du -> dk, dv, dbeta
    )
    return {
        # k, q, beta -> alpha, q / |q|, 1 / |q|
        "coefficient fwd with q l2norm (what the op runs)": (qk + qk + row) + (row + qk + row32),
        "delta_rule_fwd": forward,
        "delta_rule_bwd": backward,
        # k, dk, its WY part, q, dq, beta, d alpha, 1/|q| -> dk, dq, dbeta
        "coefficient bwd with q l2norm bwd and the WY part of dk (what the op runs)": (5 * qk + 2 * row + row32) + (2 * qk + row),
    }


def bandwidth_rows(times: dict, stage_bytes: dict) -> list[str]:
    """Table rows: each stage's least traffic against its time and the H200's bandwidth."""
    rows = []
    for prefix, nbytes in stage_bytes.items():
        name = next((n for n in times if n.startswith(prefix)), None)
        if name is None:
            continue
        rate = nbytes / (times[name] * 1e-3)
        rows.append(f"| {prefix} | {times[name]:.3f} | {nbytes / 1e6:.0f} | {rate / 1e9:.0f} | {rate / H200_BYTES_PER_S:.0%} |")
    return rows


def whole_op(fn, leaves, do):
    def run():
        fn()[0].backward(do)
        for x in leaves:
            x.grad = None

    return run


def one_shape(out, ch, F, B, T, H, rounds, rep, sweep):
    import triton

    from efla.ops.cuda import kernels as kn

    q, k, v, beta, g, _ = make_inputs(B, T, H, 128, 128, B, torch.device("cuda"), stiff=True, seed=1)
    g = g.float()
    do = torch.randn_like(v)
    scale = 128**-0.5
    with torch.no_grad():
        rows = [
            ("Gated EFLA", gated_stages(ch, F, q, k, v, g, beta, do, scale)),
            ("EFLA", efla_stages(ch, F, q, k, v, beta, do, scale)),
        ]
    if sweep:
        coef_sweep(out, ch, q, k, v, g, beta, scale, rounds, rep / 5)
    leaves = [x.requires_grad_() for x in (q, k, v, beta, g)]
    from fla.ops.delta_rule import chunk_delta_rule

    whole = {
        "EFLA fwd+bwd (autograd)": whole_op(lambda: ops.chunk_efla(q, k, v, beta, use_q_l2norm_in_kernel=True), leaves, do),
        "DeltaNet fwd+bwd (fla, qk l2norm in kernel)": whole_op(
            lambda: chunk_delta_rule(q, k, v, beta, use_qk_l2norm_in_kernel=True), leaves, do
        ),
        "Gated EFLA fwd+bwd (autograd)": whole_op(
            lambda: ops.chunk_gated_efla(q, k, v, g, beta, use_q_l2norm_in_kernel=True), leaves, do
        ),
    }
    whole["EFLA fwd+bwd (autograd), launches through Triton"] = with_triton_launches(whole["EFLA fwd+bwd (autograd)"])
    for f in whole.values():
        f()
    emit(out, f"### [B, T, H] = [{B}, {T}, {H}], K = V = 128")
    emit(out, "")
    emit(out, "| op | stage | ms |")
    emit(out, "| --- | --- | --- |")
    efla_times = {}
    for label, stages in rows:
        with torch.no_grad():
            for f in stages.values():
                f()
            times = bench(stages, rounds, rep)
        if label == "EFLA":
            efla_times = times
        for name, t in times.items():
            emit(out, f"| {label} | {name} | {t:.3f} |")
        counted = sum(t for n, t in times.items() if not n.startswith("(") and "fixed" not in n)
        emit(out, f"| {label} | sum of its stages | {counted:.3f} |")
    for name, t in bench(whole, rounds, rep).items():
        emit(out, f"| whole op | {name} | {t:.3f} |")
    emit(out, "")
    emit(out, "EFLA's stages against the H200's memory bandwidth (least HBM traffic: inputs read once, outputs written once):")
    emit(out, "")
    emit(out, "| stage | ms | MB moved (least) | GB/s | share of 4.8 TB/s |")
    emit(out, "| --- | --- | --- | --- | --- |")
    for row in bandwidth_rows(efla_times, efla_stage_bytes(B, T, H, 128, 128)):
        emit(out, row)
    emit(out, "")
    forwards = {
        "EFLA fwd": lambda: ops.chunk_efla(q, k, v, beta, use_q_l2norm_in_kernel=True),
        "EFLA fwd, launches through Triton": with_triton_launches(
            lambda: ops.chunk_efla(q, k, v, beta, use_q_l2norm_in_kernel=True)
        ),
        "DeltaNet fwd (fla, qk l2norm in kernel)": lambda: chunk_delta_rule(q, k, v, beta, use_qk_l2norm_in_kernel=True),
    }
    with torch.no_grad():
        host_forward = {name: host_ms(f) for name, f in forwards.items()}
    for name, t in {**host_forward, **{name: host_ms(f) for name, f in whole.items()}}.items():
        emit(out, f"| host | {name}: the call's return after a synchronised start | {t:.3f} |")
    with torch.no_grad():
        host_profile = host_functions(forwards["EFLA fwd"])
    emit(out, "")
    emit(out, "Where the EFLA forward call's host time goes (cProfile over 20 calls, cumulative ms per call):")
    emit(out, "")
    emit(out, "| function | ms per call |")
    emit(out, "| --- | --- |")
    for name, ms in host_profile:
        emit(out, f"| `{name}` | {ms:.3f} |")
    cfg = getattr(kn.gated_dqkwg_kernel, "best_config", None)
    emit(out, "")
    emit(out, f"dqkwg autotuned choice: {cfg} (triton {triton.__version__})")
    emit(out, "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8,2048,16;2,16384,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=float, default=50.0, help="do_bench rep (ms)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the coefficient kernels' launch-setting sweep")
    ap.add_argument("--with-fla-dqkwg", action="store_true", help="also time fla's refused gated dqkwg kernel")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    global WITH_FLA_DQKWG
    WITH_FLA_DQKWG = args.with_fla_dqkwg
    from efla.ops.cuda import chunk as ch

    ch.load()
    F = fla_functions()
    import fla
    import triton

    emit(args.out, "# Stage times of the GPU chunk ops")
    emit(args.out, "")
    emit(
        args.out,
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; "
        f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}, "
        f"flash-linear-attention {getattr(fla, '__version__', '?')}",
    )
    emit(
        args.out,
        f'- `python benchmarks/gpu_stages.py --shapes "{args.shapes}" --rounds {args.rounds} '
        f"--rep {args.rep}`; do_bench medians, alternated, median of {args.rounds} rounds",
    )
    emit(args.out, "")
    for i, sh in enumerate(args.shapes.split(";")):
        B, T, H = (int(x) for x in sh.split(","))
        one_shape(args.out, ch, F, B, T, H, args.rounds, args.rep, sweep=i == 0 and not args.no_sweep)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
