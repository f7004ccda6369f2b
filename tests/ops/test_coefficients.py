"""The exact-flow coefficient and the paper's one-step picture."""

from __future__ import annotations

import math

import pytest
import torch

import efla.ops as ops
from efla.ops import efla_coefficient, gated_efla_coefficients
from efla.ops.coefficients import coefficients, phi
from tests.ops import mp_reference as mp

TINY32 = torch.finfo(torch.float32).tiny  # smallest normal float32


def test_alpha_closed_form_float64():
    gen = torch.Generator().manual_seed(0)
    scales = torch.logspace(-4, 2, 50, dtype=torch.float64)[None, :, None, None]
    k = torch.randn(3, 50, 4, 16, generator=gen, dtype=torch.float64) * scales
    beta = torch.rand(3, 50, 4, generator=gen, dtype=torch.float64) * 3
    lam = (k * k).sum(-1)
    want = -torch.expm1(-beta * lam) / lam  # (1 - e^{-beta lambda}) / lambda without cancellation
    assert torch.allclose(efla_coefficient(beta, k), want, rtol=1e-12, atol=0)


def test_alpha_limits_and_range_float32():
    beta = torch.tensor([0.5, 2.0, 1e4, 1e4, 0.3])
    k = torch.zeros(5, 8)
    k[0, 0] = 1e-7  # lambda = 1e-14 -> clamp 1e-12: alpha -> beta
    k[1] = 0.0  # zero key: alpha = beta
    k[2, 0] = 1e6  # lambda = 1e12: alpha = 1/lambda
    k[3, :] = 1.0  # lambda = 8: beta lambda = 8e4, alpha = 1/8
    k[4, 0] = 1.0  # lambda = 1
    a = efla_coefficient(beta, k)
    assert torch.isfinite(a).all()
    assert a[0].item() == pytest.approx(0.5, rel=1e-6)
    assert a[1].item() == pytest.approx(2.0, rel=1e-6)
    assert a[2].item() == pytest.approx(1e-12, rel=1e-5)
    assert a[3].item() == pytest.approx(1 / 8, rel=1e-6)
    assert a[4].item() == pytest.approx(1 - math.exp(-0.3), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_phi_value_and_gradient_across_scales(dtype):
    x = torch.cat([torch.zeros(1), torch.logspace(-9, 3, 200)]).to(dtype).requires_grad_(True)
    y = phi(x)
    (g,) = torch.autograd.grad(y.sum(), x)
    xd = x.detach().double()
    # float64 reference with the series where the closed form cancels
    want = torch.where(xd < 1e-4, 1 - xd / 2 + xd**2 / 6, -torch.expm1(-xd) / xd.clamp_min(1e-300))
    dwant = torch.where(xd < 1e-4, -0.5 + xd / 3 - xd**2 / 8, (torch.exp(-xd) - want) / xd.clamp_min(1e-300))
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert torch.allclose(y.double(), want, rtol=tol, atol=0)
    assert torch.allclose(g.double(), dwant, rtol=max(tol, 1e-10) if dtype == torch.float64 else 2e-5, atol=1e-12)


def test_alpha_gradient_matches_finite_differences():
    gen = torch.Generator().manual_seed(1)
    scales = torch.logspace(-3, 1, 20, dtype=torch.float64)[:, None]
    k = (torch.randn(20, 6, generator=gen, dtype=torch.float64) * scales).requires_grad_(True)
    beta = (torch.rand(20, generator=gen, dtype=torch.float64) + 0.1).requires_grad_(True)
    assert torch.autograd.gradcheck(efla_coefficient, (beta, k))


def _stiffness_grid(n: int) -> torch.Tensor:
    """x = beta * lambda from 0 to 1e4 (float64), log-spaced."""
    return torch.cat([torch.zeros(1, dtype=torch.float64), torch.logspace(-6, 4, n, dtype=torch.float64)])


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest relative error where the true value is a normal float32."""
    got, want = got.double(), want.double()
    normal = want.abs() >= TINY32
    return ((got - want).abs() / want.abs())[normal].max().item()


def _one_hot_keys(n: int, k0: float) -> torch.Tensor:
    """float32 keys (k0, 0, 0, 0): lambda = k0^2 exactly, so beta * lambda carries no rounding."""
    k = torch.zeros(n, 4)
    k[:, 0] = k0
    return k


@pytest.mark.parametrize("k0", [2.0**-3, 1.0, 2.0**4])
def test_alpha_gradients_keep_float32_accuracy_at_any_stiffness(k0):
    # d alpha / d beta = exp(-beta lambda) in closed form; once formed as phi + x phi' it lost 81%
    # at beta * lambda = 20 and was 0 at 32.
    lam = k0 * k0
    x = _stiffness_grid(300)
    beta = (x / lam).float().requires_grad_(True)
    k = _one_hot_keys(len(x), k0).requires_grad_(True)
    d_beta, d_k = torch.autograd.grad(efla_coefficient(beta, k).sum(), (beta, k))
    want_beta = torch.exp(-beta.detach().double() * lam)
    assert _max_rel(d_beta, want_beta) < 1e-6
    # where the true value is below the normal range the result must not be garbage either
    assert (d_beta[want_beta < TINY32].abs() <= 2 * TINY32).all()
    want_k = torch.tensor([2 * k0 * mp.gradient(mp.erase, b, 0.0, lam)[2] for b in beta.tolist()])
    assert _max_rel(d_k[:, 0], want_k) < 1e-6
    assert (d_k[:, 1:] == 0).all()


@pytest.mark.parametrize("g", [0.0, -1e-6, -0.01, -1.0, -5.0])
def test_gated_coefficient_gradients_keep_float32_accuracy(g):
    # the chain rule through w = beta phi(eta) gives phi(eta) + x1 phi'(eta), two cancelling terms
    k0 = 2.0
    lam = k0 * k0
    x = _stiffness_grid(50)
    beta = (x / (math.exp(g) * lam)).float().requires_grad_(True)
    gate = torch.full_like(beta, g).requires_grad_(True)
    k = _one_hot_keys(len(x), k0).requires_grad_(True)
    _, erase, write = coefficients("gated_efla", k, beta, gate)
    assert erase.dtype == write.dtype == torch.float32
    for name, y, f in (("erase", erase, mp.erase), ("write", write, mp.write)):
        got = torch.autograd.grad(y.sum(), (beta, gate, k), retain_graph=True)
        want = torch.tensor([mp.gradient(f, b, g, lam) for b in beta.tolist()], dtype=torch.float64)
        assert _max_rel(got[0], want[:, 0]) < 1e-6, (name, "beta")
        assert _max_rel(got[1], want[:, 1]) < 1e-6, (name, "g")
        assert _max_rel(got[2][:, 0], 2 * k0 * want[:, 2]) < 1e-6, (name, "k")


def test_gated_coefficients_reduce_to_efla_at_gate_one():
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(2, 9, 3, 8, generator=gen, dtype=torch.float64)
    beta = torch.rand(2, 9, 3, generator=gen, dtype=torch.float64)
    gamma, a, w = coefficients("gated_efla", k, beta, torch.zeros_like(beta))
    alpha = efla_coefficient(beta, k)
    assert torch.equal(gamma, torch.zeros_like(gamma))
    assert torch.allclose(a, alpha, rtol=1e-14) and torch.allclose(w, alpha, rtol=1e-14)


def test_gated_efla_coefficients_is_what_the_ops_use():
    # the public function and the ops' path share one implementation: values and gradients equal
    gen = torch.Generator().manual_seed(4)
    k = (torch.randn(2, 7, 3, 8, generator=gen) * 3).requires_grad_(True)
    beta = (torch.rand(2, 7, 3, generator=gen) * 5).requires_grad_(True)
    g = (-torch.rand(2, 7, 3, generator=gen) * 2).requires_grad_(True)
    public = gated_efla_coefficients(beta, k, g)
    internal = coefficients("gated_efla", k, beta, g)
    weights = [torch.randn(beta.shape, generator=gen) for _ in range(3)]
    grads = [torch.autograd.grad(sum((c * w).sum() for c, w in zip(cs, weights)), (beta, k, g)) for cs in (public, internal)]
    for a, b in zip(public, internal):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_gated_efla_coefficients_formulas_float64():
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(40, 6, generator=gen, dtype=torch.float64) * torch.logspace(-2, 1, 40, dtype=torch.float64)[:, None]
    beta = torch.rand(40, generator=gen, dtype=torch.float64) * 3
    g = -torch.rand(40, generator=gen, dtype=torch.float64) * 3
    log_decay, erase, write = gated_efla_coefficients(beta, k, g)
    lam, gate = (k * k).sum(-1), torch.exp(g)
    eta = (1 - gate) + gate * beta * lam
    assert torch.allclose(log_decay, gate - 1, rtol=1e-14, atol=0)
    assert torch.allclose(erase, -torch.expm1(-gate * beta * lam) / lam, rtol=1e-12, atol=0)
    assert torch.allclose(write, beta * -torch.expm1(-eta) / eta, rtol=1e-12, atol=0)
    _, erase1, write1 = gated_efla_coefficients(beta, k, torch.zeros_like(g))  # no gate: EFLA's alpha
    assert torch.allclose(erase1, efla_coefficient(beta, k), rtol=1e-14) and torch.allclose(write1, erase1, rtol=1e-14)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(g=torch.full((2, 3), 0.1)), "g: the log gate must be <= 0"),
        (dict(g=torch.zeros(2, 4)), "g: expected shape"),
        (dict(g=torch.full((2, 3), float("nan"))), "g: contains 6 non-finite"),
        (dict(beta=-torch.ones(2, 3)), "beta: the step size must be >= 0"),
    ],
)
def test_gated_efla_coefficients_rejects_bad_inputs(bad, match):
    args = dict(beta=torch.ones(2, 3), k=torch.randn(2, 3, 4), g=-torch.ones(2, 3)) | bad
    with pytest.raises(ValueError, match=match):
        gated_efla_coefficients(**args)


def _one_step(rule, x, K=8, seed=0):
    """State after one step from a random S0 with ||k||^2 = 1 and beta = x."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 1, 1, K, generator=gen, dtype=torch.float64)
    k = k / k.norm()
    v = torch.randn(1, 1, 1, K, generator=gen, dtype=torch.float64)
    q = torch.randn(1, 1, 1, K, generator=gen, dtype=torch.float64)
    S0 = torch.randn(1, 1, K, K, generator=gen, dtype=torch.float64)
    beta = torch.full((1, 1, 1), x, dtype=torch.float64)
    fn = ops.recurrent_efla if rule == "exact" else ops.recurrent_delta_rule
    return fn(q, k, v, beta, initial_state=S0, output_final_state=True)[1], S0, k


def test_exact_minus_euler_shrinks_quadratically():
    # paper: alpha = beta - beta^2 lambda / 2 + O(beta^3 lambda^2), so one step differs by O((beta lambda)^2)
    diffs = []
    for x in [1e-1, 1e-2, 1e-3, 1e-4]:
        Se, _, _ = _one_step("exact", x)
        Su, _, _ = _one_step("euler", x)
        diffs.append((Se - Su).norm().item())
    ratios = [diffs[i + 1] / diffs[i] for i in range(3)]
    for r in ratios[1:]:
        assert r == pytest.approx(1e-2, rel=0.02)  # 10x smaller step -> 100x smaller difference
    assert ratios[0] == pytest.approx(1e-2, rel=0.1)


def test_euler_expands_past_two_exact_never_does():
    gen = torch.Generator().manual_seed(3)
    K = 8
    for x in [0.5, 1.5, 2.5, 4.0, 10.0, 100.0]:
        k = torch.randn(1, 1, 1, K, generator=gen, dtype=torch.float64)
        k = k / k.norm()
        S0 = torch.randn(1, 1, K, K, generator=gen, dtype=torch.float64)
        q = torch.randn(1, 1, 1, K, generator=gen, dtype=torch.float64)
        v = torch.zeros(1, 1, 1, K, dtype=torch.float64)  # homogeneous update (no write)
        beta = torch.full((1, 1, 1), x, dtype=torch.float64)
        kc = k[0, 0, 0]
        along0 = (kc @ S0[0, 0]).norm()  # component of the state along k
        Sx = ops.recurrent_efla(q, k, v, beta, initial_state=S0, output_final_state=True)[1]
        Su = ops.recurrent_delta_rule(q, k, v, beta, initial_state=S0, output_final_state=True)[1]
        ratio_exact = (kc @ Sx[0, 0]).norm() / along0
        ratio_euler = (kc @ Su[0, 0]).norm() / along0
        assert ratio_exact.item() == pytest.approx(math.exp(-x), rel=1e-9)  # EFLA eigenvalue e^{-x} < 1
        assert ratio_euler.item() == pytest.approx(abs(1 - x), rel=1e-9)  # Euler eigenvalue 1 - x
        assert torch.linalg.matrix_norm(Sx[0, 0], ord=2) <= torch.linalg.matrix_norm(S0[0, 0], ord=2) * (1 + 1e-12)
        if x > 2:
            assert torch.linalg.matrix_norm(Su[0, 0], ord=2) > torch.linalg.matrix_norm(S0[0, 0], ord=2) or ratio_euler > 1
