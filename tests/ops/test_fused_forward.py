"""The chunk forward's state and output passes as one kernel (``EFLA_FUSED_FORWARD=1``).

Under Triton's CPU interpreter, in float32 (its products of bf16 tiles are wrong, so bf16 runs on
a GPU only): the kernel, fed the chunkwise WY form (or its ``A``) built here in float64, gives the
float64 per-token scan's outputs and final states, EFLA with stiff keys and Gated EFLA, dense and
varlen, head sizes that are not powers of two. On a GPU (bf16): the whole chunk ops with the fused
forward against the float64 reference and against the ops without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from efla import environment
from tests.interpreter import interpreter_ready

REPO = Path(__file__).resolve().parents[2]
_OK, _WHY = interpreter_ready(packages=("triton",))

_SCRIPT = textwrap.dedent(
    """
    import math, sys, torch
    sys.path.insert(0, {repo!r})
    import efla.ops as ops
    from efla.ops.coefficients import coefficients
    from efla.ops.cuda.experimental.fused_forward import state_output

    CHUNK = 64

    def wy_form(k, b, v, gam):
        # per chunk: A = (I + strict_tril(diag(b) k k^T * e^(G_i - G_j)))^-1, w = A diag(b e^G) k, u = A diag(b) v
        B, T, H, K = k.shape
        w, u, gcum = torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(b)
        for s in range(0, T, CHUNK):
            kc, bc, vc = k[:, s:s + CHUNK], b[:, s:s + CHUNK], v[:, s:s + CHUNK]
            G = gam[:, s:s + CHUNK].cumsum(1)
            L = kc.shape[1]
            Gh = G.transpose(1, 2)
            kk = torch.einsum("bihk,bjhk->bhij", kc, kc) * (Gh[..., :, None] - Gh[..., None, :]).exp()
            M = torch.tril(kk * bc.transpose(1, 2)[..., :, None], -1)
            A = torch.linalg.inv(torch.eye(L, dtype=k.dtype) + M)
            w[:, s:s + CHUNK] = torch.einsum("bhij,bjhk->bihk", A, kc * (bc * G.exp())[..., None])
            u[:, s:s + CHUNK] = torch.einsum("bhij,bjhv->bihv", A, vc * bc[..., None])
            gcum[:, s:s + CHUNK] = G
        return w, u, gcum

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    def check(rule, B, T, H, K, V, cu=None, seed=0):
        torch.manual_seed(seed)
        gated = rule == "gated_efla"
        q = torch.randn(B, T, H, K, dtype=torch.float64)
        stiff = torch.empty(B, T, H, 1, dtype=torch.float64).uniform_(-1, 2).exp2().pow(3.3)  # ||k||^2 over 6 decades
        k = torch.randn(B, T, H, K, dtype=torch.float64) * stiff
        v = torch.randn(B, T, H, V, dtype=torch.float64)
        beta = torch.rand(B, T, H, dtype=torch.float64)
        g = -torch.rand(B, T, H, dtype=torch.float64) * 2 if gated else None
        N = B if cu is None else len(cu) - 1
        h0 = torch.randn(N, H, K, V, dtype=torch.float64)
        gam, erase, write = coefficients(rule, k, beta, g)
        gam = gam if gated else torch.zeros_like(beta)
        vp = v * (write / erase)[..., None]
        if cu is None:
            w, u, gcum = wy_form(k, erase, vp, gam)
        else:  # chunks restart at each sequence
            parts = [wy_form(k[:, a:b], erase[:, a:b], vp[:, a:b], gam[:, a:b]) for a, b in zip(cu[:-1], cu[1:])]
            w, u, gcum = (torch.cat(p, 1) for p in zip(*parts))
        f = lambda x: x.float().contiguous()
        o, ht = state_output(f(q), f(k), f(w), f(u), f(gcum / math.log(2)) if gated else None, f(h0), 0.3,
                             None if cu is None else torch.tensor(cu), True)
        scan = getattr(ops, "recurrent_" + rule)
        args = (q, k, v, g, beta) if gated else (q, k, v, beta)
        ro, rS = scan(*args, scale=0.3, initial_state=h0, output_final_state=True,
                      cu_seqlens=None if cu is None else torch.tensor(cu))
        eo, eS = rel(o, ro), rel(ht, rS)
        assert eo < 1e-4 and eS < 1e-4, (rule, B, T, H, K, V, cu, eo, eS)
        return eo, eS

    for rule in ("efla", "gated_efla"):
        print(rule, check(rule, 2, 150, 2, 32, 16))  # three chunks, the last partial; V below the value block
        print(rule, check(rule, 1, 150, 2, 24, 40, cu=[0, 37, 101, 150]))  # varlen; K, V not powers of 2
        print(rule, check(rule, 1, 64, 1, 16, 64))  # one full chunk, two value blocks
    print("OK")
    """
)


def _run_script():
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = _SCRIPT.format(repo=str(REPO))
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.skipif(not _OK, reason=_WHY)
def test_fused_state_and_output_match_the_float64_scan_under_triton_interpreter():
    r = _run_script()
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU fast path)")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rule", ["efla", "gated_efla"])
@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_fused_forward_matches_reference_and_the_unfused_op(rule, varlen):
    import efla.ops as ops

    torch.manual_seed(1)
    gated = rule == "gated_efla"
    B, T, H, K, V = (1, 300, 4, 128, 128) if varlen else (2, 200, 4, 128, 128)
    cu = [0, 70, 200, 300] if varlen else None
    N = B if cu is None else len(cu) - 1
    stiff = torch.empty(B, T, H, 1).uniform_(-1, 2).exp2().pow(3.3)
    inputs = [torch.randn(B, T, H, K), torch.randn(B, T, H, K) * stiff, torch.randn(B, T, H, V)]
    inputs += [-torch.rand(B, T, H) * 2] if gated else []
    inputs += [torch.rand(B, T, H)]
    inputs = [x.to("cuda", torch.bfloat16) for x in inputs]
    h0 = None if varlen else torch.randn(N, H, K, V, device="cuda")  # both paths of the initial state
    kw = dict(scale=K**-0.5, output_final_state=True)

    def run(fused):
        cu_gpu = None if cu is None else torch.tensor(cu, device="cuda", dtype=torch.int32)
        with environment.override(EFLA_FUSED_FORWARD=fused):
            return getattr(ops, "chunk_" + rule)(*inputs, initial_state=h0, cu_seqlens=cu_gpu, **kw)

    (o, S), (o0, S0) = run(True), run(False)
    reference = getattr(ops, "recurrent_" + rule)
    cu_cpu = None if cu is None else torch.tensor(cu)
    h0_cpu = None if h0 is None else h0.double().cpu()
    ro, rS = reference(*(x.double().cpu() for x in inputs), initial_state=h0_cpu, cu_seqlens=cu_cpu, **kw)
    rel = lambda a, b: ((a.double().cpu() - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(o, ro) < 2e-2 and rel(S, rS) < 2e-2
    assert rel(o, o0.double().cpu()) < 5e-3 and rel(S, S0.double().cpu()) < 1e-3


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("K, V", [(128, 128), (64, 96), (256, 256)])
def test_gpu_every_fused_forward_setting_matches_fla_passes(gated, K, V, monkeypatch, switches):
    """Each launch setting the kernel tunes over against fla's state and output
    kernels on the same inputs (the autotuner runs one setting per shape; a wrong one would
    reach a user only at the head size where it wins)."""
    from triton.runtime.errors import OutOfResources

    from efla.ops.cuda import stages as st
    from efla.ops.cuda.experimental import fused_forward as ff

    switches(EFLA_DIRECT_LAUNCH=False)  # every call through the autotuner, one setting at a time
    gen = torch.Generator(device="cuda").manual_seed(K + V)
    B, T, H, scale = 2, 200, 2, K**-0.5
    q, k = (torch.randn(B, T, H, K, device="cuda", generator=gen).bfloat16() for _ in range(2))
    k = (k.float() * K**-0.5).bfloat16()
    v = torch.randn(B, T, H, V, device="cuda", generator=gen).bfloat16()
    beta = torch.rand(B, T, H, device="cuda", generator=gen).bfloat16()
    h0 = torch.randn(B, H, K, V, device="cuda", generator=gen)
    gcum = None
    if gated:  # the chunk-local cumsum of a log decay, in log2 units, as the forward makes it
        decay = torch.nn.functional.logsigmoid(2 + 3 * torch.randn(B, T, H, device="cuda", generator=gen))
        gcum = st.local_cumsum(decay, None, None, scale=st.RCP_LN2)
    w, u, _ = st.wy_prepare(k, v, beta, gcum, None, None)
    h, v_new, ref_ht = st.state_pass(k, w, u, gcum, h0, None, None, True)
    ref_o = st.output(q, k, v_new, h, gcum, scale, None, None)
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()  # noqa: E731

    tuner = ff.state_output_fwd_kernel.fn
    monkeypatch.setattr(tuner, "cache", {})  # no tuned choice of this test outlives it
    ran = 0
    for config in ff._settings_that_hold_their_state(list(tuner.configs), {}, K=K):
        monkeypatch.setattr(tuner, "configs", [config])
        tuner.cache.clear()
        try:
            o, ht = ff.state_output(q, k, w, u, gcum, h0, scale, None, True)
            torch.cuda.synchronize()
        except OutOfResources:  # the autotuner skips a setting that does not fit the GPU
            continue
        assert rel(o, ref_o) < 5e-3 and rel(ht, ref_ht) < 1e-3, config
        ran += 1
    assert ran > 0
