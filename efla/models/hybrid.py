"""The ``attn`` field of :class:`~efla.models.EFLAConfig`: which blocks use softmax attention.

The keys are flash-linear-attention's, so its hybrid configs carry over unchanged:
``{"layers": [...], "num_heads": H, "num_kv_heads": ..., "qkv_bias": ..., "window_size": ...,
"rope_theta": ...}``.
"""

from __future__ import annotations

import math
from typing import Any

from efla.layers.attention import Attention

__all__ = ["ATTN_DEFAULTS", "parse_attn_spec", "attn_spec_for_layer", "build_attention_layer"]

ATTN_DEFAULTS: dict[str, Any] = {"num_kv_heads": None, "qkv_bias": False, "window_size": None, "rope_theta": 10000.0}
_REQUIRED = ("layers", "num_heads")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_layers(layers: Any, num_hidden_layers: int) -> list[int]:
    if not isinstance(layers, (list, tuple)):
        raise ValueError(f"attn['layers']: expected a list of layer indices, got {layers!r}")
    for i in layers:
        if not _is_int(i):
            raise ValueError(f"attn['layers']: expected int layer indices, got {i!r}")
        if not 0 <= i < num_hidden_layers:
            raise ValueError(
                f"attn['layers']: layer {i} is out of range for num_hidden_layers = {num_hidden_layers} "
                f"(expected 0 <= index < {num_hidden_layers})"
            )
    duplicates = sorted({i for i in layers if list(layers).count(i) > 1})
    if duplicates:
        raise ValueError(f"attn['layers']: layer(s) {duplicates} listed more than once")
    return list(layers)


def _check_heads(num_heads: Any, num_kv_heads: Any, hidden_size: int) -> int:
    for name, val in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if not _is_int(val) or val < 1:
            raise ValueError(f"attn['{name}']: expected a positive int, got {val!r}")
    if hidden_size % num_heads:
        raise ValueError(f"attn['num_heads']: {num_heads} heads do not divide hidden_size = {hidden_size}")
    if (hidden_size // num_heads) % 2:
        raise ValueError(
            f"attn['num_heads']: head dim hidden_size / num_heads = {hidden_size // num_heads} must be "
            "even (rotary embeddings rotate pairs of channels)"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"attn['num_kv_heads']: {num_kv_heads} key/value heads do not divide num_heads = {num_heads}")
    return num_kv_heads


def _check_options(spec: dict) -> None:
    if not isinstance(spec["qkv_bias"], bool):
        raise ValueError(f"attn['qkv_bias']: expected True or False, got {spec['qkv_bias']!r}")
    window = spec["window_size"]
    if window is not None and (not _is_int(window) or window < 1):
        raise ValueError(f"attn['window_size']: expected None or a positive int, got {window!r}")
    theta = spec["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"attn['rope_theta']: expected a positive finite number, got {theta!r}")


def parse_attn_spec(attn: Any, num_hidden_layers: int, hidden_size: int) -> dict | None:
    """A validated copy of ``attn`` with every key present (defaults filled in), or ``None``.

    Raises:
        ValueError: not a dict, a missing or unknown key, a layer index out of range or repeated,
            heads that do not divide ``hidden_size`` (or ``num_kv_heads`` that do not divide
            ``num_heads``), an odd head dim, or an invalid ``qkv_bias``/``window_size``/``rope_theta``.
    """
    if attn is None:
        return None
    if isinstance(attn, list):
        raise ValueError(
            "attn: expected one dict of attention settings; a list of several specifications "
            "(different settings per layer) is not supported"
        )
    if not isinstance(attn, dict):
        raise ValueError(f"attn: expected None or a dict like {{'layers': [1], 'num_heads': 4}}, got {attn!r}")
    missing = [k for k in _REQUIRED if k not in attn]
    if missing:
        raise ValueError(f"attn: missing required key(s) {missing} (got {sorted(attn)})")
    unknown = sorted(set(attn) - set(_REQUIRED) - set(ATTN_DEFAULTS))
    if unknown:
        raise ValueError(f"attn: unknown key(s) {unknown}; expected {list(_REQUIRED) + list(ATTN_DEFAULTS)}")
    spec = {**ATTN_DEFAULTS, **attn}
    if spec["num_kv_heads"] is None:
        spec["num_kv_heads"] = spec["num_heads"]
    spec["layers"] = _check_layers(spec["layers"], num_hidden_layers)
    _check_heads(spec["num_heads"], spec["num_kv_heads"], hidden_size)
    _check_options(spec)
    spec["rope_theta"] = float(spec["rope_theta"])
    return spec


def attn_spec_for_layer(attn: dict | None, layer_idx: int) -> dict | None:
    """``attn`` when block ``layer_idx`` is a softmax-attention layer, else ``None``."""
    if attn is None or layer_idx not in attn["layers"]:
        return None
    return attn


def build_attention_layer(config: Any, layer_idx: int) -> Attention | None:
    """The softmax-attention token mixer of block ``layer_idx``, or ``None`` for a linear block."""
    spec = attn_spec_for_layer(getattr(config, "attn", None), layer_idx)
    if spec is None:
        return None
    return Attention(
        hidden_size=config.hidden_size,
        num_heads=spec["num_heads"],
        num_kv_heads=spec["num_kv_heads"],
        qkv_bias=spec["qkv_bias"],
        window_size=spec["window_size"],
        rope_theta=spec["rope_theta"],
        max_position_embeddings=config.max_position_embeddings,
        layer_idx=layer_idx,
    )
