"""Correctness of efla.ops against the per-token loops of efla.ops.naive (themselves checked against
the matrix-exponential solution of the ODE in test_naive.py), and against that solution directly
for stiff inputs."""

from __future__ import annotations

import pytest
import torch

import efla.ops as ops
from efla.ops import naive
from tests.ops.reference import matrix_exp_reference, spectral_reference

RULES = ["efla", "gated_efla", "delta_rule", "gated_delta_rule"]
MODES = ["chunk", "recurrent"]
F64 = torch.float64


def op(mode, rule):
    return getattr(ops, f"{mode}_{rule}")


def make_inputs(rule, B=2, T=17, H=2, K=6, V=4, key_scale=1.0, dtype=F64, seed=0, beta_max=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=gen, dtype=dtype) * key_scale
    if "delta" in rule:  # Euler baselines get unit-norm keys (as DeltaNet's L2 norm does), scaled
        k = k / k.norm(dim=-1, keepdim=True) * key_scale
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype) * beta_max
    g = -torch.rand(B, T, H, generator=gen, dtype=dtype) * 0.5
    h0 = torch.randn(B, H, K, V, generator=gen, dtype=dtype)
    return q, k, v, beta, g, h0


def call(mode, rule, q, k, v, beta, g, **kw):
    if rule.startswith("gated"):
        return op(mode, rule)(q, k, v, g, beta, **kw)
    return op(mode, rule)(q, k, v, beta, **kw)


def reference(rule, q, k, v, beta, g, **kw):
    gate = (g,) if rule.startswith("gated") else ()
    return getattr(naive, rule)(q, k, v, *gate, beta, output_final_state=True, **kw)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("T", [1, 17, 64, 130])
def test_forward_matches_reference(mode, rule, T):
    # key scales from 0.1 to 4; the Euler baselines expand for beta*||k||^2 > 2 (that is the
    # point of the paper), so beyond scale 1 their beta is kept small enough to stay bounded.
    for i, scale in enumerate([0.1, 1.0, 4.0]):
        bmax = 1.0 if ("efla" in rule or scale <= 1.0) else 0.1
        q, k, v, beta, g, h0 = make_inputs(rule, T=T, key_scale=scale, seed=10 * T + i, beta_max=bmax)
        o, S = call(mode, rule, q, k, v, beta, g, initial_state=h0, output_final_state=True)
        o_ref, S_ref = reference(rule, q, k, v, beta, g, initial_state=h0)
        assert o.dtype == F64 and S.dtype == F64
        assert rel(o, o_ref) < 1e-12, (scale, rel(o, o_ref))
        assert rel(S, S_ref) < 1e-12, (scale, rel(S, S_ref))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("T", [17, 70])
def test_gradients_match_reference(mode, rule, T):
    q, k, v, beta, g, h0 = make_inputs(rule, T=T, key_scale=1.5 if "efla" in rule else 1.0, seed=T)
    leaves = [q, k, v, beta, h0] + ([g] if rule.startswith("gated") else [])
    for x in leaves:
        x.requires_grad_(True)
    gen = torch.Generator().manual_seed(99)
    w_o = torch.randn(q.shape[0], T, q.shape[2], v.shape[-1], generator=gen, dtype=F64)
    w_s = torch.randn(h0.shape, generator=gen, dtype=F64)

    def loss(fn):
        o, S = fn()
        return (o * w_o).sum() + (S * w_s).sum()

    got = torch.autograd.grad(loss(lambda: call(mode, rule, q, k, v, beta, g, initial_state=h0, output_final_state=True)), leaves)
    want = torch.autograd.grad(loss(lambda: reference(rule, q, k, v, beta, g, initial_state=h0)), leaves)
    names = ["q", "k", "v", "beta", "initial_state", "g"]
    for name, a, b in zip(names, got, want):
        assert rel(a, b) < 1e-12, (name, rel(a, b))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rule", ["efla", "gated_efla"])
def test_varlen_equals_separate_sequences(mode, rule):
    lens = [5, 0, 37, 70, 1]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    T = sum(lens)
    q, k, v, beta, g, _ = make_inputs(rule, B=1, T=T, seed=3)
    h0 = torch.randn(len(lens), 2, 6, 4, dtype=F64)
    leaves = [q, k, v, beta, h0, g]
    for x in leaves:
        x.requires_grad_(True)
    if rule == "efla":
        leaves = leaves[:5]
    o, S = call(mode, rule, q, k, v, beta, g, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert o.shape == (1, T, 2, 4) and S.shape == (len(lens), 2, 6, 4)
    grads = torch.autograd.grad(o.pow(2).sum() + S.pow(2).sum(), leaves)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if e == s:
            assert torch.equal(S[i], h0[i])  # an empty sequence leaves its state untouched
            continue
        sl = slice(s, e)
        args = [x[:, sl] for x in (q, k, v, beta, g)]
        oi, Si = call(mode, rule, *args, initial_state=h0[i : i + 1], output_final_state=True)
        assert rel(o[:, sl], oi) < 1e-12
        assert rel(S[i : i + 1], Si) < 1e-12
        gi = torch.autograd.grad(oi.pow(2).sum() + Si.pow(2).sum(), leaves, allow_unused=True)
        for j in [0, 1, 2, 3] + ([5] if rule == "gated_efla" else []):
            assert rel(grads[j][:, sl], gi[j][:, sl]) < 1e-10
        assert rel(grads[4][i], gi[4][i]) < 1e-10


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rule", RULES)
def test_zero_keys_are_identity_steps(mode, rule):
    q, k, v, beta, g, h0 = make_inputs(rule, T=20, seed=5)
    if rule.startswith("gated"):
        g = torch.zeros_like(g)  # no decay, so only the key decides
    k = k.clone()
    zero = [0, 3, 4, 11, 19]
    k[:, zero] = 0.0
    o, S = call(mode, rule, q, k, v, beta, g, initial_state=h0, output_final_state=True)
    keep = [t for t in range(20) if t not in zero]
    o2, S2 = call(
        mode, rule, q[:, keep], k[:, keep], v[:, keep], beta[:, keep], g[:, keep], initial_state=h0, output_final_state=True
    )
    assert rel(S, S2) < 1e-12
    assert rel(o[:, keep], o2) < 1e-12
    # first token has k = 0: the state is still h0, so o_0 = scale * h0^T q_0
    o0 = 6**-0.5 * torch.einsum("bhkv,bhk->bhv", h0, q[:, 0])
    assert rel(o[:, 0], o0) < 1e-12


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rule", ["efla", "gated_efla"])
def test_stiff_inputs_stay_finite_and_exact(mode, rule):
    q, k, v, beta, g, h0 = make_inputs(rule, T=40, seed=7)
    k = k / k.norm(dim=-1, keepdim=True) * (1e7**0.5)  # lambda = 1e7
    gen = torch.Generator().manual_seed(8)  # the references' own error varies with beta: keep it fixed
    beta = 1e3 * (0.5 + torch.rand(beta.shape, generator=gen, dtype=beta.dtype))  # beta*lambda ~ 1e10
    for x in (q, k, v, beta, h0):
        x.requires_grad_(True)
    o, S = call(mode, rule, q, k, v, beta, g, initial_state=h0, output_final_state=True)
    o_ref, S_ref = matrix_exp_reference(rule, q, k, v, beta, g, initial_state=h0)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    # Both references lose ~eps * beta * lambda ~ 1e-6 here (matrix_exp through scaling and
    # squaring of a norm-1e10 matrix; eigh through the absolute error of the zero eigenvalues),
    # so the bound is set by the references, not by the op.
    o_sp, S_sp = spectral_reference(rule, q, k, v, beta, g, initial_state=h0)
    for oo, SS in ((o_ref, S_ref), (o_sp, S_sp)):
        assert rel(o, oo) < 5e-5 and rel(S, SS) < 5e-5
    # the per-token loop takes the same stable coefficients, so it agrees to rounding
    o_naive, S_naive = reference(rule, q, k, v, beta, g, initial_state=h0)
    assert rel(o, o_naive) < 1e-12 and rel(S, S_naive) < 1e-12
    grads = torch.autograd.grad(o.sum() + S.sum(), (q, k, v, beta, h0))
    assert all(torch.isfinite(gr).all() for gr in grads)
    # float32 stays finite too
    o32, S32 = call(
        mode, rule, *(x.detach().float() for x in (q, k, v, beta, g)), initial_state=h0.detach().float(), output_final_state=True
    )
    assert torch.isfinite(o32).all() and torch.isfinite(S32).all()
    assert rel(o32.double(), o_ref) < 1e-3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rule", RULES)
def test_float32_agrees_with_float64(mode, rule):
    q, k, v, beta, g, h0 = make_inputs(rule, T=150, H=3, K=16, V=8, seed=11)
    leaves64 = [q, k, v, beta, g, h0]
    leaves32 = [x.float().requires_grad_(True) for x in leaves64]
    for x in leaves64:
        x.requires_grad_(True)
    res = []
    for q_, k_, v_, b_, g_, h_ in (leaves64, leaves32):
        o, S = call(mode, rule, q_, k_, v_, b_, g_, initial_state=h_, output_final_state=True)
        gr = torch.autograd.grad(o.pow(2).sum() + S.pow(2).sum(), [q_, k_, v_, b_, h_] + ([g_] if "gated" in rule else []))
        res.append((o, S, gr))
    (o64, S64, g64), (o32, S32, g32) = res
    assert o32.dtype == torch.float32 and S32.dtype == torch.float32
    assert rel(o32.double(), o64) < 2e-4
    assert rel(S32.double(), S64) < 2e-4
    for a, b in zip(g32, g64):
        assert rel(a.double(), b) < 2e-4


def test_chunk_and_recurrent_agree_float32_long():
    q, k, v, beta, g, h0 = make_inputs("efla", B=1, T=300, H=2, K=32, V=16, dtype=torch.float32, seed=2)
    o1, S1 = ops.chunk_efla(q, k, v, beta, initial_state=h0, output_final_state=True)
    o2, S2 = ops.recurrent_efla(q, k, v, beta, initial_state=h0, output_final_state=True)
    assert rel(o1, o2) < 1e-4 and rel(S1, S2) < 1e-4


def test_bfloat16_inputs_keep_dtype_and_float32_state():
    q, k, v, beta, g, h0 = make_inputs("gated_efla", T=70, dtype=torch.float32, seed=4)
    bf = [x.bfloat16() for x in (q, k, v, beta, g)]
    o, S = ops.chunk_gated_efla(bf[0], bf[1], bf[2], bf[4], bf[3], initial_state=h0, output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    o_ref, _ = ops.chunk_gated_efla(*(x.float() for x in (bf[0], bf[1], bf[2], bf[4], bf[3])), initial_state=h0)
    assert rel(o.float(), o_ref) < 2e-2


def test_inputs_not_modified_and_final_state_optional():
    q, k, v, beta, g, h0 = make_inputs("gated_efla", T=33, seed=8)
    before = [x.clone() for x in (q, k, v, beta, g, h0)]
    for mode in MODES:
        o, S = call(mode, "gated_efla", q, k, v, beta, g, initial_state=h0)
        assert S is None and o.shape == v.shape
    for x, y in zip((q, k, v, beta, g, h0), before):
        assert torch.equal(x, y)


def test_scale_keyword():
    q, k, v, beta, g, h0 = make_inputs("efla", T=9, seed=9)
    o1, _ = ops.chunk_efla(q, k, v, beta, scale=0.25)
    o_ref, _ = naive.efla(q, k, v, beta, scale=0.25)
    assert rel(o1, o_ref) < 1e-10


@pytest.mark.parametrize("rule", RULES)
def test_a_chunk_output_can_be_changed_in_place_with_the_same_gradients(rule):
    # one value head and a whole number of chunks: the op hands back its own output tensor, no copy
    q, k, v, beta, g, _ = make_inputs(rule, T=64, H=1, dtype=torch.float32)
    grads = []
    for in_place in (False, True):
        leaf = q.clone().requires_grad_()
        o, _ = call("chunk", rule, leaf, k, v, beta, g)
        if in_place:
            o.mul_(2.0)
        else:
            o = o * 2.0
        (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-6)
