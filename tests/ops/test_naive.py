"""efla.ops.naive, the tests' reference, checked against what it is written from.

The exact rules against the matrix-exponential solution of their ODE (tests/ops/reference.py,
which uses nothing from efla.ops), values and gradients in float64; the Euler rules' step against
the dense matrices of its equation; the options (varlen, grouped values, in-op L2 norms, scale)
against doing the same outside the loop.
"""

from __future__ import annotations

import pytest
import torch

from efla.ops import l2_normalize, naive
from tests.ops.reference import matrix_exp_reference

F64 = torch.float64
RULES = ["efla", "gated_efla", "delta_rule", "gated_delta_rule"]


def inputs(rule, B=2, T=13, H=2, HV=2, K=5, V=3, key_scale=1.0, beta_max=1.0, seed=0):
    """float64 q, k [B, T, H, K], v [B, T, HV, V], beta, g [B, T, HV], h0 [B, HV, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=F64)
    k = torch.randn(B, T, H, K, generator=gen, dtype=F64) * key_scale
    v = torch.randn(B, T, HV, V, generator=gen, dtype=F64)
    beta = torch.rand(B, T, HV, generator=gen, dtype=F64) * beta_max
    g = -torch.rand(B, T, HV, generator=gen, dtype=F64)
    h0 = torch.randn(B, HV, K, V, generator=gen, dtype=F64)
    return q, k, v, beta, g, h0


def run(rule, q, k, v, beta, g, **options):
    gate = (g,) if rule.startswith("gated") else ()
    return getattr(naive, rule)(q, k, v, *gate, beta, output_final_state=True, **options)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("rule", ["efla", "gated_efla"])
@pytest.mark.parametrize("key_scale", [0.1, 1.0, 4.0])
def test_exact_rules_equal_matrix_exponential_solution(rule, key_scale):
    # beta up to 4 and keys up to ||k||^2 ~ 80: beta * lambda up to ~1e3, far past Euler's range;
    # grouped values (HV = 2H) so each value head's q/k head is checked too
    q, k, v, beta, g, h0 = inputs(rule, HV=4, key_scale=key_scale, beta_max=4.0, seed=int(10 * key_scale))
    o, S = run(rule, q, k, v, beta, g, initial_state=h0)
    o_ref, S_ref = matrix_exp_reference(rule, q, k, v, beta, g, initial_state=h0)
    assert rel(o, o_ref) < 1e-12 and rel(S, S_ref) < 1e-12, (rel(o, o_ref), rel(S, S_ref))


@pytest.mark.parametrize("rule", ["efla", "gated_efla"])
def test_exact_rules_gradients_equal_matrix_exponential_solution(rule):
    q, k, v, beta, g, h0 = inputs(rule, key_scale=1.5, beta_max=2.0, seed=3)
    names = ["q", "k", "v", "beta", "initial_state"] + (["g"] if rule == "gated_efla" else [])
    leaves = [x.requires_grad_() for x in (q, k, v, beta, h0, g)][: len(names)]
    gen = torch.Generator().manual_seed(4)
    w_o, w_s = torch.randn(v.shape, generator=gen, dtype=F64), torch.randn(h0.shape, generator=gen, dtype=F64)

    def gradients(o, S):
        return torch.autograd.grad((o * w_o).sum() + (S * w_s).sum(), leaves)

    got = gradients(*run(rule, q, k, v, beta, g, initial_state=h0))
    want = gradients(*matrix_exp_reference(rule, q, k, v, beta, g, initial_state=h0))
    for name, a, b in zip(names, got, want):
        assert rel(a, b) < 1e-10, (name, rel(a, b))


@pytest.mark.parametrize("rule", ["delta_rule", "gated_delta_rule"])
def test_euler_step_equals_its_matrix_equation(rule):
    q, k, v, beta, g, h0 = inputs(rule, B=1, T=1, key_scale=0.5, seed=5)
    kt, vt, bt, gt = k[0, 0], v[0, 0], beta[0, 0], g[0, 0]  # [H, K], [H, V], [H], [H]
    decay = torch.exp(gt) if rule == "gated_delta_rule" else torch.ones_like(gt)
    eye = torch.eye(kt.shape[-1], dtype=F64)
    S_want = torch.stack(
        [
            decay[h] * (eye - bt[h] * torch.outer(kt[h], kt[h])) @ h0[0, h] + bt[h] * torch.outer(kt[h], vt[h])
            for h in range(kt.shape[0])
        ]
    )
    o, S = run(rule, q, k, v, beta, g, initial_state=h0)
    o_want = torch.einsum("hkv,hk->hv", S_want, q[0, 0]) * q.shape[-1] ** -0.5
    assert rel(S[0], S_want) < 1e-14 and rel(o[0, 0], o_want) < 1e-14


@pytest.mark.parametrize("rule", RULES)
def test_varlen_runs_each_sequence_from_its_own_state(rule):
    lens = [4, 0, 9, 1]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    q, k, v, beta, g, _ = inputs(rule, B=1, T=sum(lens), HV=4, seed=6)
    h0 = torch.randn(len(lens), 4, 5, 3, dtype=F64)
    o, S = run(rule, q, k, v, beta, g, initial_state=h0, cu_seqlens=cu)
    assert o.shape == v.shape and S.shape == h0.shape
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if s == e:  # an empty sequence keeps its initial state
            assert torch.equal(S[i], h0[i])
            continue
        piece = [x[:, s:e] for x in (q, k, v, beta, g)]
        oi, Si = run(rule, *piece, initial_state=h0[i : i + 1])
        assert torch.equal(o[:, s:e], oi) and torch.equal(S[i : i + 1], Si)


@pytest.mark.parametrize("rule", RULES)
def test_grouped_value_head_reads_its_query_key_head(rule):
    q, k, v, beta, g, h0 = inputs(rule, H=2, HV=6, seed=7)
    o, S = run(rule, q, k, v, beta, g, initial_state=h0)
    for i in range(6):  # value head i alone, with q/k head i // 3

        def one(x, i=i):
            return x[:, :, i : i + 1]

        qk = [x[:, :, i // 3 : i // 3 + 1] for x in (q, k)]
        oi, Si = run(rule, *qk, one(v), one(beta), one(g), initial_state=h0[:, i : i + 1])
        assert torch.equal(o[:, :, i : i + 1], oi) and torch.equal(S[:, i : i + 1], Si)


@pytest.mark.parametrize("rule", RULES)
def test_in_op_l2_norms_and_scale_equal_doing_them_outside(rule):
    q, k, v, beta, g, h0 = inputs(rule, key_scale=3.0, seed=8)
    for flags, qn, kn in (
        ({"use_q_l2norm_in_kernel": True}, l2_normalize(q), k),
        ({"use_qk_l2norm_in_kernel": True}, l2_normalize(q), l2_normalize(k)),
    ):
        o, S = run(rule, q, k, v, beta, g, initial_state=h0, scale=0.3, **flags)
        o_want, S_want = run(rule, qn, kn, v, beta, g, initial_state=h0, scale=0.3)
        assert torch.equal(o, o_want) and torch.equal(S, S_want)
    o_default, _ = run(rule, q, k, v, beta, g, initial_state=h0)
    o_scaled, _ = run(rule, q, k, v, beta, g, initial_state=h0, scale=2.0)
    assert rel(o_scaled, o_default * 2.0 * 5**0.5) < 1e-14


def test_float32_inputs_keep_float32_and_no_final_state_unless_asked():
    q, k, v, beta, g, h0 = (x.float() for x in inputs("gated_efla", seed=9))
    o, S = naive.gated_efla(q, k, v, g, beta, initial_state=h0)
    assert o.dtype == torch.float32 and o.shape == v.shape and S is None
    o64, _ = naive.gated_efla(*(x.double() for x in (q, k, v, g, beta)), initial_state=h0.double())
    assert rel(o.double(), o64) < 1e-5
