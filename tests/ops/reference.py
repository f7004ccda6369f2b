"""Independent references for the exact rules: the ODE solved token by token by a matrix exponential.

For one token and one head, the state obeys dS/dtau = -A S + b on an interval of length h.
With X = [S; I_V] ((K+V) x V), dX/dtau = M X for M = [[-A, b], [0, 0]], so
S_new = E11 S + E12 where E = matrix_exp(h M). This uses nothing from ``efla.ops``: it checks
``efla.ops.naive`` (the tests' reference for every rule) and, for stiff inputs, the ops directly.

- EFLA:        A = k k^T,                     b = k v^T,      h = beta
- Gated EFLA:  A = (1 - e^g) I + e^g beta k k^T, b = beta k v^T, h = 1

Grouped values (``v [B, T, HV, V]``, ``HV`` a multiple of the ``H`` q/k heads): value head ``i``
runs the recurrence above with query/key head ``i // (HV // H)``.
"""

from __future__ import annotations

import torch


def _exact_step(S, A, b, h):
    """S [..., K, V], A [..., K, K], b [..., K, V], h [...] -> exp(-hA) S + int_0^h exp(-(h-s)A) b ds."""
    K, V = b.shape[-2], b.shape[-1]
    M = torch.zeros(*A.shape[:-2], K + V, K + V, dtype=A.dtype, device=A.device)
    M[..., :K, :K] = -A
    M[..., :K, K:] = b
    E = torch.linalg.matrix_exp(h[..., None, None] * M)
    return E[..., :K, :K] @ S + E[..., :K, K:]


def per_value_head(q, k, HV):
    """q, k indexed by value head: value head i reads query/key head i // (HV // H)."""
    H = q.shape[2]
    shared = torch.arange(HV) // (HV // H)
    return q[:, :, shared], k[:, :, shared]


def matrix_exp_reference(rule, q, k, v, beta, g=None, *, scale=None, initial_state=None):
    """Exact rules only. Return (o [B, T, HV, V], final state [B, HV, K, V]) in q's dtype;
    differentiable."""
    return _exact_scan(_exact_step, rule, q, k, v, beta, g, scale=scale, initial_state=initial_state)


def _spectral_step(S, A, b, h):
    """Same step as ``_exact_step`` through the eigendecomposition of the symmetric A: better
    conditioned for stiff steps (h * ||A|| ~ 1e10), where scaling-and-squaring loses digits."""
    mu, Qm = torch.linalg.eigh(A)
    x = h[..., None] * mu
    decay = torch.exp(-x)
    small = x.abs() < 1e-8
    integ = torch.where(small, h[..., None] * (1 - x / 2), -torch.expm1(-x) / torch.where(small, torch.ones_like(mu), mu))
    QT = Qm.transpose(-1, -2)
    return Qm @ (decay[..., :, None] * (QT @ S)) + Qm @ (integ[..., :, None] * (QT @ b))


def spectral_reference(rule, q, k, v, beta, g=None, *, scale=None, initial_state=None):
    """Exact rules only, through eigh instead of matrix_exp (for stiff inputs)."""
    return _exact_scan(_spectral_step, rule, q, k, v, beta, g, scale=scale, initial_state=initial_state)


def _exact_scan(exact_step, rule, q, k, v, beta, g, *, scale, initial_state):
    q, k = per_value_head(q, k, v.shape[2])
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    S = torch.zeros(B, H, K, V, dtype=q.dtype) if initial_state is None else initial_state.to(q.dtype)
    eye = torch.eye(K, dtype=q.dtype)
    outs = []
    for t in range(T):
        kt, vt, bt = k[:, t], v[:, t], beta[:, t]
        kkT = kt[..., :, None] * kt[..., None, :]
        kvT = kt[..., :, None] * vt[..., None, :]
        if rule == "efla":
            S = exact_step(S, kkT, kvT, bt)
        elif rule == "gated_efla":
            gate = torch.exp(g[:, t])[..., None, None]
            A = (1 - gate) * eye + gate * bt[..., None, None] * kkT
            S = exact_step(S, A, bt[..., None, None] * kvT, torch.ones_like(bt))
        else:
            raise ValueError(f"rule: the exact references solve efla and gated_efla only, got {rule!r}")
        outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, 1), S
