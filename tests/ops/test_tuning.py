"""``efla.ops.cuda.experimental.tuning``: with ``EFLA_STATE_TUNING=1`` the state passes get a launch setting per
bucket of sequences x heads, each bucket's own, also through Triton's disk cache."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.interpreter import interpreter_ready

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OK, _WHY = interpreter_ready()

# Triton's own launch path with a stand-in driver and compiled kernel (no GPU; stand_in_driver.py):
# the stand-in timings make fla's autotuners and bucket 4's pick the first setting, bucket 8's the last.
_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    os.environ.pop("TRITON_INTERPRET", None)  # before Triton's import
    sys.path.insert(0, {repo!r})
    from triton import knobs
    from triton.runtime.autotuner import Autotuner
    from efla import environment
    from efla.ops.cuda import stages as st
    from efla.ops.cuda.experimental import tuning
    from tests.ops import stand_in_driver
    from tests.ops.stand_in_driver import launches

    stand_in_driver.install()
    knobs.autotuning.cache = True  # results to Triton's disk cache too (this test's own directory)
    benched = []

    def bench(self, *args, config, **kwargs):
        benched.append(self)
        i = self.configs.index(config)
        return [float(-i if getattr(self, "bucket", 0) == 8 else i)] * 3

    Autotuner._bench = bench

    def stage_launches(B, H, tuned, T=128):
        gen = torch.Generator().manual_seed(0)
        K, V = 64, 128
        t = lambda *shape: torch.randn(*shape, generator=gen).bfloat16()
        k, w, q, u, do = t(B, T, H, K), t(B, T, H, K), t(B, T, H, K), t(B, T, H, V), t(B, T, H, V)
        h0 = torch.randn(B, H, K, V, generator=gen)
        launches.clear()
        with environment.override(EFLA_STATE_TUNING=tuned):
            st.state_pass(k, w, u, None, h0, None, None, True)
            st.state_grads(q, k, w, None, h0, h0, do, u, 0.125, None, None)
        shape = lambda x: (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
        return [(grid, warps, tuple(map(shape, values))) for grid, _, values, warps in launches]

    def setting(name, which, sequence_heads, V=128):
        config = st.kernels()[name].fn.configs[which]
        bv = config.kwargs.get("BV", 64)
        return (-(-V // bv) * sequence_heads, 1, 1), config.num_warps

    first = [setting("fwd_h", 0, 4), setting("bwd_dhu", 0, 4)]
    fla_small = stage_launches(1, 4, tuned=False)
    assert [(g, w) for g, w, _ in fla_small] == first, fla_small
    assert stage_launches(1, 4, tuned=True) == fla_small  # bucket 4 chose what fla's autotuner chose
    last = [setting("fwd_h", -1, 8), setting("bwd_dhu", -1, 8)]
    assert first[0][1] != last[0][1] or first[0][0] != setting("fwd_h", 0, 8)[0]  # the settings differ
    tuned_large = stage_launches(2, 4, tuned=True)
    assert [(g, w) for g, w, _ in tuned_large] == last, tuned_large
    fla_large = stage_launches(2, 4, tuned=False)  # fla's tuner keeps its first shape's setting
    assert [(g, w) for g, w, _ in fla_large] == [setting("fwd_h", 0, 8), setting("bwd_dhu", 0, 8)]
    n = len(benched)
    longer = stage_launches(2, 4, tuned=True, T=320)  # the same bucket at another length: tuned once
    assert [(g, w) for g, w, _ in longer] == last, longer
    assert len(benched) == n, "a bucket was tuned twice"
    # a fresh process's tuners (here: fresh ones, nothing timed) find each bucket's own results on disk
    tuning._tuned.clear()
    Autotuner._bench = lambda *a, **k: (_ for _ in ()).throw(AssertionError("timed again"))
    assert stage_launches(1, 4, tuned=True) == fla_small
    assert stage_launches(2, 4, tuned=True) == tuned_large
    print("OK")
    """
)


@pytest.mark.skipif(not _OK, reason=_WHY)
def test_state_passes_are_tuned_per_bucket_of_sequence_heads(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path), EFLA_DIRECT_LAUNCH="0")  # every launch through the autotuners
    r = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(repo=REPO)], env=env, capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


_GPU_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {repo!r})
    import efla.ops as ops
    from efla import environment

    def run(rule, B, H, varlen):
        gen = torch.Generator(device="cuda").manual_seed(B * H)
        T, K = 1024, 128
        q, k, v = (torch.randn(B, T, H, K, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(3))
        beta = torch.rand(B, T, H, device="cuda", generator=gen).bfloat16().requires_grad_()
        g = (-torch.rand(B, T, H, device="cuda", generator=gen)).requires_grad_()
        cu = torch.tensor([0, 100, 700, T], device="cuda") if varlen else None
        h0 = torch.randn(3 if varlen else B, H, K, K, device="cuda", generator=gen).requires_grad_()
        state = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, use_q_l2norm_in_kernel=True)
        if rule == "efla":
            o, ht = ops.chunk_efla(q, k, v, beta, **state)
        else:
            o, ht = ops.chunk_gated_efla(q, k, v, g, beta, **state)
        (o.float().square().sum() + ht.square().sum()).backward()
        leaves = (q, k, v, beta, h0) + ((g,) if rule != "efla" else ())
        return [o.detach(), ht.detach()] + [x.grad for x in leaves]

    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
    for rule in ("efla", "gated_efla"):
        for B, H, varlen in ((1, 4, False), (8, 16, False), (1, 16, True)):
            with environment.override(EFLA_STATE_TUNING=True):
                tuned = run(rule, B, H, varlen)
            with environment.override(EFLA_STATE_TUNING=False):
                plain = run(rule, B, H, varlen)
            for a, b in zip(tuned, plain):
                assert rel(a, b) < 1e-3, (rule, B, H, varlen, rel(a, b))
    print("OK")
    """
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU fast path)")
@pytest.mark.gpu
def test_tuned_state_passes_compute_what_fla_tuned_ones_do_on_gpu():
    pytest.importorskip("fla")
    script = _GPU_SCRIPT.format(repo=REPO)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
