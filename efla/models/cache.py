"""``EFLACache``: per-layer recurrent state and short-convolution states for generation."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

__all__ = ["EFLACache"]


def _write_attention_rows(pool: dict, state: dict, slots: torch.Tensor) -> None:
    """Scatter a dynamic attention state's keys/values (``[n, S, ...]`` with their positions, -1 for
    padding) into the pool's buffers at ``[slots[row], position]``, and set the rows' lengths."""
    keys, values = state["attn_state"]
    positions = state["key_positions"]
    real = positions >= 0
    rows = slots[:, None].expand_as(positions)[real]
    pool_keys, pool_values = pool["kv_pool"]
    if bool((positions[real] >= pool_keys.shape[1]).any()):
        raise ValueError(
            f"max_length: a prompt reaches position {int(positions.max())}, beyond the {pool_keys.shape[1]} positions allocated"
        )
    pool_keys[rows, positions[real]] = keys[real].to(pool_keys.dtype)
    pool_values[rows, positions[real]] = values[real].to(pool_values.dtype)
    pool["lengths"].index_copy_(0, slots, state["next_position"])


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

    States are updated in place: once a layer holds a state, later steps copy their result into
    the same tensors, so a decoding loop (or a CUDA graph of one step) always finds them at the
    same addresses. ``EFLACache.for_model(model, num_slots)`` allocates every layer's state up front
    as a pool of ``num_slots`` rows (softmax-attention layers: a key/value buffer of ``max_length``
    positions per row); with ``cache.slots`` set to a ``[B]`` index tensor, batch row ``b`` reads
    and writes pool row ``slots[b]`` (the fast decoding loop and a server's request slots work
    so), and with ``cache.fresh_rows`` (``[B]`` bool) set as well, the rows marked there start from a
    zero state instead of their pool rows' (a prefill of new prompts into reused rows).
    ``write_slots`` copies a prefilled cache's states into pool rows.

    Examples:
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
        self.slots: torch.Tensor | None = None
        self.fresh_rows: torch.Tensor | None = None

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_slots: int, max_length: int | None = None) -> EFLACache:
        """Every layer's state allocated once, zeroed, as a pool of ``num_slots`` rows on the model's
        device (recurrent states in float32, convolution histories in the model's dtype); a model
        with softmax-attention layers needs ``max_length``, the positions each row may reach."""
        blocks = model.get_decoder().layers
        weight = next(model.parameters())
        cache = cls(len(blocks))
        for i, block in enumerate(blocks):
            cache.states[i] = block.attn.empty_state(num_slots, weight.device, weight.dtype, max_length)
        return cache

    def first_rows(self, n: int) -> EFLACache:
        """A cache over pool rows ``0 .. n-1`` as views (no ``slots``): its layers read and update
        those rows where they lie, without the gather and scatter of ``slots``."""
        view = EFLACache(len(self.states))
        view.states = [_map_tensors(state, lambda t: t[:n]) if state is not None else None for state in self.states]
        view._seen_tokens = list(self._seen_tokens)
        return view

    # -- layer protocol ---------------------------------------------------------------------------
    def _grow(self, layer_idx: int) -> None:
        while len(self.states) <= layer_idx:
            self.states.append(None)
            self._seen_tokens.append(0)

    def get_layer_state(self, layer_idx: int) -> dict[str, Any] | None:
        """The layer's state for the current batch rows: with ``slots`` set, a copy of those pool rows,
        zeros for the ``fresh_rows`` (softmax-attention pools are returned whole: their layer indexes
        them itself)."""
        state = self.layer_pool(layer_idx)
        if state is None or self.slots is None or "kv_pool" in state:
            return state
        if self.fresh_rows is None:
            return _map_tensors(state, lambda t: t.index_select(0, self.slots))
        return _map_tensors(
            state, lambda t: t.index_select(0, self.slots).masked_fill_(self.fresh_rows.view(-1, *(1,) * (t.dim() - 1)), 0)
        )

    def layer_pool(self, layer_idx: int) -> dict[str, Any] | None:
        """The layer's stored state itself (all pool rows), or ``None``."""
        return self.states[layer_idx] if layer_idx < len(self.states) else None

    def update_layer_state(
        self,
        layer_idx: int,
        recurrent_state: torch.Tensor | None = None,
        conv_state: tuple | None = None,
        offset: int = 1,
        **kwargs: Any,
    ) -> dict[str, Any]:
        self._grow(layer_idx)
        state = self.states[layer_idx] or {"recurrent_state": None, "conv_state": None}
        if recurrent_state is not None:
            state["recurrent_state"] = self._written(state["recurrent_state"], recurrent_state)
        if conv_state is not None:
            old = state["conv_state"] or (None,) * len(conv_state)
            state["conv_state"] = tuple(self._written(o, n) for o, n in zip(old, conv_state))
        self.states[layer_idx] = state
        self._seen_tokens[layer_idx] += int(offset)
        return state

    def _written(self, stored: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """``new`` copied into ``stored`` (into its ``slots`` rows when set) where it fits, else ``new``."""
        if stored is None or stored is new:
            return new
        if self.slots is not None:
            return stored.index_copy_(0, self.slots, new.to(stored.dtype))
        if stored.shape == new.shape and stored.dtype == new.dtype and stored.device == new.device:
            return stored.copy_(new)
        return new

    def write_slots(self, slots: torch.Tensor, source: EFLACache) -> None:
        """Copy the states of ``source`` (a cache of ``len(slots)`` rows, as a prefill leaves it) into
        the pool rows ``slots``; attention keys go to their positions in the key/value buffers."""
        for pool, state in zip(self.states, source.states):
            if pool is None or state is None:
                continue
            if "kv_pool" in pool:
                _write_attention_rows(pool, state, slots)
                continue
            pool["recurrent_state"].index_copy_(0, slots, state["recurrent_state"].to(pool["recurrent_state"].dtype))
            for dst, src in zip(pool["conv_state"] or (), state["conv_state"] or ()):
                dst.index_copy_(0, slots, src.to(dst.dtype))

    def update_attention_state(
        self,
        layer_idx: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        key_positions: torch.Tensor,
        next_position: torch.Tensor,
        window_size: int | None = None,
        offset: int = 1,
    ) -> dict[str, Any]:
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

    def advance_layer(self, layer_idx: int, offset: int = 1) -> None:
        """Count ``offset`` tokens seen by a layer that updated its pools itself."""
        self._seen_tokens[layer_idx] += int(offset)

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

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:  # noqa: ARG002 (transformers' Cache interface)
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
        if self.slots is not None:
            return self.slots.shape[0]
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
