"""Every launch setting of our autotuned GPU kernels, at small, mixed and the largest head sizes.

The autotuner times each setting once on a new shape; a setting that faults or computes something
else then crashes or corrupts a user's first call at that head size. Tests that check results run
only the first setting (``EFLA_TEST_FIRST_CONFIG``), so this file runs each setting explicitly:
every ``gated_dqkwg`` and ``coef_bwd`` setting, each one synchronised (a fault names its setting),
against the first one.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # no Triton (CPU machines): every test here is skipped anyway
    OutOfResources = RuntimeError

CUDA = torch.cuda.is_available()
DEVICE = "cuda"  # Triton's CPU interpreter runs these on "cpu" (tried by hand; too slow for CI)
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (GPU fast path)")
# small value heads (blocks fitted below their width), one that is not a power of two, K != V, the
# largest heads; every case compiles
# each setting anew, so the list stays short
HEAD_DIMS = [(32, 32), (64, 96), (64, 128), (256, 256), (32, 256)]


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _stage(name, fn, *args, **kwargs):
    out = fn(*args, **kwargs)
    try:
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    except RuntimeError as e:  # a fault is sticky: name the stage, stop the test
        pytest.fail(f"{name} faulted: {e}")
    return out


def _gated_backward_inputs(K, V, B=2, T=200, H=2):
    """Random tensors shaped as ``gated_bwd`` hands them to ``gated_dqkwg`` and ``coef_bwd`` (the
    kernels' arithmetic does not depend on where the values come from; fla's stages, which would
    autotune at every new head size, are left out)."""
    from efla.ops.cuda import chunk as ch

    gen = torch.Generator(device=DEVICE).manual_seed(K * 1000 + V)
    NT = -(-T // ch.CHUNK)

    def rnd(*shape, scale=1.0, dtype=torch.bfloat16):
        return (scale * torch.randn(*shape, device=DEVICE, generator=gen)).to(dtype)

    q, k, v_new, do, dv = rnd(B, T, H, K), rnd(B, T, H, K, scale=K**-0.5), rnd(B, T, H, V), rnd(B, T, H, V), rnd(B, T, H, V)
    h, dh = rnd(B, NT, H, K, V, scale=0.3), rnd(B, NT, H, K, V, scale=0.3)
    log_decay = F.logsigmoid(2 + 3 * torch.randn(B, T, H, device=DEVICE, generator=gen))
    # the chunk-local cumulative sum of the decay, in log2 units, as the forward leaves it
    gcum = F.pad(log_decay, (0, 0, 0, NT * ch.CHUNK - T)).view(B, NT, ch.CHUNK, H).cumsum(2)
    gcum = (gcum.view(B, NT * ch.CHUNK, H)[:, :T] / math.log(2)).contiguous()
    dqkwg_args = (q, k, v_new, gcum, h, do, dh, dv, K**-0.5, None, None)
    coef_args = dict(
        k=k,
        beta=torch.sigmoid(rnd(B, T, H)),
        g=log_decay,
        v=v_new,
        derase=rnd(B, T, H),
        dgl=torch.randn_like(log_decay),
        dvin=rnd(B, T, H, V),
        dk=rnd(B, T, H, K),
        dk_more=rnd(B, T, H, K),
    )
    return dqkwg_args, coef_args


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("K,V", HEAD_DIMS)
def test_every_dqkwg_setting_runs_and_agrees(K, V):
    from efla.ops.cuda import chunk as ch
    from efla.ops.cuda import kernels as kn

    dqkwg_args, _ = _gated_backward_inputs(K, V)
    settings = kn.dqkwg_configs(V)
    assert all(c.kwargs["BV"] <= max(16, V) for c in settings)
    ran = []
    for c in settings:
        launch = dict(BV=c.kwargs["BV"], num_warps=c.num_warps, num_stages=c.num_stages)
        try:
            ran.append((c, _stage(f"gated_dqkwg {launch}", ch.gated_dqkwg, *dqkwg_args, launch=launch)))
        except OutOfResources:
            # more shared memory than the GPU has: the autotuner skips such a setting. On an H200 only
            # value blocks of 128 with 3 stages at V = 256 and K >= 128 (278,544 bytes of 232,448;
            # benchmarks/kernel_resources.py); nothing may be skipped at heads up to 128
            assert max(K, V) > 128 and c is not settings[0], f"{launch} does not fit the GPU at K={K}, V={V}"
    first = ran[0][1]
    for c, out in ran[1:]:
        for name, a, b in zip(("dq", "dk", "dw", "dg"), out, first):
            assert _rel(a, b) < 1e-2, (c, name)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("K,V", [(32, 32), (256, 256)])
@pytest.mark.parametrize("gated", [False, True])
def test_every_coefficient_backward_setting_runs_and_agrees(K, V, gated):
    from efla.ops.cuda import chunk as ch
    from efla.ops.cuda import kernels as kn

    _, a = _gated_backward_inputs(K, V)
    # the gated op adds the WY backward's part of dk in this pass
    extra = dict(g=a["g"], v=a["v"], dgl=a["dgl"], dvin=a["dvin"], dk_more=a["dk_more"]) if gated else {}
    outputs = []
    for c in kn.COEF_BWD_CONFIGS:
        launch = (c.kwargs["BR"], c.num_warps, c.kwargs["BC"])
        dk = a["dk"].clone()  # updated in place
        out = _stage(f"coef_bwd {launch}", ch.coef_bwd, a["k"], a["beta"], a["derase"], dk, launch=launch, **extra)
        outputs.append((dk, *(out if gated else (out,))))
    for c, out in zip(kn.COEF_BWD_CONFIGS[1:], outputs[1:]):
        for a_, b_ in zip(out, outputs[0]):
            assert _rel(a_.float(), b_.float()) < 1e-3, c
