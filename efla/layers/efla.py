"""``EFLA``: the DeltaNet token mixer with the exact-flow update (or the Euler one).

Architecture and parameter names follow flash-linear-attention's ``DeltaNet`` layer, so its
checkpoints load one-to-one; ``update_rule`` only changes how ``q``/``k`` are normalised and
which op integrates the state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from efla.ops import chunk_delta_rule, chunk_efla, recurrent_delta_rule, recurrent_efla

from .linear_attention import LinearAttentionLayer

__all__ = ["EFLA"]

_QK_ACTIVATIONS = ("silu", "relu", "elu", "identity")
_QK_NORMS = ("l2", "sum")


class EFLA(LinearAttentionLayer):
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
    use_cache=False, cu_seqlens=None)`` returns ``(o [B, T, D], None, past_key_values)``; the
    forward is ``LinearAttentionLayer``'s (``efla.layers.linear_attention``), shared with ``GatedEFLA``.

    Examples:
        >>> import torch
        >>> layer = EFLA(hidden_size=64, num_heads=2)
        >>> layer(torch.randn(2, 10, 64))[0].shape
        torch.Size([2, 10, 64])
    """

    GATE_PROJECTIONS = {"beta": "b_proj"}

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
        super().__init__(
            mode=mode,
            update_rule=update_rule,
            hidden_size=hidden_size,
            num_heads=num_heads,
            num_v_heads=num_v_heads,
            use_gate=use_gate,
            use_short_conv=use_short_conv,
            conv_size=conv_size,
            conv_bias=conv_bias,
            allow_neg_eigval=allow_neg_eigval,
            layer_idx=layer_idx,
            fuse_input_projections=fuse_input_projections,
        )
        if qk_activation not in _QK_ACTIVATIONS:
            raise ValueError(f"qk_activation: expected one of {_QK_ACTIVATIONS}, got {qk_activation!r}")
        if qk_norm not in _QK_NORMS:
            raise ValueError(f"qk_norm: expected one of {_QK_NORMS}, got {qk_norm!r}")
        self.qk_activation, self.qk_norm = qk_activation, qk_norm
        self.expand_k, self.expand_v = expand_k, expand_v
        self.use_beta = use_beta
        self._set_dims(expand_k, expand_v, num_v_heads)

        self._add_qkv_projections()
        if use_beta:
            self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self._add_short_convolutions()
        self._add_output(norm_eps, gate_activation="swish")

    def _set_dims(self, expand_k: float, expand_v: float, num_v_heads: int | None) -> None:
        self.key_dim = int(self.hidden_size * expand_k)
        self.value_dim = int(self.hidden_size * expand_v)
        if self.key_dim % self.num_heads != 0:
            raise ValueError(f"num_heads: key dim {self.key_dim} (hidden_size * expand_k) is not divisible by {self.num_heads}")
        if self.value_dim % self.num_v_heads != 0:
            name = "num_v_heads" if num_v_heads is not None else "num_heads"
            raise ValueError(
                f"{name}: value dim {self.value_dim} (hidden_size * expand_v) is not divisible by {self.num_v_heads}"
            )
        self.head_k_dim = self.key_dim // self.num_heads
        self.head_v_dim = self.value_dim // self.num_v_heads

    def _coefficients(self, gates: dict, q: torch.Tensor, mask, raw_gates: bool) -> tuple:  # noqa: ARG002 (k = v = 0 already makes a padded step the identity; the ops take EFLA's beta activated)
        return (self._beta(gates.get("beta"), q),)

    def _op(self, recurrent: bool):
        if self.update_rule == "exact":
            return recurrent_efla if recurrent else chunk_efla
        return recurrent_delta_rule if recurrent else chunk_delta_rule
