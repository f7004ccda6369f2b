"""Gate activations inside the gated ops (flash-linear-attention's ``use_gate_in_kernel`` and
``use_beta_sigmoid_in_kernel``).

With them a gated op takes the layer's raw projections: ``g`` is the decay's input ``a`` and the
op forms ``g = -exp(A_log) * softplus(a + dt_bias)`` itself; ``beta`` is a logit and the op forms
``sigmoid(beta)`` (``2 * sigmoid(beta)`` with ``allow_neg_eigval``). The Gated EFLA chunk kernels
on the GPU do this inside their coefficient pass, forward and backward, which spares the layer
the gate's own kernels and autograd nodes; every other path forms the activations with PyTorch
first and runs as if they had been given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .validate import compute_dtype

__all__ = ["RawGates", "raw_gates", "activate", "check_gate_parameters"]


@dataclass(frozen=True)
class RawGates:
    """What turns an op's raw ``g`` and ``beta`` into its log-gate and step size."""

    A_log: torch.Tensor | None  # set: ``g`` is the decay's input, ``[HV]`` parameters
    dt_bias: torch.Tensor | None
    beta_scale: float | None  # set: ``beta`` is a logit, the step ``beta_scale * sigmoid(beta)``

    @property
    def gate_in_kernel(self) -> bool:
        return self.A_log is not None


def raw_gates(
    use_gate_in_kernel: bool, A_log, dt_bias, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool
) -> RawGates | None:
    """The op's gate keywords as one object; ``None`` when both activations are outside the op."""
    if use_gate_in_kernel and A_log is None:
        raise ValueError("A_log: required with use_gate_in_kernel=True (the decay's per-head parameter, [HV])")
    if not use_gate_in_kernel and (A_log is not None or dt_bias is not None):
        raise ValueError("A_log, dt_bias: only used with use_gate_in_kernel=True; pass it, or leave them out")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError(
            "allow_neg_eigval: only used with use_beta_sigmoid_in_kernel=True (it doubles the step "
            "sigmoid(beta)); double a given beta yourself, or pass the logit"
        )
    if not (use_gate_in_kernel or use_beta_sigmoid_in_kernel):
        return None
    beta_scale = (2.0 if allow_neg_eigval else 1.0) if use_beta_sigmoid_in_kernel else None
    return RawGates(A_log if use_gate_in_kernel else None, dt_bias if use_gate_in_kernel else None, beta_scale)


def check_gate_parameters(gates: RawGates, heads: int, device: torch.device) -> None:
    """``A_log`` and ``dt_bias``: floating 1-D tensors of one value per value head, on the op's device."""
    for name, x in (("A_log", gates.A_log), ("dt_bias", gates.dt_bias)):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point torch.Tensor, got {type(x).__name__}")
        if tuple(x.shape) != (heads,):
            raise ValueError(f"{name}: expected shape ({heads},) (one value per value head), got {tuple(x.shape)}")
        if x.device != device:
            raise ValueError(f"{name}: expected device {device} (same as q), got {x.device}")


def activate(g: torch.Tensor | None, beta: torch.Tensor, gates: RawGates | None):
    """``(g, beta)`` with the activations applied in PyTorch (autograd reaches ``A_log`` and
    ``dt_bias``): ``g`` in float32 (float64 for float64 inputs), ``beta`` in its own dtype."""
    if gates is None:
        return g, beta
    if gates.gate_in_kernel:
        cdt = compute_dtype(g.dtype)
        shifted = g.to(cdt) if gates.dt_bias is None else g.to(cdt) + gates.dt_bias.to(cdt)
        g = -gates.A_log.to(cdt).exp() * F.softplus(shifted)
    if gates.beta_scale is not None:
        step = torch.sigmoid(beta.to(compute_dtype(beta.dtype)))
        beta = (step * gates.beta_scale if gates.beta_scale != 1.0 else step).to(beta.dtype)
    return g, beta
