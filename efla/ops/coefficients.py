"""Exact-flow and Euler coefficients (efla.md §1 and §2; paper eq. 15 and App. D).

Every op reduces to one generic recurrence per head,

    S_t = d_t (I - a_t k_t k_t^T) S_{t-1} + w_t k_t v_t^T,    d_t = exp(gamma_t),

with a log-decay ``gamma``, an erase coefficient ``a`` and a write coefficient ``w``:

=====================  ===================  ====================  =========================
rule                   gamma                a (erase)             w (write)
=====================  ===================  ====================  =========================
DeltaNet (Euler)       0                    beta                  beta
EFLA (exact)           0                    alpha                 alpha
Gated DeltaNet         g                    beta                  beta
Gated EFLA (exact)     -delta = expm1(g)    (1-e^{-rho l})/l      beta (1-e^{-eta})/eta
=====================  ===================  ====================  =========================

with ``l = lambda = ||k||^2`` (clamped at 1e-12), ``alpha = (1 - exp(-beta l)) / l``,
``delta = 1 - exp(g)``, ``rho = exp(g) beta`` and ``eta = delta + rho l``.

All exact coefficients are written through ``phi(x) = (1 - exp(-x)) / x`` (``phi(0) = 1``),
evaluated with ``expm1`` and with a series near 0 so that values *and* gradients stay accurate
for any ``x >= 0`` (``alpha = beta * phi(beta * l)``).
"""

from __future__ import annotations

import torch

LAMBDA_MIN = 1e-12  # clamp for ||k||^2 (paper App. A)


def _phi_and_grad(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """phi(x) = -expm1(-x)/x and phi'(x), accurate for all x >= 0 in float32 and float64."""
    # below `small`, the closed form loses digits to cancellation; the Taylor series is exact
    # to rounding there (truncation error ~ x^5/720 for phi, x^5/840 for phi').
    small = 1e-3 if x.dtype == torch.float64 else 1e-1
    tiny = x.abs() < small
    xs = torch.where(tiny, torch.ones_like(x), x)  # safe denominator
    em = torch.expm1(-xs)  # exp(-x) - 1
    phi_big = -em / xs
    dphi_big = ((em + 1.0) - phi_big) / xs  # (exp(-x) - phi) / x
    x2 = x * x
    phi_small = 1.0 - x / 2 + x2 / 6 - x2 * x / 24 + x2 * x2 / 120
    dphi_small = -0.5 + x / 3 - x2 / 8 + x2 * x / 30 - x2 * x2 / 144
    return torch.where(tiny, phi_small, phi_big), torch.where(tiny, dphi_small, dphi_big)


class _Phi(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        phi, dphi = _phi_and_grad(x)
        ctx.save_for_backward(dphi)
        return phi

    @staticmethod
    def backward(ctx, grad):
        (dphi,) = ctx.saved_tensors
        return grad * dphi


def phi(x: torch.Tensor) -> torch.Tensor:
    """``(1 - exp(-x)) / x`` with ``phi(0) = 1``, stable value and gradient (x >= 0)."""
    return _Phi.apply(x)


def key_energy(k: torch.Tensor) -> torch.Tensor:
    """``lambda = ||k||^2`` over the last dim, clamped at ``LAMBDA_MIN``; shape ``k.shape[:-1]``."""
    return (k * k).sum(-1).clamp_min(LAMBDA_MIN)


def efla_coefficient(beta: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Exact-flow step coefficient ``alpha = (1 - exp(-beta * lambda)) / lambda`` (paper eq. 15).

    Args:
        beta: step sizes ``[B, T, H]`` (>= 0).
        k: raw (un-normalised) keys ``[B, T, H, K]``; ``lambda = ||k||^2`` clamped at 1e-12.

    Returns:
        ``alpha`` with ``beta``'s shape and dtype. ``alpha -> beta`` as ``lambda -> 0`` and
        ``alpha -> 1/lambda`` for stiff keys; finite for ``lambda`` up to 1e12 and ``beta``
        up to 1e4 in float32. Computed in float32 (float64 for float64 inputs).

    Example:
        >>> import torch
        >>> from efla.ops import efla_coefficient
        >>> k = torch.randn(1, 3, 2, 8)
        >>> efla_coefficient(torch.full((1, 3, 2), 0.5), k).shape
        torch.Size([1, 3, 2])
    """
    if not isinstance(beta, torch.Tensor) or not isinstance(k, torch.Tensor):
        raise ValueError("beta, k: expected torch.Tensors")
    if k.dim() < 1 or beta.shape != k.shape[:-1]:
        raise ValueError(f"beta: expected shape {tuple(k.shape[:-1])} (k's shape without the last dim), got {tuple(beta.shape)}")
    cdt = torch.float64 if beta.dtype == torch.float64 else torch.float32
    b = beta.to(cdt)
    lam = key_energy(k.to(cdt))
    return (b * phi(b * lam)).to(beta.dtype)


def coefficients(rule: str, k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None):
    """Return ``(gamma, a, w)`` of the generic recurrence for ``rule``, in the compute dtype.

    ``rule`` is one of ``"efla"``, ``"gated_efla"``, ``"delta_rule"``, ``"gated_delta_rule"``.
    ``gamma`` is ``None`` for the ungated rules.
    """
    cdt = torch.float64 if k.dtype == torch.float64 else torch.float32
    b = beta.to(cdt)
    if rule == "delta_rule":
        return None, b, b
    if rule == "gated_delta_rule":
        return g.to(cdt), b, b
    lam = key_energy(k.to(cdt))  # lambda_t = ||k_t||^2
    if rule == "efla":
        alpha = b * phi(b * lam)  # eq. 15: (1 - e^{-beta lambda}) / lambda
        return None, alpha, alpha
    if rule == "gated_efla":
        gg = g.to(cdt)
        gate = torch.exp(gg)  # a_t = exp(g_t)
        gamma = torch.expm1(gg)  # -delta = -(1 - a)
        rho = gate * b  # rho = a * beta
        erase = rho * phi(rho * lam)  # (1 - e^{-rho lambda}) / lambda
        eta = rho * lam - gamma  # eta = delta + rho lambda
        write = b * phi(eta)  # beta (1 - e^{-eta}) / eta
        return gamma, erase, write
    raise ValueError(f"rule: expected one of efla, gated_efla, delta_rule, gated_delta_rule, got {rule!r}")
