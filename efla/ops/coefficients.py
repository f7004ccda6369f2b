"""Exact-flow and Euler coefficients (paper eq. 15 and App. D).

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
evaluated in float64 with ``expm1`` and with a series near 0 (``alpha = beta * phi(beta * l)``).
Their gradients are written in closed forms without cancelling terms (``d alpha / d beta =
exp(-beta l)``; see ``_ExactErase`` and ``_GatedWrite``), so values *and* gradients stay
accurate for any ``x >= 0``.
"""

from __future__ import annotations

import torch

from .validate import compute_dtype, validate_coefficient_inputs

LAMBDA_MIN = 1e-12  # clamp for ||k||^2 (paper App. A)

# The coefficients and their gradients are evaluated in float64 whatever the input dtype: the
# gradient d alpha / d beta = exp(-beta lambda) has condition number beta * lambda, so forming
# lambda and beta * lambda in float32 alone would cost up to 87 * 6e-8 ~ 5e-6 relative error
# before any formula is applied. The cost is O(B T H K) against the ops' O(B T H K V).
COEF_DTYPE = torch.float64

# below this x the closed forms of phi and phi' lose digits to cancellation (float64); the
# Taylor series is exact to rounding there (truncation ~ x^5/720 for phi, x^5/840 for phi').
_SERIES_BELOW = 1e-3


def _phi_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(phi(x), phi'(x), exp(-x))`` for ``x >= 0`` with ``phi(x) = (1 - exp(-x)) / x``."""
    small = x < _SERIES_BELOW
    xs = torch.where(small, torch.ones_like(x), x)  # safe denominator
    decay = torch.exp(-x)
    phi_closed = -torch.expm1(-xs) / xs
    dphi_closed = (torch.exp(-xs) - phi_closed) / xs
    x2 = x * x
    phi_series = 1.0 - x / 2 + x2 / 6 - x2 * x / 24 + x2 * x2 / 120
    dphi_series = -0.5 + x / 3 - x2 / 8 + x2 * x / 30 - x2 * x2 / 144
    return torch.where(small, phi_series, phi_closed), torch.where(small, dphi_series, dphi_closed), decay


class _Phi(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        value, slope, _ = _phi_parts(x)
        ctx.save_for_backward(slope)
        return value

    @staticmethod
    def backward(ctx, grad):
        (slope,) = ctx.saved_tensors
        return grad * slope


def phi(x: torch.Tensor) -> torch.Tensor:
    """``(1 - exp(-x)) / x`` with ``phi(0) = 1``, stable value and gradient (x >= 0), evaluated
    in float64 and returned in ``x``'s dtype."""
    return _Phi.apply(x.to(COEF_DTYPE)).to(x.dtype)


class _ExactErase(torch.autograd.Function):
    """``c(b, lam) = (1 - exp(-b lam)) / lam`` with its gradients in closed form:
    ``dc/db = exp(-b lam)`` (not ``phi + x phi'``, whose two terms cancel for large ``x``) and
    ``dc/dlam = b^2 phi'(b lam)``."""

    @staticmethod
    def forward(ctx, b, lam):
        x = b * lam
        value, slope, decay = _phi_parts(x)
        # -expm1(-x) / lam stays right where x = b * lam overflows (b * phi(x) would give 0)
        erase = torch.where(x < 1.0, b * value, -torch.expm1(-x) / lam)
        ctx.save_for_backward(b, slope, decay)
        return erase

    @staticmethod
    def backward(ctx, grad):
        b, slope, decay = ctx.saved_tensors
        return grad * decay, grad * (b * b * slope)


class _GatedWrite(torch.autograd.Function):
    """Gated EFLA's write ``w(b, g, lam) = b phi(eta)``, ``eta = delta + e^g b lam``,
    ``delta = -expm1(g)``. Gradients in forms without cancellation (``phi' <= 0``, ``delta >= 0``):
    ``dw/db = exp(-eta) - delta phi'(eta)`` (both terms >= 0; the chain rule's
    ``phi(eta) + x1 phi'(eta)`` cancels), ``dw/dg = b phi'(eta) e^g (b lam - 1)`` and
    ``dw/dlam = b^2 e^g phi'(eta)``."""

    @staticmethod
    def forward(ctx, b, g, lam):
        gate = torch.exp(g)
        delta = -torch.expm1(g)
        eta = delta + gate * b * lam
        value, slope, decay = _phi_parts(eta)
        ctx.save_for_backward(b, lam, gate, delta, slope, decay)
        return b * value

    @staticmethod
    def backward(ctx, grad):
        b, lam, gate, delta, slope, decay = ctx.saved_tensors
        d_b = decay - delta * slope
        d_g = b * slope * gate * (b * lam - 1.0)
        d_lam = b * b * gate * slope
        return grad * d_b, grad * d_g, grad * d_lam


class _KeyEnergy(torch.autograd.Function):
    """``||k||^2`` in float64, clamped at ``LAMBDA_MIN``. The backward, ``2 k grad`` (0 where
    clamped, as ``clamp_min``'s), runs at the keys' size in their compute dtype: no float64 copy
    of the keys is kept for it or formed in it."""

    @staticmethod
    def forward(ctx, k):
        k64 = k.to(COEF_DTYPE)
        energy = (k64 * k64).sum(-1)
        ctx.save_for_backward(k, energy >= LAMBDA_MIN)
        return energy.clamp_min(LAMBDA_MIN)

    @staticmethod
    def backward(ctx, grad):
        k, unclamped = ctx.saved_tensors
        dtype = compute_dtype(k.dtype)
        scale = (2.0 * grad * unclamped).to(dtype)
        return (k.to(dtype) * scale[..., None]).to(k.dtype)


def key_energy(k: torch.Tensor) -> torch.Tensor:
    """``lambda = ||k||^2`` over the last dim in float64 (no overflow for any float32 key),
    clamped at ``LAMBDA_MIN``; shape ``k.shape[:-1]``."""
    return _KeyEnergy.apply(k)


def exact_erase(beta: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """``(1 - exp(-beta lam)) / lam`` in float64 with closed-form gradients (``beta, lam >= 0``)."""
    return _ExactErase.apply(beta.to(COEF_DTYPE), lam)


def efla_coefficient(beta: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Exact-flow step coefficient ``alpha = (1 - exp(-beta * lambda)) / lambda`` (paper eq. 15).

    Args:
        beta: step sizes ``[B, T, H]`` (>= 0).
        k: raw (un-normalised) keys ``[B, T, H, K]``; ``lambda = ||k||^2`` clamped at 1e-12.

    Returns:
        ``alpha`` with ``beta``'s shape and dtype. ``alpha -> beta`` as ``lambda -> 0`` and
        ``alpha -> 1/lambda`` for stiff keys. Value and gradients are evaluated in float64
        (``d alpha / d beta = exp(-beta lambda)`` in closed form), so float32 results are
        correctly rounded up to a few ulps for any finite key.

    Raises:
        ValueError: non-tensor or non-floating inputs, mismatched shapes or devices, and (on
            the CPU, or with ``EFLA_CHECK_VALUES=1``) NaN/Inf values or a negative ``beta``.

    Examples:
        >>> import torch
        >>> from efla.ops import efla_coefficient
        >>> k = torch.randn(1, 3, 2, 8)
        >>> efla_coefficient(torch.full((1, 3, 2), 0.5), k).shape
        torch.Size([1, 3, 2])
    """
    validate_coefficient_inputs(beta, k)
    return exact_erase(beta, key_energy(k)).to(beta.dtype)


def gated_exact_coefficients(beta: torch.Tensor, g: torch.Tensor, lam: torch.Tensor):
    """Gated EFLA's ``(log_decay, erase, write)`` in float64 from ``beta``, ``g`` and ``lam = ||k||^2``
    , with gradients in closed forms (see ``_ExactErase`` and ``_GatedWrite``)."""
    b, g64 = beta.to(COEF_DTYPE), g.to(COEF_DTYPE)
    log_decay = torch.expm1(g64)  # -delta = -(1 - e^g)
    erase = exact_erase(torch.exp(g64) * b, lam)  # (1 - e^{-rho lambda}) / lambda, rho = e^g beta
    write = _GatedWrite.apply(b, g64, lam)  # beta (1 - e^{-eta}) / eta
    return log_decay, erase, write


def gated_efla_coefficients(beta: torch.Tensor, k: torch.Tensor, g: torch.Tensor):
    """Gated EFLA's step coefficients ``(log_decay, erase, write)`` (exact flow of the gated ODE,
    paper App. D): one step is ``S = exp(log_decay) (I - erase k k^T) S + write k v^T``.

    With ``lambda = ||k||^2`` (clamped at 1e-12), ``delta = 1 - exp(g)``, ``rho = exp(g) beta`` and
    ``eta = delta + rho lambda``: ``log_decay = -delta``, ``erase = (1 - exp(-rho lambda)) / lambda``
    and ``write = beta (1 - exp(-eta)) / eta``. At ``g = 0`` erase and write are both
    ``efla_coefficient(beta, k)`` and the decay is 1.

    Args:
        beta: step sizes ``[B, T, H]`` (>= 0).
        k: raw (un-normalised) keys ``[B, T, H, K]``.
        g: log gates ``[B, T, H]`` (<= 0; gate ``exp(g)``).

    Returns:
        ``(log_decay, erase, write)``, each with ``beta``'s shape and dtype. Values and gradients
        are evaluated in float64, with the same accuracy as ``efla_coefficient``'s.

    Raises:
        ValueError: as ``efla_coefficient``, and for a ``g`` not of ``beta``'s shape and device or
            (on the CPU, or with ``EFLA_CHECK_VALUES=1``) a ``g`` that is not finite or is > 0.

    Examples:
        >>> import torch
        >>> from efla.ops import gated_efla_coefficients
        >>> k, beta, g = torch.randn(1, 3, 2, 8), torch.full((1, 3, 2), 0.5), -torch.rand(1, 3, 2)
        >>> [c.shape for c in gated_efla_coefficients(beta, k, g)]
        [torch.Size([1, 3, 2]), torch.Size([1, 3, 2]), torch.Size([1, 3, 2])]
    """
    validate_coefficient_inputs(beta, k, g)
    return tuple(c.to(beta.dtype) for c in gated_exact_coefficients(beta, g, key_energy(k)))


def coefficients(rule: str, k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None):
    """Return ``(gamma, a, w)`` of the generic recurrence for ``rule``, in the compute dtype.

    ``rule`` is one of ``"efla"``, ``"gated_efla"``, ``"delta_rule"``, ``"gated_delta_rule"``.
    ``gamma`` is ``None`` for the ungated rules. The exact rules' coefficients are evaluated
    in float64 (see ``COEF_DTYPE``) and rounded to the compute dtype.
    """
    cdt = compute_dtype(k.dtype)
    if rule == "delta_rule":
        b = beta.to(cdt)
        return None, b, b
    if rule == "gated_delta_rule":
        b = beta.to(cdt)
        return g.to(cdt), b, b
    lam = key_energy(k)  # lambda_t = ||k_t||^2
    b = beta.to(COEF_DTYPE)
    if rule == "efla":
        alpha = exact_erase(b, lam).to(cdt)  # eq. 15: (1 - e^{-beta lambda}) / lambda
        return None, alpha, alpha
    if rule == "gated_efla":
        return tuple(c.to(cdt) for c in gated_exact_coefficients(b, g, lam))
    raise ValueError(f"rule: expected one of efla, gated_efla, delta_rule, gated_delta_rule, got {rule!r}")
