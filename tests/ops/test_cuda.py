"""GPU path of efla.ops (efla/ops/cuda): bf16 on CUDA vs the float64 CPU reference.

* GPU tests skip on machines without CUDA.
* Interpreter tests run our Triton kernels on the CPU under ``TRITON_INTERPRET=1`` (in a
  subprocess, since the variable must be set before Triton compiles anything); they skip when
  Triton is not installed (CI does not install it) or when NumPy is too new for Triton's
  interpreter.
* Always: the package imports and dispatches without Triton or flash-linear-attention.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import efla.ops as ops
from efla import environment
from tests.interpreter import interpreter_ready

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (GPU fast path)")
RULES = ["efla", "gated_efla", "delta_rule", "gated_delta_rule"]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _inputs(B, T, H, K, V, N, rule, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g)
    k = torch.randn(B, T, H, K, generator=g) / K**0.5
    if rule.endswith("efla"):  # stiff keys: ||k||^2 log-uniform in [1e-2, 1e4]
        k = k * 10 ** (torch.rand(B, T, H, 1, generator=g) * 3 - 1)
    else:
        k = F.normalize(k, dim=-1)
    v = torch.randn(B, T, H, V, generator=g)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g))
    lg = F.logsigmoid(2 + 3 * torch.randn(B, T, H, generator=g))
    h0 = 0.5 * torch.randn(N, H, K, V, generator=g)
    return q, k, v, beta, lg, h0


def _call(fn, rule, q, k, v, beta, g, h0, cu):
    if rule.startswith("gated"):
        return fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    return fn(q, k, v, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)


# ----------------------------------------------------------------------------- always
def test_import_without_gpu_stack():
    """`import efla` and the CPU ops never need Triton or fla; the backend module imports bare."""
    import efla  # noqa: F401
    from efla.ops import cuda as backend

    assert callable(backend.dispatch)
    q, k, v, beta, g, h0 = _inputs(1, 5, 1, 8, 8, 1, "efla")
    o, S = ops.chunk_efla(q, k, v, beta, initial_state=h0, output_final_state=True)
    assert o.shape == v.shape and S.shape == h0.shape


def test_dispatch_declines_cpu_and_float32():
    from efla.ops.cuda import dispatch

    q, k, v, beta, g, h0 = _inputs(1, 4, 1, 8, 8, 1, "efla")
    assert dispatch("efla", "chunk", q, k, v, None, beta, 0.3, None, False, None) is None
    with pytest.raises(ValueError):
        dispatch("bogus", "chunk", q, k, v, None, beta, 0.3, None, False, None)


def test_unsupported_inputs_are_named_and_warned_about_once():
    from efla.ops.cuda import fall_back, unsupported

    q, k, v = (torch.zeros(1, 2, 1, d, dtype=torch.bfloat16) for d in (64, 64, 128))
    assert unsupported(q, k, v) is None
    assert "head dims up to 256 (got K=320, V=128)" in unsupported(torch.zeros(1, 2, 1, 320, dtype=torch.bfloat16), k, v)
    assert "(got torch.float32" in unsupported(q.float(), k.float(), v.float())
    reason = "a reason only this test gives"
    with pytest.warns(RuntimeWarning, match="a reason only this test gives; running the PyTorch path"):
        assert fall_back(reason) is None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fall_back(reason) is None  # the second time: no warning


# ----------------------------------------------------------------------------- GPU
@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_matches_reference(rule, varlen):
    """bf16 GPU chunk (with grads) and recurrent (no grad) vs the float64 CPU scan."""
    _check_gpu_against_reference(rule, varlen, K=64, V=64)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["efla", "gated_efla"])
@pytest.mark.parametrize("K,V", [(32, 32), (64, 128), (128, 64), (256, 256), (32, 256)])
def test_gpu_head_dims(rule, K, V):
    _check_gpu_against_reference(rule, False, K=K, V=V)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["efla", "gated_efla"])
def test_gpu_ops_run_on_their_inputs_device_not_the_current_one(rule):
    assert torch.cuda.current_device() == 0
    _check_gpu_against_reference(rule, True, K=64, V=64, device="cuda:1")


def _check_gpu_against_reference(rule, varlen, K, V, device="cuda"):
    if varlen:
        B, T, H, cu = 1, 150, 2, [0, 37, 38, 150]
    else:
        B, T, H, cu = 2, 100, 2, None
    N = B if cu is None else len(cu) - 1
    gated = rule.startswith("gated")
    xs = _inputs(B, T, H, K, V, N, rule, seed=3)
    names = ["q", "k", "v", "beta", "g", "h0"]
    dev = [x.to(device, torch.bfloat16) for x in xs[:5]] + [xs[5].to(device)]
    ref_in = [x.cpu().double().requires_grad_() for x in dev]
    gen = torch.Generator().manual_seed(7)
    do, dS = torch.randn(B, T, H, V, generator=gen), torch.randn(N, H, K, V, generator=gen)
    cu_cpu = torch.tensor(cu) if cu else None
    ro, rS = _call(getattr(ops, "recurrent_" + rule), rule, *ref_in, cu_cpu)
    rgrads = torch.autograd.grad((ro * do.double()).sum() + (rS * dS.double()).sum(), ref_in, allow_unused=True)

    gin = [x.detach().clone().requires_grad_() for x in dev]
    cu_gpu = cu_cpu.to(device, torch.int32) if cu else None
    o, S = _call(getattr(ops, "chunk_" + rule), rule, *gin, cu_gpu)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    loss = (o.float() * do.to(device)).sum() + (S * dS.to(device)).sum()
    grads = torch.autograd.grad(loss, gin, allow_unused=True)
    assert _rel(o, ro) < 2e-2 and _rel(S, rS) < 2e-2
    for n, a, b in zip(names, grads, rgrads):
        if n == "g" and not gated:
            continue
        assert _rel(a, b) < 2e-2, n

    with torch.no_grad():
        o2, S2 = _call(getattr(ops, "recurrent_" + rule), rule, *[x.detach() for x in dev], cu_gpu)
    assert _rel(o2, ro) < 2e-2 and _rel(S2, rS) < 2e-2


@needs_cuda
@pytest.mark.gpu
def test_gpu_declines_float32_and_big_heads():
    from efla.ops.cuda import dispatch

    q, k, v, beta, g, h0 = (x.cuda() for x in _inputs(1, 8, 1, 16, 16, 1, "efla"))
    assert dispatch("efla", "chunk", q, k, v, None, beta, 0.25, None, False, None) is None
    big = torch.randn(1, 4, 1, 320, device="cuda", dtype=torch.bfloat16)
    vb = torch.randn(1, 4, 1, 16, device="cuda", dtype=torch.bfloat16)
    bb = torch.rand(1, 4, 1, device="cuda", dtype=torch.bfloat16)
    assert dispatch("efla", "chunk", big, big, vb, None, bb, 0.25, None, False, None) is None


# ----------------------------------------------------------------------------- interpreter
_OK, _WHY = interpreter_ready(packages=("triton",))

_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    sys.path.insert(0, {repo!r})
    from efla import environment
    from efla.ops.cuda import chunk as C
    from efla.ops.cuda.recurrent import recurrent_forward
    from efla.ops.coefficients import coefficients
    import efla.ops as ops
    torch.manual_seed(0)
    B, T, H, K, V = 2, 6, 2, 16, 8
    k = torch.randn(B, T, H, K) * torch.tensor([0.05, 20.0])[None, None, :, None]
    v, beta = torch.randn(B, T, H, V), torch.rand(B, T, H)
    g = -torch.rand(B, T, H) * 3
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    kd, bd, gd, vd = (x.double().requires_grad_() for x in (k, beta, g, v))
    # EFLA coefficient and its backward
    _, al, _ = coefficients("efla", kd, bd, None)
    assert rel(C.coef_fwd(k, beta), al.detach()) < 1e-5
    da = torch.randn(B, T, H).double()
    gk, gb = torch.autograd.grad((al * da).sum(), (kd, bd))
    dk = torch.zeros(B, T, H, K)
    db = C.coef_bwd(k, beta, da.float(), dk)
    assert rel(dk, gk) < 1e-4 and rel(db, gb) < 1e-4
    # Gated EFLA coefficients (erase, decay log, rescaled value) and their backward
    gam, e, w = coefficients("gated_efla", kd, bd, gd)
    c, gl, vp = C.coef_fwd(k, beta, g=g, v=v)
    vref = vd * (w / e)[..., None]
    assert rel(c, e.detach()) < 1e-5 and rel(gl, gam.detach()) < 1e-5 and rel(vp, vref.detach()) < 1e-5
    de, dgl, dvp = torch.randn(B, T, H).double(), torch.randn(B, T, H).double(), torch.randn(B, T, H, V).double()
    L = (e * de).sum() + (gam * dgl).sum() + (vref * dvp).sum()
    gk, gb, gg, gv = torch.autograd.grad(L, (kd, bd, gd, vd))
    dk = torch.zeros(B, T, H, K)
    db, dg, dv = C.coef_bwd(k, beta, de.float(), dk, g=g, v=v, dgl=dgl.float(), dvin=dvp.float())
    for a, b in ((dk, gk), (db, gb), (dg, gg), (dv, gv)):
        assert rel(a, b) < 1e-4, (rel(a, b))
    # the backward's other launch settings (the GPU autotunes over them) give the same results
    for launch in ((8, 4), (128, 4), (8, 4, 8), (64, 2, 4)):
        dk2 = torch.zeros(B, T, H, K)
        out = C.coef_bwd(k, beta, de.float(), dk2, g=g, v=v, dgl=dgl.float(), dvin=dvp.float(), launch=launch)
        for a, b in zip((dk2, *out), (dk, db, dg, dv)):
            assert torch.allclose(a, b, rtol=1e-6, atol=0), launch  # float64 sums in another order
    # a second part of dk (the gated op's WY backward) is added in the same pass
    more = torch.randn(B, T, H, K)
    dk3 = torch.zeros(B, T, H, K)
    out3 = C.coef_bwd(k, beta, de.float(), dk3, g=g, v=v, dgl=dgl.float(), dvin=dvp.float(), dk_more=more)
    assert torch.allclose(dk3, dk + more, rtol=1e-6, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(out3, (db, dg, dv)))
    # the queries' L2 normalisation in the same passes (fla's l2norm: q / sqrt(||q||^2 + 1e-6)), both rules
    qq = torch.randn(B, T, H, K) * 3
    qd = qq.double().requires_grad_()
    qn_ref = qd / (qd.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    dqn = torch.randn(B, T, H, K).double()
    dq_ref, = torch.autograd.grad((qn_ref * dqn).sum(), qd)
    for extra in ({{}}, dict(g=g, v=v)):
        coefs, qn, q_rstd = C.coef_fwd(k, beta, q=qq, **extra)
        plain = C.coef_fwd(k, beta, **extra)
        assert all(torch.equal(a, b) for a, b in zip(coefs if extra else [coefs], plain if extra else [plain]))
        assert rel(qn, qn_ref.detach()) < 1e-6
        assert rel(q_rstd, 1 / (qq.double().pow(2).sum(-1) + 1e-6).sqrt()) < 1e-6
        dq = dqn.float().clone()
        grads = dict(dgl=dgl.float(), dvin=dvp.float()) if extra else {{}}
        dk_q, dk_plain = torch.zeros(B, T, H, K), torch.zeros(B, T, H, K)
        out_q = C.coef_bwd(k, beta, de.float(), dk_q, q=qn, q_rstd=q_rstd, dq=dq, **extra, **grads)
        out_plain = C.coef_bwd(k, beta, de.float(), dk_plain, **extra, **grads)
        assert rel(dq, dq_ref) < 1e-5, rel(dq, dq_ref)
        assert torch.equal(dk_q, dk_plain)
        assert all(torch.equal(a, b) for a, b in zip(out_q if extra else [out_q], out_plain if extra else [out_plain]))
    # fused recurrent kernel, all rules, with initial state, varlen
    q = torch.randn(1, 9, H, K)
    kk = torch.randn(1, 9, H, K) * 3
    vv, bb, lg = torch.randn(1, 9, H, V), torch.rand(1, 9, H), -torch.rand(1, 9, H)
    cu = torch.tensor([0, 4, 9])
    h0 = torch.randn(2, H, K, V)
    for rule in ("efla", "gated_efla", "delta_rule", "gated_delta_rule"):
        gated = rule.startswith("gated")
        o, S = recurrent_forward(rule, q, kk, vv, lg if gated else None, bb, 0.3, h0, True, cu)
        a = [q.double(), kk.double(), vv.double()] + ([lg.double()] if gated else []) + [bb.double()]
        ro, rS = getattr(ops, "recurrent_" + rule)(*a, scale=0.3, initial_state=h0.double(),
                                                   output_final_state=True, cu_seqlens=cu)
        assert rel(o, ro) < 1e-4 and rel(S, rS) < 1e-4, rule
    # keys whose ||k||^2 overflows float32 (and a zero key): the exact rules' scan stays exact
    big = kk.clone()
    big[0, 2] *= 1e19
    big[0, 3] *= 1e19
    big[0, 6, 0] = 0.0
    b0 = bb.clone()
    b0[0, 3, 0] = 0.0  # beta = 0 and beta = 1e-45 (subnormal) with an overflowing key
    b0[0, 3, 1] = 1e-45
    for rule in ("efla", "gated_efla"):
        gated = rule.startswith("gated")
        o, S = recurrent_forward(rule, q, big, vv, lg if gated else None, b0, 0.3, h0, True, cu)
        a = [q.double(), big.double(), vv.double()] + ([lg.double()] if gated else []) + [b0.double()]
        ro, rS = getattr(ops, "recurrent_" + rule)(*a, scale=0.3, initial_state=h0.double(),
                                                   output_final_state=True, cu_seqlens=cu)
        assert rel(o, ro) < 1e-4 and rel(S, rS) < 1e-4, ("overflowing keys", rule, rel(o, ro))
    # ... and the chunk form's coefficient pass flags them, then refuses them with the CPU's error:
    # at the call with EFLA_CHECK_KEYS=sync,
    os.environ["EFLA_CHECK_KEYS"] = "sync"
    environment.reload()
    for gated in (False, True):
        extra = dict(g=g, v=v) if gated else {{}}
        flag = C.overflow_flag(k)
        C.coef_fwd(k, beta, overflow=flag, **extra)
        assert flag.item() == 0
        C.refuse_overflowing_keys(flag, k)
        huge = k.clone()
        huge[1, 4, 1] *= 1e19
        C.coef_fwd(huge, beta, overflow=flag, **extra)
        assert flag.item() == 1, gated
        try:
            C.refuse_overflowing_keys(flag, huge)
            raise AssertionError("overflowing keys were not refused")
        except ValueError as e:
            assert str(e).startswith("k: a key's squared norm ||k||^2 = "), e
        assert C.overflow_flag(k) is flag and flag.item() == 0  # one buffer, zeroed again for the next call
        C.coef_fwd(k, beta, overflow=flag, **extra)
        C.refuse_overflowing_keys(flag, k)
    # inside deferred_key_checks() the refusal waits for the block's end, which resets the flag
    reached = False
    try:
        with ops.deferred_key_checks():
            C.coef_fwd(huge, beta, overflow=flag)
            C.refuse_overflowing_keys(flag, huge)
            reached = True
        raise AssertionError("the block did not refuse overflowing keys")
    except ValueError as e:
        assert reached and "overflows float32" in str(e), e
    assert flag.item() == 0
    # by default at the next call that finds the flag's copy on the host (here at once: a CPU flag)
    os.environ["EFLA_CHECK_KEYS"] = "1"
    environment.reload()
    C.coef_fwd(huge, beta, overflow=flag)
    C.refuse_overflowing_keys(flag, huge)
    C.coef_fwd(k, beta, overflow=flag)
    try:
        C.refuse_overflowing_keys(flag, k)
        raise AssertionError("the later call did not refuse the earlier overflowing keys")
    except ValueError as e:
        assert "in an earlier chunk call" in str(e), e
    assert flag.item() == 0
    C.refuse_overflowing_keys(flag, k)
    ops.check_keys()
    os.environ["EFLA_CHECK_KEYS"] = "0"  # checks off: no flag, no sync, nothing refused
    environment.reload()
    assert C.overflow_flag(k) is None
    C.refuse_overflowing_keys(None, huge)
    print("OK")
    """
)


@pytest.mark.skipif(not _OK, reason=_WHY)
def test_kernels_under_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _SCRIPT.format(repo=REPO)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


# ----------------------------------------------------------------------------- coefficient gradients
# The backward of the coefficient kernel against mpmath over beta * ||k||^2 in [0, 1e4]: plain
# d alpha/d beta and d alpha/d k, gated d/d(beta, g, k) of the erase c and of r = w / c (the factor
# folded into the values). Keys are one-hot so lambda carries no rounding. Run under the Triton
# interpreter on the CPU, and on the GPU with the compiled kernel.
_COEF_GRAD_SCRIPT = textwrap.dedent(
    """
    import math, sys, torch
    sys.path.insert(0, {repo!r})
    from efla.ops.cuda import chunk as C
    from tests.ops import mp_reference as mp
    dev = {device!r}
    TINY = torch.finfo(torch.float32).tiny
    x = torch.cat([torch.zeros(1, dtype=torch.float64), torch.logspace(-6, 4, 60, dtype=torch.float64)])
    n, k0 = len(x), 2.0
    lam = k0 * k0

    def rel(got, want):
        # largest relative error where the true value is a normal float32; inf where a true
        # zero (r is constant in beta and k at g = 0) comes back as more than TINY
        got, want = got.double().cpu(), torch.tensor(want, dtype=torch.float64)
        if (got[want == 0].abs() > TINY).any():
            return math.inf
        normal = want.abs() >= TINY
        return ((got - want).abs() / want.abs())[normal].max().item() if normal.any() else 0.0

    def keys():
        k = torch.zeros(n, 1, 1, 4, device=dev)
        k[:, 0, 0, 0] = k0
        return k

    worst = 0.0
    beta = (x / lam).float()
    dk = torch.zeros(n, 1, 1, 4, device=dev)
    db = C.coef_bwd(keys(), beta.to(dev)[:, None, None].contiguous(), torch.ones(n, 1, 1, device=dev), dk)
    want = [mp.gradient(mp.erase, b, 0.0, lam) for b in beta.tolist()]
    worst = max(worst, rel(db.flatten(), [w[0] for w in want]), rel(dk[:, 0, 0, 0] / (2 * k0), [w[2] for w in want]))
    for g in (0.0, -1e-6, -0.01, -1.0, -5.0):
        beta = (x / (math.exp(g) * lam)).float().to(dev)[:, None, None].contiguous()
        gate = torch.full((n, 1, 1), g, device=dev)
        v = torch.zeros(n, 1, 1, 4, device=dev)
        v[..., 0] = 1.0
        for f in (mp.erase, mp.ratio):
            want = [mp.gradient(f, b, g, lam) for b in beta.flatten().tolist()]
            d_erase = torch.ones(n, 1, 1, device=dev) if f is mp.erase else torch.zeros(n, 1, 1, device=dev)
            d_vout = torch.zeros_like(v)
            if f is mp.ratio:
                d_vout[..., 0] = 1.0  # d loss / d r = sum(d_vout * v) = 1
            dk = torch.zeros(n, 1, 1, 4, device=dev)
            db, dg, _ = C.coef_bwd(keys(), beta, d_erase, dk, g=gate, v=v, dgl=torch.zeros(n, 1, 1, device=dev),
                                   dvin=d_vout)
            for got, col in ((db.flatten(), 0), (dg.flatten(), 1), (dk[:, 0, 0, 0] / (2 * k0), 2)):
                worst = max(worst, rel(got, [w[col] for w in want]))
    print("WORST", worst)
    assert worst < 1e-6, worst
    print("OK")
    """
)


def _run_coef_grad_script(device: str, interpret: bool):
    env = dict(os.environ, TRITON_INTERPRET="1") if interpret else dict(os.environ)
    r = subprocess.run(
        [sys.executable, "-c", _COEF_GRAD_SCRIPT.format(repo=REPO, device=device)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.skipif(not _OK, reason=_WHY)
def test_coefficient_gradients_float32_accurate_under_triton_interpreter():
    pytest.importorskip("mpmath")
    _run_coef_grad_script("cpu", interpret=True)


@needs_cuda
@pytest.mark.gpu
def test_coefficient_gradients_float32_accurate_on_gpu():
    pytest.importorskip("mpmath")
    _run_coef_grad_script("cuda", interpret=False)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_gpu_refuses_overflowing_keys_by_default(rule, mode):
    # without EFLA_CHECK_VALUES: a bf16 key whose ||k||^2 overflows float32 (fla's kernels would
    # return NaN) is refused, in bf16 and in the PyTorch path's float32; only the exact rules'
    # scan without autograd takes it (test_gpu_scan_is_exact_for_overflowing_keys)
    if mode == "recurrent" and "efla" in rule:
        pytest.skip("the exact rules' scan computes these keys exactly")
    for dtype, checks in ((torch.bfloat16, "sync"), (torch.bfloat16, "1"), (torch.float32, "1")):
        q, k, v, beta, g, _ = (x.cuda().to(dtype) for x in _inputs(1, 70, 2, 16, 16, 1, rule))
        k[0, 33, 1] *= 1e20
        checks_as_set = environment.override(EFLA_CHECK_VALUES=None, EFLA_CHECK_KEYS=checks)
        with checks_as_set, pytest.raises(ValueError, match=r"^k: a key's squared norm"):
            _call(getattr(ops, f"{mode}_{rule}"), rule, q, k, v, beta, g, None, None)
            ops.check_keys()  # the exact rules' chunk kernels refuse them without stalling by default


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["efla", "gated_efla"])
def test_gpu_chunk_refuses_overflowing_keys_at_a_later_call_by_default(rule, switches):
    # no device sync in the call: the flag reaches the host behind its kernels; the next call that
    # finds it there raises, names the earlier call, and later clean calls pass
    switches(EFLA_CHECK_VALUES=None, EFLA_CHECK_KEYS=None)
    q, k, v, beta, g, _ = (x.cuda().to(torch.bfloat16) for x in _inputs(1, 70, 2, 16, 16, 1, rule))
    op = getattr(ops, f"chunk_{rule}")
    huge = k.clone()
    huge[0, 33, 1] *= 1e20
    _call(op, rule, q, huge, v, beta, g, None, None)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="in an earlier chunk call on this thread"):
        _call(op, rule, q, k, v, beta, g, None, None)
    _call(op, rule, q, k, v, beta, g, None, None)
    ops.check_keys()


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["efla", "gated_efla"])
def test_gpu_scan_is_exact_for_overflowing_keys(rule, switches):
    # decoding: the scan writes the step in keys scaled by their largest entry, so a key whose
    # ||k||^2 overflows float32 gives the float64 result (finite there)
    switches(EFLA_CHECK_VALUES=None)
    q, k, v, beta, g, h0 = _inputs(1, 12, 2, 16, 16, 1, rule)
    k = k.to(torch.bfloat16).double()  # what the kernel reads
    k[0, 5] *= 1e19
    ref = _call(getattr(ops, f"recurrent_{rule}"), rule, q.double(), k, v.double(), beta.double(), g.double(), h0.double(), None)
    with torch.no_grad():
        out = _call(
            getattr(ops, f"recurrent_{rule}"),
            rule,
            *(x.cuda().to(torch.bfloat16) for x in (q, k, v)),
            beta.cuda().to(torch.bfloat16),
            g.cuda(),
            h0.cuda(),
            None,
        )
    assert _rel(out[0], ref[0]) < 2e-2 and _rel(out[1], ref[1]) < 2e-2


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_gpu_overflowing_keys_raise_with_value_checks(rule, mode, switches):
    # on a GPU, value checks (one device sync each) are opt-in; with them on, the bf16 kernels
    # never see a key whose ||k||^2 overflows float32. The Euler rules get unit keys here, so
    # ||1e19 k||^2 = 1e38 is still finite, but the state then grows without bound: the result
    # check reports that instead (as on the CPU).
    switches(EFLA_CHECK_VALUES=True)
    q, k, v, beta, g, _ = (x.cuda().to(torch.bfloat16) for x in _inputs(1, 8, 1, 16, 16, 1, rule))
    expected = r"^k: a key's squared norm" if "efla" in rule else r"^q/k/v/beta: the inputs are finite but the result"
    with pytest.raises(ValueError, match=expected):
        _call(getattr(ops, f"{mode}_{rule}"), rule, q, k * 1e19, v, beta, g, None, None)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-efla", "tiny-gated-efla"])
def test_gpu_model_refuses_overflowing_keys_once_per_forward(preset, switches):
    # the model reads its layers' overflow flags once, after the last layer: the forward still
    # raises the ValueError, and a clean forward afterwards is not failed by a stale flag
    from efla.models import EFLAForCausalLM
    from efla.models.presets import get_preset_config

    switches(EFLA_CHECK_VALUES=None, EFLA_CHECK_KEYS=None)
    torch.manual_seed(0)
    model = EFLAForCausalLM(get_preset_config(preset)).cuda().to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 80), device="cuda")
    clean = model(ids).logits
    k_proj = model.model.layers[0].attn.k_proj.weight
    saved = k_proj.detach().clone()
    with torch.no_grad():
        k_proj.mul_(1e22)  # ||k||^2 about 1e43 (1e20 gave 2.4e37 in the tiny preset)
    with pytest.raises(ValueError, match=r"^k: a key's squared norm \|\|k\|\|\^2 overflows float32"):
        model(ids)
    with torch.no_grad():
        k_proj.copy_(saved)
    assert _rel(model(ids).logits, clean) < 1e-3
