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
    from efla.ops.cuda import launch as L

    def run(rule, seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        B, T, H, K = 2, 2048, 16, 128  # the shapes the benchmarks compile for
        q, k, v = (torch.randn(B, T, H, K, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(3))
        beta = torch.rand(B, T, H, device="cuda", generator=gen).bfloat16().requires_grad_()
        g = (-torch.rand(B, T, H, device="cuda", generator=gen)).requires_grad_()
        if rule == "efla":
            o, _ = ops.chunk_efla(q, k, v, beta, use_q_l2norm_in_kernel=True)
        else:
            o, _ = ops.chunk_gated_efla(q, k, v, g, beta, use_q_l2norm_in_kernel=True)
        o.float().square().sum().backward()
        leaves = (q, k, v, beta) + ((g,) if rule != "efla" else ())
        return [o.detach()] + [x.grad for x in leaves]

    for rule in ("efla", "gated_efla"):
        run(rule, 0)  # records every launch
        replayed = run(rule, 1)
        L._records.clear()
        through_triton = run(rule, 1)
        for a, b in zip(replayed, through_triton):
            assert torch.equal(a, b), (rule, (a.float() - b.float()).abs().max())
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
