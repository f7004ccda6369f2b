"""flash-linear-attention's fused Triton modules, used by our blocks on CUDA tensors.

Our modules (``RMSNorm``, ``RMSNormGated``, ``ShortConvolution``, ``GatedMLP``), the gated layers'
decay gate (``decay_gate``) and the model's loss keep their parameters and their PyTorch code; on a
CUDA tensor they hand the arithmetic to fla's fused kernels (one pass instead of a chain of float32
elementwise kernels, nothing kept for backward that can be recomputed), the same kernels fla's own
models use by default. Everything else (CPU tensors, float64, fla not installed) runs the PyTorch
code.

``set_enabled(False)`` (or ``EFLA_FLA_KERNELS=0``) forces the PyTorch code everywhere: a control for
speed and numerics comparisons.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import torch

from efla import environment

__all__ = ["kernels_for", "set_enabled", "enabled", "disabled"]

FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_kernels: SimpleNamespace | bool | None = None  # False once the import failed
_enabled: bool | None = None  # set_enabled()'s choice; None: as EFLA_FLA_KERNELS says
# Tests run the kernels on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1).
_allow_cpu = False


# torch.compile runs this once while tracing and keeps the answer (see efla.ops.api._cuda_importable)
@torch.compiler.assume_constant_result
def _importable() -> bool:
    """Import fla's fused functions once; whether they imported."""
    global _kernels
    if _kernels is None:
        try:
            from fla.modules import FusedCrossEntropyLoss, FusedLinearCrossEntropyLoss
            from fla.modules.activations import swiglu_linear
            from fla.modules.activations.ops import swiglu_fwd
            from fla.modules.causal_conv1d import causal_conv1d
            from fla.modules.fused_norm_gate import rms_norm_gated
            from fla.modules.layernorm import rms_norm
            from fla.ops.gated_delta_rule.gate import fused_gdn_gate

            _kernels = SimpleNamespace(
                rms_norm=rms_norm,
                rms_norm_gated=rms_norm_gated,
                causal_conv1d=causal_conv1d,
                swiglu_linear=swiglu_linear,
                swiglu_forward=swiglu_fwd,
                CrossEntropyLoss=FusedCrossEntropyLoss,
                LinearCrossEntropyLoss=FusedLinearCrossEntropyLoss,
                decay_gate=fused_gdn_gate,
            )
        except Exception:  # noqa: BLE001  no triton / no fla / a broken install: the PyTorch code serves
            _kernels = False
    return _kernels is not False


def _load() -> SimpleNamespace | None:
    return _kernels if _importable() else None


def kernels_for(x: torch.Tensor) -> SimpleNamespace | None:
    """fla's fused functions for a tensor ``x`` they can run on, else ``None``."""
    if not enabled() or x.dtype not in FUSED_DTYPES or not (x.is_cuda or _allow_cpu):
        return None
    return _load()


def set_enabled(flag: bool) -> None:
    """Use (True) or bypass (False) the fused kernels, whatever ``EFLA_FLA_KERNELS`` says."""
    global _enabled
    _enabled = bool(flag)


def enabled() -> bool:
    return environment.get("EFLA_FLA_KERNELS") if _enabled is None else _enabled


@contextmanager
def disabled():
    """``with disabled():`` runs the PyTorch code of every block, also on CUDA."""
    global _enabled
    before = _enabled
    set_enabled(False)
    try:
        yield
    finally:
        _enabled = before
