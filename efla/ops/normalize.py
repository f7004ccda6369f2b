"""L2 normalisation of query/key vectors, the PyTorch version of the GPU kernels' prologue."""

from __future__ import annotations

import torch

L2NORM_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(||x||^2 + eps)`` over the last dim, computed in float32 (float64 stays float64),
    returned in x's dtype.

    The ``eps`` inside the root (not a clamp of the norm) matches flash-linear-attention's
    in-kernel q/k normalisation, so a zero vector stays exactly zero.
    """
    xf = x if x.dtype == torch.float64 else x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
