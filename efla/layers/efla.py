"""``EFLA``: the DeltaNet token mixer with the exact-flow update (or the Euler one).

Architecture and parameter names follow flash-linear-attention's ``DeltaNet`` layer, so its
checkpoints load one-to-one; ``update_rule`` only changes how ``q``/``k`` are normalised and
which op integrates the state.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from efla.distributed.context_parallel import context_parallel_aware, context_parallel_conv_states
from efla.ops import DecodeSpec, chunk_delta_rule, chunk_efla, recurrent_delta_rule, recurrent_efla

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
from .decode import decode_pool, fused_decode
from .modules import RMSNorm, RMSNormGated, ShortConvolution, l2_normalize

__all__ = ["EFLA"]

_QK_ACTIVATIONS = ("silu", "relu", "elu", "identity")
_QK_NORMS = ("l2", "sum")


def _sum_normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(-1, keepdim=True)


class EFLA(nn.Module):
    r"""Exact Flow Linear Attention layer (drop-in for flash-linear-attention's ``DeltaNet``).

    Per head, with ``lambda_t = ||k_t||^2``:

    - ``update_rule="exact"`` (EFLA): ``S_t = (I - alpha_t k k^T) S_{t-1} + alpha_t k v^T``,
      ``alpha_t = (1 - exp(-beta_t lambda_t)) / lambda_t``; queries L2-normalised, keys raw.
    - ``update_rule="euler"`` (DeltaNet): ``S_t = (I - beta_t k k^T) S_{t-1} + beta_t k v^T``;
      queries and keys L2-normalised.

    Output ``o_t = K^{-1/2} S_t^T q_t``, per-head RMSNorm (gated by ``silu(g_proj(x))`` when
    ``use_gate``), then ``o_proj``. Both rules have exactly the same parameters.

    Args:
        mode: ``"chunk"`` (chunkwise op for T > 1) or ``"recurrent"`` (always the per-token
            scan). Single-token calls always use the scan. Default ``"chunk"``.
        hidden_size: model width ``D``. Default ``1024``.
        expand_k: key width ``= int(D * expand_k)``. Default ``1.0``.
        expand_v: value width ``= int(D * expand_v)``. Default ``1.0``.
        num_heads: query/key heads ``H``; key head dim ``= key width // H``. Default ``4``.
        use_beta: ``beta = sigmoid(b_proj(x))``; else ``beta = 1``. Default ``True``.
        use_gate: SiLU output gate ``g_proj`` into the output norm. Default ``False``.
        use_short_conv: causal depthwise convolutions on q, k, v. Default ``True``.
        conv_size: convolution width. Default ``4``.
        conv_bias: convolution bias. Default ``False``.
        allow_neg_eigval: ``beta *= 2``. Default ``False``.
        layer_idx: index in the model (needed with a cache). Default ``None``.
        qk_activation: ``"silu"`` | ``"relu"`` | ``"elu"`` | ``"identity"``. Default ``"silu"``.
        qk_norm: ``"l2"`` | ``"sum"``; applied to q always and to k only for ``"euler"``.
            Default ``"l2"``.
        norm_eps: output-norm epsilon. Default ``1e-5``.
        update_rule: ``"exact"`` | ``"euler"``. Default ``"exact"``.
        num_v_heads: value heads ``HV``, a multiple of ``num_heads`` (``None`` = ``num_heads``);
            the value width is split over them (value head dim ``= value width // HV``), each has
            its own ``beta`` and state, and each q/k head serves ``HV // H`` consecutive value
            heads (grouped values). Default ``None``.
        fuse_input_projections: in training, compute the q, k, v (and b) projections of ``x`` as
            one matrix product over their stacked weights (same weights and results, fewer kernel
            launches, no stacked copy kept for backward; see ``_common.project``); the output
            gate's projection runs on its own. Default ``True``.

    Set ``layer.record_stats = True`` to keep, after each forward, a detached ``layer.stats``
    dict of ``[B, T, HV]`` tensors: ``beta``, ``key_norm_sq``, ``stiffness`` (``beta * ||k||^2``),
    ``erase`` and ``transition_eig`` (see ``efla.layers._common.stiffness_stats``).

    ``forward(hidden_states [B, T, D], attention_mask=None [B, T] 0/1, past_key_values=None,
    use_cache=False, cu_seqlens=None)`` returns ``(o [B, T, D], None, past_key_values)``.

    Example:
        >>> import torch
        >>> layer = EFLA(hidden_size=64, num_heads=2)
        >>> layer(torch.randn(2, 10, 64))[0].shape
        torch.Size([2, 10, 64])
    """

    def __init__(
        self,
        mode: str = "chunk",
        hidden_size: int = 1024,
        expand_k: float = 1.0,
        expand_v: float = 1.0,
        num_heads: int = 4,
        use_beta: bool = True,
        use_gate: bool = False,
        use_short_conv: bool = True,
        conv_size: int = 4,
        conv_bias: bool = False,
        allow_neg_eigval: bool = False,
        layer_idx: int | None = None,
        qk_activation: str = "silu",
        qk_norm: str = "l2",
        norm_eps: float = 1e-5,
        update_rule: str = "exact",
        num_v_heads: int | None = None,
        fuse_input_projections: bool = True,
        **kwargs: Any,
    ):
        super().__init__()
        if mode not in ("chunk", "recurrent", "fused_recurrent"):
            raise ValueError(f"mode: expected 'chunk' or 'recurrent', got {mode!r}")
        if qk_activation not in _QK_ACTIVATIONS:
            raise ValueError(f"qk_activation: expected one of {_QK_ACTIVATIONS}, got {qk_activation!r}")
        if qk_norm not in _QK_NORMS:
            raise ValueError(f"qk_norm: expected one of {_QK_NORMS}, got {qk_norm!r}")
        if num_heads < 1:
            raise ValueError(f"num_heads: expected >= 1, got {num_heads}")
        self.mode = "recurrent" if mode == "fused_recurrent" else mode
        self.update_rule = check_update_rule(update_rule)
        self.hidden_size = hidden_size
        self.expand_k, self.expand_v = expand_k, expand_v
        self.num_heads = num_heads
        self.num_v_heads = check_num_v_heads(num_v_heads, num_heads)
        self.use_beta, self.use_gate, self.use_short_conv = use_beta, use_gate, use_short_conv
        self.conv_size, self.conv_bias = conv_size, conv_bias
        self.allow_neg_eigval = allow_neg_eigval
        self.layer_idx = layer_idx
        self.qk_activation, self.qk_norm = qk_activation, qk_norm

        self.key_dim = int(hidden_size * expand_k)
        self.value_dim = int(hidden_size * expand_v)
        if self.key_dim % num_heads != 0:
            raise ValueError(f"num_heads: key dim {self.key_dim} (hidden_size * expand_k) is not divisible by {num_heads}")
        if self.value_dim % self.num_v_heads != 0:
            name = "num_v_heads" if num_v_heads is not None else "num_heads"
            raise ValueError(
                f"{name}: value dim {self.value_dim} (hidden_size * expand_v) is not divisible by {self.num_v_heads}"
            )
        self.head_k_dim = self.key_dim // num_heads
        self.head_v_dim = self.value_dim // self.num_v_heads

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        if use_beta:
            self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        if use_short_conv:
            qk_act = "silu" if qk_activation == "silu" else None
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, activation=qk_act)
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, activation=qk_act)
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, bias=conv_bias, activation="silu")
        else:
            warnings.warn(
                "use_short_conv=False: the short convolutions matter for quality; keep them unless you know why not.",
                stacklevel=2,
            )
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.o_norm = RMSNormGated(self.head_v_dim, eps=norm_eps)
        else:
            self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps, dtype=torch.float32)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.fuse_input_projections = bool(fuse_input_projections)

        self.record_stats = False
        self.stats: dict | None = None

    def extra_repr(self) -> str:
        return (
            f"update_rule={self.update_rule!r}, num_heads={self.num_heads}, num_v_heads={self.num_v_heads}, "
            f"head_k_dim={self.head_k_dim}, head_v_dim={self.head_v_dim}"
        )

    # -- pieces -------------------------------------------------------------------------------------
    def _qk_act(self, x: torch.Tensor) -> torch.Tensor:
        if self.qk_activation == "relu":
            return F.relu(x)
        if self.qk_activation == "elu":
            return F.elu(x) + 1.0
        return x  # silu is applied by the convolution (or below without it); identity

    def input_projections(self, x: torch.Tensor) -> tuple:
        """``(q, k, v, b, g)`` projections of ``x`` (``b``/``g`` are ``None`` without ``use_beta``/``use_gate``)."""
        layers = [self.q_proj, self.k_proj, self.v_proj] + ([self.b_proj] if self.use_beta else [])
        q, k, v, *b = project(x, layers, self.fuse_input_projections)
        # the output gate stays apart: as a slice of the fused product the gated norm would copy it
        return q, k, v, (b[0] if b else None), (self.g_proj(x) if self.use_gate else None)

    def _conv_qkv(self, q, k, v, mask, last_state, use_cache, cu_seqlens):
        if mask is not None:  # padded inputs never enter the convolution windows
            q, k, v = q * mask, k * mask, v * mask
        conv_state = (None, None, None)
        if self.use_short_conv:
            if last_state is not None and last_state.get("conv_state") is not None:
                conv_state = last_state["conv_state"]
            conv_state = context_parallel_conv_states((q, k, v), self.conv_size) or conv_state
            conv_args = {"output_final_state": use_cache, "cu_seqlens": cu_seqlens, "mask": mask}
            q, cq = self.q_conv1d(q, cache=conv_state[0], **conv_args)
            k, ck = self.k_conv1d(k, cache=conv_state[1], **conv_args)
            v, cv = self.v_conv1d(v, cache=conv_state[2], **conv_args)
            conv_state = (cq, ck, cv)
        else:
            if self.qk_activation == "silu":
                q, k = F.silu(q), F.silu(k)
            v = F.silu(v)
        return q, k, v, conv_state

    def prepare_qkv_beta(self, hidden_states, attention_mask=None, last_state=None, use_cache=False, cu_seqlens=None):
        """The recurrence inputs per value head, ``q, k [B, T, HV, K]`` (each q/k head repeated for its
        group of value heads, as the op does), ``v [B, T, HV, V]``, ``beta [B, T, HV]`` (after
        convolution, activation, normalisation and padding mask), plus the new convolution states and
        the padding mask. Useful for tests and analysis."""
        q, k, v, beta, conv_state, mask, _ = self._recurrence_inputs(
            hidden_states, attention_mask, last_state, use_cache, cu_seqlens
        )
        q_l2, k_l2 = self._l2_in_op()
        q, k = (l2_normalize(q) if q_l2 else q), (l2_normalize(k) if k_l2 else k)
        return per_value_head(q, self.num_v_heads), per_value_head(k, self.num_v_heads), v, beta, conv_state, mask

    def _l2_in_op(self) -> tuple[bool, bool]:
        """Which of (q, k) the op L2-normalises: queries always, keys only for the Euler rule."""
        l2 = self.qk_norm == "l2"
        return l2, l2 and self.update_rule == "euler"

    def _recurrence_inputs(self, hidden_states, attention_mask, last_state, use_cache, cu_seqlens):
        # q and k before their L2 normalisation, which the op fuses into its kernels
        B, T = hidden_states.shape[:2]
        mask = padding_mask(attention_mask, B, T, cu_seqlens)
        q, k, v, b, gate = self.input_projections(hidden_states)
        q, k, v, conv_state = self._conv_qkv(q, k, v, mask, last_state, use_cache, cu_seqlens)
        q = self._qk_act(q.view(B, T, self.num_heads, self.head_k_dim))
        k = self._qk_act(k.view(B, T, self.num_heads, self.head_k_dim))
        v = v.view(B, T, self.num_v_heads, self.head_v_dim)
        if self.qk_norm == "sum":
            q = _sum_normalize(q)
            if self.update_rule == "euler":
                k = _sum_normalize(k)
        beta = b.sigmoid() if self.use_beta else q.new_ones(B, T, self.num_v_heads)
        if self.allow_neg_eigval:
            beta = beta * 2.0
        beta = beta.to(q.dtype)
        if mask is not None:  # k = v = 0: the step is the identity for every rule
            k, v = k * mask[..., None], v * mask[..., None]
        return q, k, v, beta, conv_state, mask, gate

    def _op(self, recurrent: bool):
        if self.update_rule == "exact":
            return recurrent_efla if recurrent else chunk_efla
        return recurrent_delta_rule if recurrent else chunk_delta_rule

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
            gated=False,
            qk_silu=self.qk_activation == "silu",
            beta_scale=2.0 if self.allow_neg_eigval else 1.0,
            k_l2=self.update_rule == "euler",
            out_gate="swish" if self.use_gate else None,
            norm_eps=self.o_norm.eps,
            conv_size=self.conv_size,
        )

    def empty_state(self, num_slots: int, device, dtype: torch.dtype, max_length: int | None = None) -> dict:  # noqa: ARG002 (transformers' layer call; the attention layers' pool interface)
        """This layer's decoding state for ``num_slots`` rows, zeroed (see ``EFLACache.for_model``)."""
        return empty_recurrent_state(self, num_slots, device, dtype)

    def _fused_step(self, hidden_states, pool, cache):
        names = ["q_proj", "k_proj", "v_proj"] + (["b_proj"] if self.use_beta else []) + (["g_proj"] if self.use_gate else [])
        return fused_decode(self, hidden_states, cache, pool, names, {"beta": "b_proj", "gate": "g_proj"})

    # -- forward ------------------------------------------------------------------------------------
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

        q, k, v, beta, conv_state, mask, gate = self._recurrence_inputs(
            hidden_states, attention_mask, last_state, use_cache, cu_seqlens
        )
        recurrent = self.mode == "recurrent" or (T == 1 and cu_seqlens is None)
        initial_state = last_state.get("recurrent_state") if last_state is not None else None
        q_l2, k_l2 = self._l2_in_op()
        op = context_parallel_aware(self._op(recurrent))
        o, state = op(
            q,
            k,
            v,
            beta,
            initial_state=initial_state,
            output_final_state=use_cache,
            cu_seqlens=cu_seqlens,
            use_q_l2norm_in_kernel=q_l2,
            use_qk_l2norm_in_kernel=k_l2,
        )
        if self.record_stats:
            k_seen = per_value_head(l2_normalize(k) if k_l2 else k, self.num_v_heads)
            self.stats = stiffness_stats(k_seen, beta, None, self.update_rule)
        if use_cache:
            past_key_values.update_layer_state(
                self.layer_idx, recurrent_state=state, conv_state=conv_state if self.use_short_conv else None, offset=T
            )

        if self.use_gate:
            o = self.o_norm(o, gate.reshape(B, T, self.num_v_heads, self.head_v_dim))
        else:
            o = self.o_norm(o)
        o = self.o_proj(o.reshape(B, T, self.value_dim))
        if mask is not None:
            o = o * mask
        return o, None, past_key_values
