"""The chunk ops through flash-linear-attention's public functions: the path for an fla release
whose private stage kernels efla was not tested with (``supported.py``).

EFLA is a delta-rule step with ``beta -> alpha = (1 - exp(-beta ||k||^2)) / ||k||^2``, so it runs
fla's ``chunk_delta_rule`` with ``alpha`` as its ``beta``. Gated EFLA is a gated delta-rule step
with decay log ``expm1(g)``, erase ``c`` and value ``v * (w / c)`` (the mapping of ``kernels.py``),
so it runs fla's ``chunk_gated_delta_rule``. The Euler rules are fla's functions as they are.

The coefficients come from ``efla.ops.coefficients`` in float64, from the raw keys, and q and k are
L2-normalised in PyTorch where asked, so autograd carries fla's gradients of its ``beta``, ``g``
and values back into ``beta``, ``g``, ``k`` and ``v``. Slower than the stage path (a few PyTorch
kernels per coefficient, and fla's functions break a ``torch.compile`` graph), the same results up
to rounding. fla 0.6's own gated backward refuses Triton 3.4-3.7.0 on Hopper (our stage path has a
kernel of its own for that stage), which is one reason the cuda extra pins the tested fla release.
"""

from __future__ import annotations

import warnings

import torch

from efla import environment

from ..coefficients import COEF_DTYPE, exact_erase, key_energy, phi
from ..gates import activate
from ..normalize import l2_normalize
from ..validate import compute_dtype
from .kernels import G_FLOOR

FLA = None  # fla's public chunk functions by rule, filled by load()


def load() -> dict:
    """fla's public chunk functions, or raise what their import raised."""
    global FLA
    if FLA is None:
        from fla.ops.delta_rule import chunk_delta_rule
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        FLA = dict(delta_rule=chunk_delta_rule, gated_delta_rule=chunk_gated_delta_rule)
    return FLA


def _warn_of_ignored_switches() -> None:
    """The experimental switches change our stage path only; here they would do nothing unsaid."""
    ignored = [
        variable.name for variable in environment.VARIABLES.values() if variable.experimental and environment.get(variable.name)
    ]
    message = f"efla: {', '.join(ignored)} set, but fla's public chunk functions run instead of efla's stages: no effect"
    if ignored and message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


_warned: set[str] = set()


def chunk_forward(kind, q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, q_l2norm=False, k_l2norm=False, gates=None):
    """``(o, final_state or None)`` as ``custom_ops.chunk_forward`` returns it, through fla's public
    functions; ``gates``: raw gate inputs (Gated EFLA), activated here first."""
    fla = load()
    _warn_of_ignored_switches()
    g, beta = activate(g, beta, gates)
    q = l2_normalize(q) if q_l2norm else q
    k = l2_normalize(k) if k_l2norm else k
    state = dict(scale=scale, initial_state=h0, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if kind == "efla":
        o, ht = fla["delta_rule"](q, k, v, exact_step(k, beta), **state)
    elif kind == "delta_rule":
        o, ht = fla["delta_rule"](q, k, v, beta, **state)
    elif kind == "gated_efla":
        log_gate, erase, value = gated_exact_step(k, v, g, beta)
        o, ht = fla["gated_delta_rule"](q, k, value, log_gate, erase, **state)
    else:
        o, ht = fla["gated_delta_rule"](q, k, v, g, beta, **state)
    return o, (ht if output_final_state else None)


def coefficient_dtype(k) -> torch.dtype:
    """bf16 for bf16 keys, as fla's DeltaNet takes its ``beta`` (and the stage path stores its
    coefficients); float32 otherwise (``1 / ||k||^2`` underflows fp16)."""
    return torch.bfloat16 if k.dtype == torch.bfloat16 else torch.float32


def exact_step(k, beta):
    """EFLA's ``alpha`` as fla's delta-rule ``beta``."""
    return exact_erase(beta, key_energy(k)).to(coefficient_dtype(k))


def gated_exact_step(k, v, g, beta):
    """Gated EFLA as fla's gated delta-rule inputs ``(g, beta, v)``: the decay log ``expm1(g)``
    (float32), the erase ``c`` and the value ``v * (w / c)``. The ratio is formed as
    ``phi(eta) / (a phi(x1))`` (finite where ``beta = 0``), with ``a = exp(max(g, G_FLOOR))`` as in the
    kernels: where ``e^g`` underflows, ``c`` stays nil and ``c * (w / c)`` stays ``w``."""
    lam = key_energy(k)
    g64 = g.to(COEF_DTYPE)
    gate = torch.exp(g64.clamp_min(G_FLOOR))
    rho = gate * beta.to(COEF_DTYPE)
    x1 = rho * lam
    log_gate = torch.expm1(g64)
    ratio = phi(x1 - log_gate) / (gate * phi(x1))
    cdt = compute_dtype(v.dtype)
    value = (v.to(cdt) * ratio.to(cdt)[..., None]).to(v.dtype)
    return log_gate.float(), exact_erase(rho, lam).to(coefficient_dtype(k)), value
