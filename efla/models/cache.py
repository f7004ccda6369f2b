"""``EFLACache``: per-layer recurrent state and short-convolution states for generation."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

__all__ = ["EFLACache"]


def _map_tensors(obj: Any, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


class EFLACache(Cache):
    """The decoding state of an EFLA model: per layer a dict with

    - ``"recurrent_state"``: ``[N, HV, K, V]`` float32 (float64 for float64 models), the matrix
      state ``S`` of every value head (``HV = num_v_heads``, by default ``num_heads``);
    - ``"conv_state"``: ``(q, k, v)`` short-convolution histories, each ``[N, D, conv_size]``,
      or ``None`` without short convolutions;

    and the number of tokens seen. ``N`` is the batch size (or the number of packed sequences).
    Softmax-attention layers of a hybrid model (config ``attn``) keep instead

    - ``"attn_state"``: ``(keys, values)``, each ``[N, S, num_kv_heads, head_dim]`` (keys rotated);
    - ``"key_positions"``: ``[N, S]`` long, each key's position (``-1``: padding, never read);
    - ``"next_position"``: ``[N]`` long, the position of the row's next token;

    with a sliding window only the keys a later query can still see (growing with the sequence
    otherwise).

    It subclasses ``transformers.cache_utils.Cache`` so ``generate()`` accepts it, but stores
    its own per-layer dicts (linear attention keeps no per-token keys/values): the size is
    constant in the sequence length for linear layers. Layers use ``get_layer_state(i)`` and
    ``update_layer_state(i, recurrent_state=..., conv_state=..., offset=T)`` (attention layers:
    ``update_attention_state``).

    Example:
        >>> cache = EFLACache()
        >>> cache.get_seq_length()
        0
    """

    is_compileable = False

    def __init__(self, num_layers: int | None = None, **kwargs: Any):
        # The base class's layer machinery (key/value layers) does not apply; set what its
        # generic helpers read, and keep our own state list.
        self.layers = []
        self.layer_class_to_replicate = None
        self.offloading = False
        self.states: list[dict[str, Any] | None] = [None] * (num_layers or 0)
        self._seen_tokens: list[int] = [0] * (num_layers or 0)

    # -- layer protocol ---------------------------------------------------------------------------
    def _grow(self, layer_idx: int) -> None:
        while len(self.states) <= layer_idx:
            self.states.append(None)
            self._seen_tokens.append(0)

    def get_layer_state(self, layer_idx: int) -> dict[str, Any] | None:
        if layer_idx < len(self.states):
            return self.states[layer_idx]
        return None

    def update_layer_state(self, layer_idx: int, recurrent_state: torch.Tensor | None = None,
                           conv_state: tuple | None = None, offset: int = 1, **kwargs: Any) -> dict[str, Any]:
        self._grow(layer_idx)
        state = self.states[layer_idx] or {"recurrent_state": None, "conv_state": None}
        if recurrent_state is not None:
            state["recurrent_state"] = recurrent_state
        if conv_state is not None:
            state["conv_state"] = tuple(conv_state)
        self.states[layer_idx] = state
        self._seen_tokens[layer_idx] += int(offset)
        return state

    def update_attention_state(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor,
                               key_positions: torch.Tensor, next_position: torch.Tensor,
                               window_size: int | None = None, offset: int = 1) -> dict[str, Any]:
        """Store an attention layer's keys/values (all of them so far, the new ones included); with
        ``window_size`` drop the oldest keys that no row's later queries can see."""
        self._grow(layer_idx)
        if window_size is not None:
            visible = (key_positions >= 0) & (key_positions > next_position[:, None] - window_size)
            needed = visible.any(0).nonzero()
            first = int(needed[0]) if len(needed) else key_positions.shape[1]
            keys, values, key_positions = keys[:, first:], values[:, first:], key_positions[:, first:]
        state = {"attn_state": (keys, values), "key_positions": key_positions, "next_position": next_position}
        self.states[layer_idx] = state
        self._seen_tokens[layer_idx] += int(offset)
        return state

    # -- transformers Cache API used by generate() ---------------------------------------------------
    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, layer_idx: int) -> dict[str, Any]:
        if layer_idx >= len(self.states) or self.states[layer_idx] is None:
            raise KeyError(f"layer_idx: the cache holds no state for layer {layer_idx} ({len(self.states)} layers)")
        return self.states[layer_idx]

    def __iter__(self):
        yield from self.states

    def __repr__(self) -> str:
        return f"EFLACache(layers={len(self.states)}, seen_tokens={self.get_seq_length()})"

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        idx = 0 if layer_idx is None else layer_idx
        return self._seen_tokens[idx] if idx < len(self._seen_tokens) else 0

    def get_max_length(self) -> int | None:
        return None

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return 0, 0

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return any(s is not None for s in self.states)

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.states)

    @property
    def is_linear(self) -> list[bool]:
        return [True] * len(self.states)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self.states)

    @property
    def batch_size(self) -> int:
        for s in self.states:
            if s is not None and s.get("recurrent_state") is not None:
                return s["recurrent_state"].shape[0]
            if s is not None and "next_position" in s:
                return s["next_position"].shape[0]
        return -1

    def _apply(self, fn) -> None:
        self.states = [None if s is None else _map_tensors(s, fn) for s in self.states]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select batch rows (beam search)."""
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("EFLACache cannot be cropped: the recurrent state cannot forget tokens")

    def activate_past_recording(self) -> None:
        raise NotImplementedError("EFLACache cannot record past states (no rollback for recurrent states)")

    def reset(self) -> None:
        self.states = [None] * len(self.states)
        self._seen_tokens = [0] * len(self._seen_tokens)

    def offload(self, *args, **kwargs) -> None:  # pragma: no cover - no offloading for constant-size states
        return None

    def prefetch(self, *args, **kwargs) -> None:  # pragma: no cover
        return None
