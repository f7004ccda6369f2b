"""High-precision (mpmath, 40 digits) values and numerical derivatives of the exact coefficients,
for testing float32 gradients. Uses nothing from ``efla``: the functions are the textbook formulas
and the derivatives are mpmath's numerical differentiation, not the closed forms the ops use.

With ``a = e^g``, ``rho = a beta``, ``x1 = rho lambda``, ``eta = (1 - a) + x1``:
erase ``c = (1 - e^-x1) / lambda``, write ``w = beta (1 - e^-eta) / eta``, and the ratio
``r = w / c`` that the GPU path folds into the values.
"""

from __future__ import annotations

import mpmath

mpmath.mp.dps = 40


def _phi(x):
    return -mpmath.expm1(-x) / x if x != 0 else mpmath.mpf(1)


def erase(beta, g, lam):
    return -mpmath.expm1(-mpmath.exp(g) * beta * lam) / lam


def write(beta, g, lam):
    return beta * _phi(-mpmath.expm1(g) + mpmath.exp(g) * beta * lam)


def ratio(beta, g, lam):
    a = mpmath.exp(g)
    return _phi(-mpmath.expm1(g) + a * beta * lam) / (a * _phi(a * beta * lam))


def gradient(f, beta: float, g: float, lam: float) -> tuple[float, float, float]:
    """``(df/dbeta, df/dg, df/dlambda)`` at float inputs, each as the nearest float.

    One-sided at the boundaries of the domain (``beta = 0`` or ``g = 0``)."""
    b, gg, lm = mpmath.mpf(beta), mpmath.mpf(g), mpmath.mpf(lam)
    side_b = 1 if beta == 0 else 0
    side_g = -1 if g == 0 else 0
    return (
        float(mpmath.diff(lambda t: f(t, gg, lm), b, direction=side_b)),
        float(mpmath.diff(lambda t: f(b, t, lm), gg, direction=side_g)),
        float(mpmath.diff(lambda t: f(b, gg, t), lm)),
    )
