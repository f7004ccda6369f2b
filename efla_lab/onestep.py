"""The exact-vs-Euler one-step picture, computed through the ops."""

from __future__ import annotations

import math

import torch

from efla.ops import recurrent_delta_rule, recurrent_efla


def one_step_table(points=None, K: int = 16, seed: int = 0) -> list[dict]:
    """For each stiffness ``x = beta * lambda``: the eigenvalue of each transition along ``k``
    and the relative one-step difference ``||S_exact - S_euler|| / ||S_0||``.

    Uses a unit key (``lambda = 1``) so ``beta = x``; the state ``S_0`` and value are random.
    """
    if points is None:
        points = [1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 2.0, 3.0, 5.0, 10.0]
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 1, 1, K, generator=gen, dtype=torch.float64)
    k = k / k.norm()
    v = torch.randn(1, 1, 1, K, generator=gen, dtype=torch.float64)
    q = torch.randn(1, 1, 1, K, generator=gen, dtype=torch.float64)
    S0 = torch.randn(1, 1, K, K, generator=gen, dtype=torch.float64)
    rows = []
    for x in points:
        beta = torch.full((1, 1, 1), float(x), dtype=torch.float64)
        Se = recurrent_efla(q, k, v, beta, initial_state=S0, output_final_state=True)[1]
        Su = recurrent_delta_rule(q, k, v, beta, initial_state=S0, output_final_state=True)[1]
        rows.append(
            dict(
                beta_lambda=float(x),
                euler_eigenvalue=1.0 - x,
                exact_eigenvalue=math.exp(-x),
                one_step_rel_diff=((Se - Su).norm() / S0.norm()).item(),
                euler_expands=abs(1.0 - x) > 1.0,
            )
        )
    return rows
