"""``efla.ops.cuda.launch``: a launch after the first of its kind goes straight to the compiled
kernel and computes what Triton's own launch computes, for every way the arguments specialise."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.interpreter import interpreter_ready

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OK, _WHY = interpreter_ready(packages=("triton",))
_FLA_OK, _FLA_WHY = interpreter_ready()

_SCRIPT = textwrap.dedent(
    """
    import sys, torch, triton
    sys.path.insert(0, {repo!r})
    from efla.ops.cuda import launch as L
    from tests.ops.launch_kernel import copy_kernel, scale_shift_kernel
    dev = {device!r}
    recorded = {recorded!r}

    def run(x, shift, scale):
        y = torch.empty_like(x)
        n = x.numel()
        L.launch(scale_shift_kernel, lambda meta: (triton.cdiv(n, meta["BLOCK"]),), x=x, shift=shift, y=y, n=n, scale=scale)
        return y

    def check(x, shift, scale):  # against Triton's own launch (it may fuse x * scale + shift)
        want = torch.empty_like(x)
        n = x.numel()
        scale_shift_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x=x, shift=shift, y=want, n=n, scale=scale)
        got = run(x, shift, scale)
        assert torch.equal(got, want), (got - want).abs().max()

    gen = torch.Generator(device=dev).manual_seed(0)
    base = torch.randn(4097, device=dev, generator=gen)
    shift = torch.randn(4097, device=dev, generator=gen)
    for _ in range(3):  # the first call records, the later ones replay with fresh tensors
        check(torch.randn(4096, device=dev, generator=gen), torch.randn(4096, device=dev, generator=gen), 0.5)
    check(base[1:], shift[1:], 0.5)  # pointers off 16-byte alignment: Triton compiles another kernel
    check(base[:4096], None, 0.5)  # no shift: another heuristic value
    check(base[:4096], shift[:4096], -3.0)  # another scale
    check(base[:100], shift[:100], 0.5)  # another autotuning key and grid
    check(base[:100], shift[:100], 0.5)
    for warps in (2, 2, 4):  # a launch option: part of the compiled kernel, not a parameter
        x = torch.randn(1000, device=dev, generator=gen)
        y = torch.empty_like(x)
        L.launch(copy_kernel, (8,), x=x, y=y, n=1000, BLOCK=128, num_warps=warps)
        assert torch.equal(x, y)
    kinds = [type(r).__name__ for r in L._records.values()]
    print(kinds)
    if recorded:
        assert kinds.count("_Record") == 7, kinds
        held = [name for r in L._records.values() for name, v in r.parameters.items() if isinstance(v, torch.Tensor)]
        assert not held, held  # a record keeps no caller's tensor alive
    assert len(L._records) == (7 if recorded else 0), kinds
    print("OK")
    """
)


def _run(device: str, interpret: bool):
    env = dict(os.environ, EFLA_DIRECT_LAUNCH="1")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    script = _SCRIPT.format(repo=REPO, device=device, recorded=not interpret)
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.skipif(not _OK, reason=_WHY)
def test_direct_launches_are_on_unless_turned_off(monkeypatch):
    from efla import environment
    from efla.ops.cuda.launch import direct_launches

    monkeypatch.delenv("EFLA_DIRECT_LAUNCH", raising=False)
    environment.reload()
    assert direct_launches()
    monkeypatch.setenv("EFLA_DIRECT_LAUNCH", "off")
    assert direct_launches(), "the value first read is kept until reload()"
    environment.reload()
    assert not direct_launches()
    with environment.override(EFLA_DIRECT_LAUNCH=True):
        assert direct_launches()
    assert not direct_launches()


@pytest.mark.skipif(not _OK, reason=_WHY)
def test_launch_runs_through_triton_under_the_interpreter():
    _run("cpu", interpret=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU fast path)")
@pytest.mark.gpu
def test_recorded_launches_compute_what_triton_computes_on_gpu():
    pytest.importorskip("triton")
    _run("cuda", interpret=False)


_OP_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {repo!r})
    import efla.ops as ops
    from efla import environment

    def run(rule, seed, B, varlen):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        T, H, K = 2048, 16, 128  # the shapes the benchmarks compile for
        q, k, v = (torch.randn(B, T, H, K, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(3))
        beta = torch.rand(B, T, H, device="cuda", generator=gen).bfloat16().requires_grad_()
        g = (-torch.rand(B, T, H, device="cuda", generator=gen)).requires_grad_()
        cu = torch.tensor([0, 100, 1000, T], device="cuda") if varlen else None
        h0 = torch.randn(3 if varlen else B, H, K, K, device="cuda", generator=gen).requires_grad_()
        state = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, use_q_l2norm_in_kernel=True)
        if rule == "efla":
            o, ht = ops.chunk_efla(q, k, v, beta, **state)
        else:
            o, ht = ops.chunk_gated_efla(q, k, v, g, beta, **state)
        (o.float().square().sum() + ht.square().sum()).backward()
        leaves = (q, k, v, beta, h0) + ((g,) if rule != "efla" else ())
        return [o.detach(), ht.detach()] + [x.grad for x in leaves]

    for rule in ("efla", "gated_efla"):
        for B, varlen in ((2, False), (1, True), (3, False)):
            with environment.override(EFLA_DIRECT_LAUNCH=True):
                run(rule, 0, B, varlen)  # records every launch (or replays one recorded at another shape)
                replayed = run(rule, 1, B, varlen)
            with environment.override(EFLA_DIRECT_LAUNCH=False):
                through_triton = run(rule, 1, B, varlen)
            for a, b in zip(replayed, through_triton):
                assert torch.equal(a, b), (rule, B, varlen, (a.float() - b.float()).abs().max())
    print("OK")
    """
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU fast path)")
@pytest.mark.gpu
def test_chunk_ops_replayed_equal_the_ops_through_triton_on_gpu():
    pytest.importorskip("fla")
    script, env = _OP_SCRIPT.format(repo=REPO), dict(os.environ, EFLA_DIRECT_LAUNCH="1")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


# Triton's own launch path with a stand-in driver and compiled kernel (no GPU; stand_in_driver.py).
# Each stage is launched through Triton, then recorded, then replayed, over inputs whose batch,
# length, packing and optional tensors change.
_VECTOR_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    os.environ.pop("TRITON_INTERPRET", None)  # before Triton's import
    sys.path.insert(0, {repo!r})
    from efla import environment
    from efla.ops.cuda import chunk as C, launch as L, stages as st
    from efla.ops.cuda.experimental import split_state
    from efla.ops.cuda.experimental.fused_forward import state_output
    from tests.ops import stand_in_driver
    from tests.ops.stand_in_driver import launches

    stand_in_driver.install()

    def case(B, T, varlen, with_state, gated):
        gen = torch.Generator().manual_seed(B * T)
        t = lambda *shape, dtype=torch.bfloat16: torch.randn(*shape, generator=gen).to(dtype)
        H, K, V = 4, 64, 128
        q, k, w, dq, dk = (t(B, T, H, K) for _ in range(5))
        v, u, do = (t(B, T, H, V) for _ in range(3))
        beta, A = t(B, T, H), t(B, T, H, 64)
        g = t(B, T, H, dtype=torch.float32) if gated else None
        cu = torch.tensor([0, 1, 65, T // 2, T]) if varlen else None
        ci = C.FLA["prepare_chunk_indices"](cu, 64) if varlen else None
        N = len(cu) - 1 if varlen else B
        NT = len(ci) if varlen else -(-T // 64)
        h, dh = t(B, NT, H, K, V), t(B, NT, H, K, V)
        h0 = t(N, H, K, V, dtype=torch.float32) if with_state else None
        stages = dict(
            wy_prepare=lambda: st.wy_prepare(k, v, beta, g, cu, ci),
            delta_w_u=lambda: st.delta_w_u(k, v, beta, A, cu, ci),
            state_pass=lambda: st.state_pass(k, w, u, g, h0, cu, ci, with_state),
            state_grads=lambda: st.state_grads(q, k, w, g, h0, h0, do, u, 0.125, cu, ci),
            output=lambda: st.output(q, k, u, h, g, 0.125, cu, ci),
            local_dv=lambda: st.local_dv(q, k, do, g, 0.125, cu, ci),
            delta_dqkw=lambda: st.delta_dqkw(q, k, u, w, h, do, dh, u, 0.125, cu, ci),
            delta_wy_grads=lambda: st.delta_wy_grads(k, v, beta, A, w, u, cu, ci),
            fused_forward=lambda: state_output(q, k, w, u, g, h0, 0.125, cu, with_state),
            split_state=lambda: split_state.entering_states(k, w, u, g, None if h0 is None else h0[:B], 2),
            split_state_grads=lambda: split_state.gradients_from_the_right(
                q, k, w, g, None if h0 is None else h0[:B], do, u, 0.125, 2
            ),
            coef_fwd=lambda: C.coef_fwd(k, beta, q=q),
            coef_bwd=lambda: C.coef_bwd(k, beta, beta, dk, dk_more=w, q=q, q_rstd=beta.float(), dq=dq),
        )
        if gated:
            stages.update(
                gated_w_u=lambda: st.gated_w_u(k, v, beta, A, g, cu, ci),
                gated_wy_grads=lambda: st.gated_wy_grads(k, v, beta, A, g, w, u, cu, ci),
                local_cumsum=lambda: st.local_cumsum(g, cu, ci, reverse=True),
                gated_dqkwg=lambda: C.gated_dqkwg(q, k, u, g, h, do, dh, u, 0.125, cu, ci),
                gated_coef_fwd=lambda: C.coef_fwd(k, beta, g=g, v=v, q=q),
            )
        inputs = dict(q=q, k=k, w=w, dq=dq, dk=dk, v=v, u=u, do=do, beta=beta, A=A, g=g, cu=cu, ci=ci, h=h, dh=dh, h0=h0)
        return stages, inputs

    def described(fn, inputs):
        launches.clear()
        fn()
        names = {{id(x): n for n, x in inputs.items() if x is not None}}
        fresh = {{}}  # tensors the stage allocated, by order of first appearance

        def label(x):
            if isinstance(x, torch.Tensor):
                return names.get(id(x)) or ("new", fresh.setdefault(id(x), len(fresh)), tuple(x.shape), x.dtype, x.stride())
            return (type(x), x)

        return [(grid, stream, tuple(label(x) for x in values), warps) for grid, stream, values, warps in launches]

    C.load()
    checked = 0
    for B, T, varlen, with_state, gated in [(2, 256, False, False, False), (3, 256, False, True, True),
                                            (1, 200, True, True, True), (1, 200, True, False, False),
                                            (1, 300, True, True, True), (2, 256, False, False, True)]:
        stages, inputs = case(B, T, varlen, with_state, gated)
        for name, fn in stages.items():
            with environment.override(EFLA_DIRECT_LAUNCH=False):
                through_triton = described(fn, inputs)
            with environment.override(EFLA_DIRECT_LAUNCH=True):
                first, replayed = described(fn, inputs), described(fn, inputs)
            assert through_triton == first == replayed, (name, B, T, varlen, through_triton, replayed)
            checked += len(replayed)
    records = [r for r in L._records.values() if r is not L._NO_RECORD]
    assert records and len(records) == len(L._records), L._records
    print("checked", checked, "launches;", len(records), "records")
    print("OK")
    """
)


@pytest.mark.skipif(not _FLA_OK, reason=_FLA_WHY)
def test_replayed_launches_pass_what_triton_passes():
    script = _VECTOR_SCRIPT.format(repo=REPO)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
