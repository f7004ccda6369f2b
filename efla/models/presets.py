"""Named model sizes: ``tiny`` (CPU), ``340m`` and ``1.3b`` (the paper's and flash-linear-attention's
DeltaNet sizes), each as ``efla``, ``gated-efla``, ``deltanet`` and ``gated-deltanet``.

Sizes (head dim 128 as in the paper; 32000-token vocabulary as with the Mistral tokenizer):

=======  ======  ======  =====  ========  =============================================
size     hidden  layers  heads  head dim  notes
=======  ======  ======  =====  ========  =============================================
tiny     64      2       2      32        vocabulary 256; trains on a CPU in seconds
340m     1024    24      8      128
1.3b     2048    24      16     128
=======  ======  ======  =====  ========  =============================================

Ungated variants use flash-linear-attention's DeltaNet defaults (``expand_k = expand_v = 1``,
no output gate); gated variants use the Gated DeltaNet layer with the same q/k heads,
``expand_v = 1`` and the SiLU output gate. The output gate adds a hidden x value projection to every
layer, so the 340m and 1.3b gated presets have 22 layers instead of 24: that keeps their parameter
count within 1% of (and below) the ungated presets' (371.9M vs 374.4M, 1,355.8M vs 1,365.7M), the
way Gated DeltaNet's own 340M configuration trades depth for its wider layers. ``tiny`` keeps its
2 layers. EFLA and DeltaNet presets of one size (and the two gated ones) have identical parameters;
only ``update_rule`` differs.

``tiny-hybrid-efla`` is ``tiny-efla`` with its second (last) block replaced by causal softmax
attention (2 heads of 32, RoPE; config ``attn``): a hybrid model small enough for the CPU.

Examples:
    >>> from efla.models import get_preset_config
    >>> cfg = get_preset_config("340m-efla")
    >>> cfg.hidden_size, cfg.num_heads, cfg.update_rule, cfg.gated
    (1024, 8, 'exact', False)
"""

from __future__ import annotations

from typing import Any

from .configuration_efla import EFLAConfig

__all__ = ["GATED_LAYERS", "PRESETS", "SIZES", "VARIANTS", "get_preset_config", "preset_names"]

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32),
    "340m": dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=24, num_heads=8, head_dim=128),
    "1.3b": dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=24, num_heads=16, head_dim=128),
}

VARIANTS: dict[str, dict[str, Any]] = {
    "efla": dict(update_rule="exact", gated=False),
    "deltanet": dict(update_rule="euler", gated=False),
    "gated-efla": dict(update_rule="exact", gated=True, expand_v=1.0, use_gate=True),
    "gated-deltanet": dict(update_rule="euler", gated=True, expand_v=1.0, use_gate=True),
}

# depth of the gated presets, chosen to match the ungated presets' parameter count (see above)
GATED_LAYERS: dict[str, int] = {"340m": 22, "1.3b": 22}

_COMMON: dict[str, Any] = dict(
    conv_size=4,
    use_short_conv=True,
    hidden_ratio=4,
    norm_eps=1e-6,
    initializer_range=0.02,
    tie_word_embeddings=False,
)


def _preset(size: str, variant: str) -> dict[str, Any]:
    preset = {**_COMMON, **SIZES[size], **VARIANTS[variant]}
    if VARIANTS[variant]["gated"] and size in GATED_LAYERS:
        preset["num_hidden_layers"] = GATED_LAYERS[size]
    return preset


PRESETS: dict[str, dict[str, Any]] = {f"{size}-{variant}": _preset(size, variant) for size in SIZES for variant in VARIANTS}
PRESETS["tiny-hybrid-efla"] = {**PRESETS["tiny-efla"], "attn": {"layers": [1], "num_heads": 2}}


def preset_names() -> list[str]:
    """All preset names, e.g. ``"tiny-efla"``, ``"340m-gated-deltanet"``, ``"1.3b-efla"``, ``"tiny-hybrid-efla"``."""
    return list(PRESETS)


def get_preset_config(name: str, **overrides: Any) -> EFLAConfig:
    """The ``EFLAConfig`` of preset ``name`` (case-insensitive; ``_`` and ``-`` are the same),
    with any field replaced by ``overrides``.

    Raises:
        ValueError: unknown ``name`` (the message lists the valid ones).
    """
    if not isinstance(name, str):
        raise ValueError(f"name: expected a preset name string, got {type(name).__name__}")
    key = name.strip().lower().replace("_", "-")
    if key not in PRESETS:
        raise ValueError(f"name: unknown preset {name!r}; expected one of {', '.join(PRESETS)}")
    return EFLAConfig(**{**PRESETS[key], **overrides})
