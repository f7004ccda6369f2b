"""The readable version: each rule as a plain per-token loop, written from the equations.

Per value head, with a state ``S [K, V]``, a key ``k``, a value ``v`` and a step size ``beta``:

| rule                    | one step                                                               |
| ----------------------- | ---------------------------------------------------------------------- |
| DeltaNet (Euler)        | ``S = S - beta k (k^T S) + beta k v^T``                                |
| EFLA (exact flow)       | the same with ``beta -> alpha = (1 - exp(-beta ||k||^2)) / ||k||^2``   |
| Gated DeltaNet          | ``S = exp(g) (I - beta k k^T) S + beta k v^T``                         |
| Gated EFLA (exact flow) | ``S = exp(log_decay) (I - erase k k^T) S + write k v^T``               |

and after each step the read-out ``o_t = S_t^T (scale q_t)``. The exact coefficients come from
``efla_coefficient`` and ``gated_efla_coefficients``. Each function here takes the arguments of
the op of the same name in ``efla.ops`` (``recurrent_efla`` and so on: the keywords ``scale``,
``initial_state``, ``output_final_state``, ``cu_seqlens``, ``use_q_l2norm_in_kernel`` and
``use_qk_l2norm_in_kernel``, and grouped value heads) and returns the same ``(o, final_state)``;
they are slow (one Python step per token) and exist to be read and to be the tests' reference.
"""

from __future__ import annotations

import torch

from .coefficients import efla_coefficient, gated_efla_coefficients
from .normalize import l2_normalize
from .validate import compute_dtype

__all__ = [
    "efla",
    "gated_efla",
    "delta_rule",
    "gated_delta_rule",
    "efla_step",
    "gated_efla_step",
    "delta_rule_step",
    "gated_delta_rule_step",
    "delta_update",
    "scan",
]


def outer(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x y^T`` per head: ``[H, K] x [H, V] -> [H, K, V]``."""
    return x[..., :, None] * y[..., None, :]


def times(c: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """A per-head scalar ``c [H]`` times a per-head matrix ``S [H, K, V]``."""
    return c[..., None, None] * S


def delta_update(S, k, v, erase, write):
    """``S - erase k (k^T S) + write k v^T`` = ``(I - erase k k^T) S + write k v^T``, every rule's
    update; S [H, K, V], k [H, K], v [H, V], erase and write [H]."""
    k_S = torch.einsum("hk,hkv->hv", k, S)  # k^T S
    return S - times(erase, outer(k, k_S)) + times(write, outer(k, v))


def delta_rule_step(S, k, v, beta):
    """DeltaNet: ``S - beta k (k^T S) + beta k v^T``."""
    return delta_update(S, k, v, beta, beta)


def efla_step(S, k, v, beta):
    """EFLA: DeltaNet's step with the exact coefficient ``alpha`` in place of ``beta``."""
    alpha = efla_coefficient(beta, k)
    return delta_update(S, k, v, alpha, alpha)


def gated_delta_rule_step(S, k, v, beta, g):
    """Gated DeltaNet: ``exp(g) (I - beta k k^T) S + beta k v^T``."""
    return delta_update(times(torch.exp(g), S), k, v, beta, beta)


def gated_efla_step(S, k, v, beta, g):
    """Gated EFLA: ``exp(log_decay) (I - erase k k^T) S + write k v^T``, the exact flow over one token."""
    log_decay, erase, write = gated_efla_coefficients(beta, k, g)
    return delta_update(times(torch.exp(log_decay), S), k, v, erase, write)


def _sequences(B: int, T: int, cu_seqlens):
    """``(row, start, end)`` of each sequence: the B rows, or the ``cu_seqlens`` pieces of row 0."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = [int(c) for c in cu_seqlens.tolist()]
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def _per_value_head(q, k, v, q_l2norm, k_l2norm):
    """q, k, v in the compute dtype (as the ops: float64 stays, the rest runs in float32), q and k
    normalised as asked and repeated so that value head ``i`` has q/k head ``i // (HV // H)``."""
    dtype = compute_dtype(q.dtype)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if q_l2norm:
        q = l2_normalize(q)
    if k_l2norm:
        k = l2_normalize(k)
    groups = v.shape[2] // q.shape[2]
    return q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2), v


def scan(
    step,
    q,
    k,
    v,
    beta,
    g=None,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_q_l2norm_in_kernel=False,
    use_qk_l2norm_in_kernel=False,
):
    """Run ``step`` token by token over each sequence, reading ``o_t = S_t^T (scale q_t)`` after
    each step; every sequence starts from its row of ``initial_state`` (or zeros)."""
    out_dtype, (B, T, _, K) = q.dtype, q.shape
    q, k, v = _per_value_head(q, k, v, use_q_l2norm_in_kernel or use_qk_l2norm_in_kernel, use_qk_l2norm_in_kernel)
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    gate = () if g is None else (g,)
    outputs, finals = [], []
    for n, (b, start, end) in enumerate(_sequences(B, T, cu_seqlens)):
        S = v.new_zeros(HV, K, V) if initial_state is None else initial_state[n].to(v.dtype)
        for t in range(start, end):
            S = step(S, k[b, t], v[b, t], beta[b, t].to(v.dtype), *(x[b, t].to(v.dtype) for x in gate))
            outputs.append(torch.einsum("hkv,hk->hv", S, scale * q[b, t]))
        finals.append(S)
    o = torch.stack(outputs).view(B, T, HV, V).to(out_dtype)
    return o, (torch.stack(finals) if output_final_state else None)


def efla(q, k, v, beta, **options):
    """EFLA: the exact flow of ``dS/dtau = -k k^T S + k v^T`` over ``tau in [0, beta]``; raw keys."""
    return scan(efla_step, q, k, v, beta, **options)


def gated_efla(q, k, v, g, beta, **options):
    """Gated EFLA: the exact flow over ``tau in [0, 1]`` of Gated DeltaNet's ODE
    ``dS/dtau = -((1 - exp(g)) I + exp(g) beta k k^T) S + beta k v^T``."""
    return scan(gated_efla_step, q, k, v, beta, g, **options)


def delta_rule(q, k, v, beta, **options):
    """DeltaNet: one explicit Euler step of EFLA's ODE per token (keys normally unit)."""
    return scan(delta_rule_step, q, k, v, beta, **options)


def gated_delta_rule(q, k, v, g, beta, **options):
    """Gated DeltaNet: DeltaNet's step from the state decayed by ``exp(g)``."""
    return scan(gated_delta_rule_step, q, k, v, beta, g, **options)
