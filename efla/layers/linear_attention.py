"""``LinearAttentionLayer``: the forward that ``EFLA`` and ``GatedEFLA`` share.

Both layers are fla's delta-rule token mixers: input projections, short convolutions on q, k, v,
per-token coefficients, one op that integrates the matrix state (chunkwise, or the per-token
scan), a per-head output norm (gated or not) and an output projection. A subclass supplies what
differs:

- ``GATE_PROJECTIONS``: the projections that feed the coefficients, by the decoding kernel's name
  for their role (``{"beta": "b_proj"}``; the gated layer adds ``"a": "a_proj"``);
- ``_coefficients``: the op's arguments after ``v`` (``(beta,)`` or ``(g, beta)``);
- ``_op``: which op integrates the state;
- ``_gates_in_op`` / ``_gate_kwargs``: whether, and how, the op activates the gates itself.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from efla.distributed.context_parallel import context_parallel_aware, context_parallel_conv_states
from efla.ops import DecodeSpec

from ._common import (
    check_hidden_states,
    check_num_v_heads,
    check_update_rule,
    empty_recurrent_state,
    get_layer_state,
    padding_mask,
    per_value_head,
    project,
    stiffness_stats,
)
from .single_step import decode_pool, fused_decode
from .modules import RMSNorm, RMSNormGated, ShortConvolution, l2_normalize

__all__ = ["LinearAttentionLayer"]

MODES = ("chunk", "recurrent", "fused_recurrent")


def _sum_normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(-1, keepdim=True)


class LinearAttentionLayer(nn.Module):
    """The shared construction steps and forward of the delta-rule token mixers (see the module
    docstring for what a subclass supplies). ``qk_activation`` and ``qk_norm`` default to Gated
    DeltaNet's fixed choices; ``EFLA`` takes them as arguments."""

    GATE_PROJECTIONS: dict[str, str] = {}
    decay_gated = False  # the state decays by a gate g (the op's argument before beta)
    qk_activation = "silu"
    qk_norm = "l2"

    def __init__(
        self,
        *,
        mode: str,
        update_rule: str,
        hidden_size: int,
        num_heads: int,
        num_v_heads: int | None,
        use_gate: bool,
        use_short_conv: bool,
        conv_size: int,
        conv_bias: bool,
        allow_neg_eigval: bool,
        layer_idx: int | None,
        fuse_input_projections: bool,
    ):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode: expected 'chunk' or 'recurrent', got {mode!r}")
        if num_heads < 1:
            raise ValueError(f"num_heads: expected >= 1, got {num_heads}")
        self.mode = "recurrent" if mode == "fused_recurrent" else mode
        self.update_rule = check_update_rule(update_rule)
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_v_heads = check_num_v_heads(num_v_heads, num_heads)
        self.use_gate, self.use_short_conv = use_gate, use_short_conv
        self.conv_size, self.conv_bias = conv_size, conv_bias
        self.allow_neg_eigval = allow_neg_eigval
        self.layer_idx = layer_idx
        self.fuse_input_projections = bool(fuse_input_projections)
        self.record_stats = False
        self.stats: dict | None = None

    # -- construction (subclasses call these in fla's order, which fixes the initial weights) ------
    def _add_qkv_projections(self) -> None:
        self.q_proj = nn.Linear(self.hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.value_dim, bias=False)

    def _add_short_convolutions(self) -> None:
        if not self.use_short_conv:
            warnings.warn(
                "use_short_conv=False: the short convolutions matter for quality; keep them unless you know why not.",
                stacklevel=3,
            )
            return
        qk_act = "silu" if self.qk_activation == "silu" else None
        self.q_conv1d = ShortConvolution(self.key_dim, self.conv_size, bias=self.conv_bias, activation=qk_act)
        self.k_conv1d = ShortConvolution(self.key_dim, self.conv_size, bias=self.conv_bias, activation=qk_act)
        self.v_conv1d = ShortConvolution(self.value_dim, self.conv_size, bias=self.conv_bias, activation="silu")

    def _add_output(self, norm_eps: float, gate_activation: str) -> None:
        if self.use_gate:
            self.g_proj = nn.Linear(self.hidden_size, self.value_dim, bias=False)
            self.o_norm = RMSNormGated(self.head_v_dim, eps=norm_eps, activation=gate_activation)
        else:
            self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps, dtype=torch.float32)
        self.o_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)

    def extra_repr(self) -> str:
        return (
            f"update_rule={self.update_rule!r}, num_heads={self.num_heads}, num_v_heads={self.num_v_heads}, "
            f"head_k_dim={self.head_k_dim}, head_v_dim={self.head_v_dim}"
        )

    # -- what a subclass supplies -------------------------------------------------------------------
    def _coefficients(self, gates: dict, q: torch.Tensor, mask, raw_gates: bool) -> tuple:
        """The op's arguments after ``v`` from the gate projections (``raw_gates``: as projected)."""
        raise NotImplementedError

    def _op(self, recurrent: bool):
        raise NotImplementedError

    def _gates_in_op(self, hidden_states: torch.Tensor, recurrent: bool) -> bool:  # noqa: ARG002 (the gated layer's decision)
        """Whether the op activates the gates itself (with ``_gate_kwargs``)."""
        return False

    def _gate_kwargs(self) -> dict:
        return {}

    # -- recurrence inputs ----------------------------------------------------------------------------
    def _gate_projections(self) -> dict[str, str]:
        """The present ones of ``GATE_PROJECTIONS`` (``EFLA`` has ``b_proj`` only with ``use_beta``)."""
        return {role: name for role, name in self.GATE_PROJECTIONS.items() if hasattr(self, name)}

    def _projections(self, x: torch.Tensor) -> tuple:
        gates = self._gate_projections()
        layers = [self.q_proj, self.k_proj, self.v_proj, *(getattr(self, name) for name in gates.values())]
        q, k, v, *gate_inputs = project(x, layers, self.fuse_input_projections)
        # the output gate stays apart: as a slice of the fused product the gated norm would copy it
        out_gate = self.g_proj(x) if self.use_gate else None
        return q, k, v, dict(zip(gates, gate_inputs)), out_gate

    def input_projections(self, x: torch.Tensor) -> tuple:
        """``(q, k, v, <one per GATE_PROJECTIONS role>, g)`` projections of ``x``; ``None`` for an
        absent one (``b`` without ``use_beta``, ``g`` without ``use_gate``)."""
        q, k, v, gates, out_gate = self._projections(x)
        return q, k, v, *(gates.get(role) for role in self.GATE_PROJECTIONS), out_gate

    def _short_convolutions(self, q, k, v, mask, last_state, use_cache, cu_seqlens) -> tuple:
        if mask is not None:  # padded inputs never enter the convolution windows
            q, k, v = q * mask, k * mask, v * mask
        if not self.use_short_conv:
            if self.qk_activation == "silu":
                q, k = F.silu(q), F.silu(k)
            return q, k, F.silu(v), (None, None, None)
        conv_state = (None, None, None)
        if last_state is not None and last_state.get("conv_state") is not None:
            conv_state = last_state["conv_state"]
        conv_state = context_parallel_conv_states((q, k, v), self.conv_size) or conv_state
        conv_args = {"output_final_state": use_cache, "cu_seqlens": cu_seqlens, "mask": mask}
        q, cq = self.q_conv1d(q, cache=conv_state[0], **conv_args)
        k, ck = self.k_conv1d(k, cache=conv_state[1], **conv_args)
        v, cv = self.v_conv1d(v, cache=conv_state[2], **conv_args)
        return q, k, v, (cq, ck, cv)

    def _qk_act(self, x: torch.Tensor) -> torch.Tensor:
        if self.qk_activation == "relu":
            return F.relu(x)
        if self.qk_activation == "elu":
            return F.elu(x) + 1.0
        return x  # silu is applied by the convolution (or without it, just after); identity

    def _split_heads(self, q, k, v) -> tuple:
        B, T = q.shape[:2]
        q = self._qk_act(q.view(B, T, self.num_heads, self.head_k_dim))
        k = self._qk_act(k.view(B, T, self.num_heads, self.head_k_dim))
        v = v.view(B, T, self.num_v_heads, self.head_v_dim)
        if self.qk_norm == "sum":
            q = _sum_normalize(q)
            if self.update_rule == "euler":
                k = _sum_normalize(k)
        return q, k, v

    def _beta(self, b: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
        beta = b.sigmoid() if b is not None else q.new_ones(*q.shape[:2], self.num_v_heads)
        if self.allow_neg_eigval:
            beta = beta * 2.0
        return beta.to(q.dtype)

    def _recurrence_inputs(self, hidden_states, attention_mask, last_state, use_cache, cu_seqlens, raw_gates=False):
        """``(q, k, v, *coefficients, conv_state, mask, out_gate)``: the op's positional arguments,
        q and k before the L2 normalisation the op fuses into its kernels; the new convolution
        states, the padding mask and the output gate's projection."""
        B, T = hidden_states.shape[:2]
        mask = padding_mask(attention_mask, B, T, cu_seqlens)
        q, k, v, gates, out_gate = self._projections(hidden_states)
        q, k, v, conv_state = self._short_convolutions(q, k, v, mask, last_state, use_cache, cu_seqlens)
        q, k, v = self._split_heads(q, k, v)
        coefficients = self._coefficients(gates, q, mask, raw_gates)
        if mask is not None:  # k = v = 0 (and the gate 1): the step is the identity for every rule
            k, v = k * mask[..., None], v * mask[..., None]
        return q, k, v, *coefficients, conv_state, mask, out_gate

    def _l2_in_op(self) -> tuple[bool, bool]:
        """Which of (q, k) the op L2-normalises: queries always, keys only for the Euler rule."""
        l2 = self.qk_norm == "l2"
        return l2, l2 and self.update_rule == "euler"

    def prepare_qkv_beta(self, hidden_states, attention_mask=None, last_state=None, use_cache=False, cu_seqlens=None):
        """The recurrence inputs per value head, ``q, k [B, T, HV, K]`` (each q/k head repeated for
        its group of value heads, as the op does), ``v [B, T, HV, V]``, the coefficients (``beta``
        or ``g, beta``, each ``[B, T, HV]``, ``g`` in float32; after convolution, activation,
        normalisation and padding mask), plus the new convolution states and the padding mask.
        Useful for tests and analysis."""
        q, k, v, *coefficients, conv_state, mask, _ = self._recurrence_inputs(
            hidden_states, attention_mask, last_state, use_cache, cu_seqlens
        )
        q_l2, k_l2 = self._l2_in_op()
        q, k = (l2_normalize(q) if q_l2 else q), (l2_normalize(k) if k_l2 else k)
        return per_value_head(q, self.num_v_heads), per_value_head(k, self.num_v_heads), v, *coefficients, conv_state, mask

    # -- decoding ---------------------------------------------------------------------------------------
    def decode_spec(self) -> DecodeSpec | None:
        """The constants of this layer's fused decoding step (``efla.ops.fused_decode_step``), or
        ``None`` for the activations and norms it does not cover (relu/elu, sum normalisation)."""
        if self.qk_norm != "l2" or self.qk_activation not in ("silu", "identity"):
            return None
        return DecodeSpec(
            num_heads=self.num_heads,
            groups=self.num_v_heads // self.num_heads,
            head_k_dim=self.head_k_dim,
            head_v_dim=self.head_v_dim,
            exact=self.update_rule == "exact",
            gated=self.decay_gated,
            qk_silu=self.qk_activation == "silu",
            beta_scale=2.0 if self.allow_neg_eigval else 1.0,
            k_l2=self.update_rule == "euler",
            out_gate=self.o_norm.activation if self.use_gate else None,
            norm_eps=self.o_norm.eps,
            conv_size=self.conv_size,
        )

    def empty_state(self, num_slots: int, device, dtype: torch.dtype, max_length: int | None = None) -> dict:  # noqa: ARG002 (transformers' layer call; the attention layers' pool interface)
        """This layer's decoding state for ``num_slots`` rows, zeroed (see ``EFLACache.for_model``)."""
        return empty_recurrent_state(self, num_slots, device, dtype)

    def _fused_step(self, hidden_states, pool, cache):
        names = ["q_proj", "k_proj", "v_proj", *self._gate_projections().values()] + (["g_proj"] if self.use_gate else [])
        return fused_decode(self, hidden_states, cache, pool, names, {**self.GATE_PROJECTIONS, "gate": "g_proj"})

    # -- forward ----------------------------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = False,
        output_attentions: bool | None = False,  # noqa: ARG002 (transformers' layer call; the attention layers' pool interface)
        cu_seqlens: torch.Tensor | None = None,
        **kwargs: Any,
    ):
        B, T = check_hidden_states(hidden_states, self.hidden_size, self.q_proj.weight.dtype)
        if cu_seqlens is not None and B != 1:
            raise ValueError(f"cu_seqlens: packed input needs batch size 1, got hidden_states {tuple(hidden_states.shape)}")
        pool = decode_pool(self, hidden_states, attention_mask, past_key_values, use_cache, cu_seqlens)
        if pool is not None:  # one token per row on the GPU: the fused step, the cache updated in place
            return self._fused_step(hidden_states, pool, past_key_values), None, past_key_values
        last_state = get_layer_state(past_key_values, self.layer_idx)
        use_cache = bool(use_cache) and past_key_values is not None

        recurrent = self.mode == "recurrent" or (T == 1 and cu_seqlens is None)
        raw_gates = self._gates_in_op(hidden_states, recurrent)
        q, k, v, *coefficients, conv_state, mask, out_gate = self._recurrence_inputs(
            hidden_states, attention_mask, last_state, use_cache, cu_seqlens, raw_gates
        )
        initial_state = last_state.get("recurrent_state") if last_state is not None else None
        gate_kwargs = self._gate_kwargs() if raw_gates and mask is None else {}
        o, state = self._integrate(q, k, v, coefficients, initial_state, use_cache, cu_seqlens, recurrent, gate_kwargs)
        if self.record_stats:
            self.stats = self._stiffness_stats(k, coefficients)
        if use_cache:
            conv_state = conv_state if self.use_short_conv else None
            past_key_values.update_layer_state(self.layer_idx, recurrent_state=state, conv_state=conv_state, offset=T)
        return self._output(o, out_gate, mask), None, past_key_values

    def _integrate(self, q, k, v, coefficients, initial_state, use_cache, cu_seqlens, recurrent, gate_kwargs):
        q_l2, k_l2 = self._l2_in_op()
        op = context_parallel_aware(self._op(recurrent))
        return op(
            q,
            k,
            v,
            *coefficients,
            initial_state=initial_state,
            output_final_state=use_cache,
            cu_seqlens=cu_seqlens,
            use_q_l2norm_in_kernel=q_l2,
            use_qk_l2norm_in_kernel=k_l2,
            **gate_kwargs,
        )

    def _stiffness_stats(self, k: torch.Tensor, coefficients: list) -> dict:
        g, beta = coefficients if self.decay_gated else (None, *coefficients)
        k_seen = per_value_head(l2_normalize(k) if self._l2_in_op()[1] else k, self.num_v_heads)
        return stiffness_stats(k_seen, beta, g, self.update_rule)

    def _output(self, o: torch.Tensor, out_gate: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        B, T = o.shape[:2]
        if self.use_gate:
            o = self.o_norm(o, out_gate.reshape(B, T, self.num_v_heads, self.head_v_dim))
        else:
            o = self.o_norm(o)
        o = self.o_proj(o.reshape(B, T, self.value_dim))
        return o * mask if mask is not None else o
