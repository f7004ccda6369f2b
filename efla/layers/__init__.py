"""Token-mixing layers: ``EFLA`` (DeltaNet architecture) and ``GatedEFLA`` (Gated DeltaNet
architecture), each with ``update_rule="exact"`` (EFLA) or ``"euler"`` (the original
DeltaNet / Gated DeltaNet step), plus their building blocks, and the softmax ``Attention`` of
hybrid models.

Examples:
    >>> import torch
    >>> from efla.layers import EFLA
    >>> layer = EFLA(hidden_size=64, num_heads=2, update_rule="exact")
    >>> o, _, _ = layer(torch.randn(2, 16, 64))
    >>> o.shape
    torch.Size([2, 16, 64])
"""

from .attention import Attention
from .efla import EFLA
from .gated_efla import GatedEFLA
from .modules import GatedMLP, RMSNorm, RMSNormGated, ShortConvolution, l2_normalize

__all__ = ["Attention", "EFLA", "GatedEFLA", "GatedMLP", "RMSNorm", "RMSNormGated", "ShortConvolution", "l2_normalize"]
