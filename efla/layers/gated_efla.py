"""``GatedEFLA``: the Gated DeltaNet token mixer with the exact-flow update (or the Euler one).

Architecture and parameter names follow flash-linear-attention's ``GatedDeltaNet`` layer
(``a_proj``, ``A_log``, ``dt_bias``, ``b_proj``, short convolutions, gated output norm), so its
checkpoints load one-to-one.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from efla.distributed.context_parallel import context_parallel_inactive
from efla.ops import chunk_gated_delta_rule, chunk_gated_efla, recurrent_gated_delta_rule, recurrent_gated_efla

from .linear_attention import LinearAttentionLayer
from .modules import decay_gate

__all__ = ["GatedEFLA"]

# log-uniform range of the initial discretisation step dt (Mamba-2 / Gated DeltaNet convention)
DT_MIN, DT_MAX, DT_INIT_FLOOR = 1e-3, 1e-1, 1e-4
A_INIT_RANGE = (0.0, 16.0)


class GatedEFLA(LinearAttentionLayer):
    r"""Gated Exact Flow Linear Attention layer (drop-in for flash-linear-attention's ``GatedDeltaNet``).

    Log gate ``g_t = -exp(A_log) * softplus(a_proj(x_t) + dt_bias) <= 0`` per value head, gate
    ``a_t = exp(g_t)``, ``beta_t = sigmoid(b_proj(x_t))``, ``lambda_t = ||k_t||^2``:

    - ``update_rule="exact"``: the exact flow of Gated DeltaNet's ODE,
      ``S_t = e^{-delta} (I - c_t k k^T) S_{t-1} + beta (1 - e^{-eta}) / eta k v^T`` with
      ``delta = 1 - a``, ``c = (1 - e^{-a beta lambda}) / lambda``, ``eta = delta + a beta lambda``;
      queries L2-normalised, keys raw.
    - ``update_rule="euler"`` (Gated DeltaNet): ``S_t = a_t (I - beta_t k k^T) S_{t-1} + beta_t k v^T``;
      queries and keys L2-normalised.

    Args:
        hidden_size: model width ``D``. Default ``2048``.
        expand_v: value head dim ``= head_dim * expand_v``. Default ``2``.
        head_dim: query/key head dim. Default ``256``.
        num_heads: query/key heads. Default ``6``.
        num_v_heads: value heads (``None`` = ``num_heads``); when larger, each q/k head serves
            ``num_v_heads // num_heads`` consecutive value heads (grouped values). Default ``None``.
        mode: ``"chunk"`` | ``"recurrent"`` (see ``EFLA``). Default ``"chunk"``.
        use_gate: SiLU output gate ``g_proj``. Default ``True``.
        use_short_conv: causal depthwise convolutions (SiLU) on q, k, v. Default ``True``.
        allow_neg_eigval: ``beta *= 2``. Default ``False``.
        conv_size: convolution width. Default ``4``.
        conv_bias: convolution bias. Default ``False``.
        layer_idx: index in the model (needed with a cache). Default ``None``.
        norm_eps: output-norm epsilon. Default ``1e-5``.
        update_rule: ``"exact"`` | ``"euler"``. Default ``"exact"``.
        output_gate_activation: output gate ``"swish"`` (SiLU) or ``"sigmoid"``. Default ``"swish"``.
        fuse_input_projections: in training, compute the q, k, v, a and b projections of ``x`` as
            one matrix product over their stacked weights: the same weights and results, four
            fewer products forward and eight fewer backward (without gradients, and for wrapped or
            hooked projections, they run one by one; the output gate's projection always does).
            Default ``True``.

    ``record_stats`` / ``stats`` as in ``EFLA`` (plus ``g``). ``forward`` as in ``EFLA``.

    Examples:
        >>> import torch
        >>> layer = GatedEFLA(hidden_size=64, head_dim=16, num_heads=2, expand_v=1)
        >>> layer(torch.randn(2, 10, 64))[0].shape
        torch.Size([2, 10, 64])
    """

    GATE_PROJECTIONS = {"a": "a_proj", "beta": "b_proj"}
    decay_gated = True

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 2,
        head_dim: int = 256,
        num_heads: int = 6,
        num_v_heads: int | None = None,
        mode: str = "chunk",
        use_gate: bool = True,
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        conv_size: int = 4,
        conv_bias: bool = False,
        layer_idx: int | None = None,
        norm_eps: float = 1e-5,
        update_rule: str = "exact",
        output_gate_activation: str = "swish",
        fuse_input_projections: bool = True,
        **kwargs: Any,
    ):
        if num_heads < 1 or head_dim < 1:
            raise ValueError(f"num_heads, head_dim: expected >= 1, got {num_heads}, {head_dim}")
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
        self.expand_v = expand_v
        self.head_dim = head_dim
        self.head_k_dim = head_dim
        self.head_v_dim = int(head_dim * expand_v)
        if not math.isclose(head_dim * expand_v, self.head_v_dim, rel_tol=1e-5):
            raise ValueError(f"expand_v: head_dim * expand_v = {head_dim * expand_v} is not an integer")
        self.key_dim = num_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim

        self._add_qkv_projections()
        self.a_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.reset_gate_parameters()
        self._add_short_convolutions()
        self._add_output(norm_eps, gate_activation=output_gate_activation)

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        """``A ~ U(0, 16)``, ``A_log = log A``; ``dt`` log-uniform in [1e-3, 1e-1] (floored at 1e-4),
        ``dt_bias = softplus^{-1}(dt)`` (the Mamba-2 / Gated DeltaNet initialisation)."""
        if self.A_log.is_meta:
            return
        A = torch.empty_like(self.A_log).uniform_(*A_INIT_RANGE)
        self.A_log.copy_(torch.log(A))
        u = torch.rand_like(self.dt_bias)
        dt = torch.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)).clamp(min=DT_INIT_FLOOR)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    def log_gate(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``g = -exp(A_log) * softplus(a_proj(x) + dt_bias)``, ``[B, T, num_v_heads]``, ``<= 0``, in
        float32 (float64 for float64 inputs): the ops keep the gate's cumulative sum in that precision."""
        return decay_gate(self.a_proj(hidden_states), self.A_log, self.dt_bias)

    def _coefficients(self, gates: dict, q: torch.Tensor, mask, raw_gates: bool) -> tuple:
        """``(g, beta)``; with ``raw_gates`` (and no padding: a masked step needs the gate ``g = 0``
        itself) as the projections left them, for the op to activate."""
        if raw_gates and mask is None:
            return gates["a"], gates["beta"].to(q.dtype)
        beta = self._beta(gates["beta"], q)
        g = decay_gate(gates["a"], self.A_log, self.dt_bias)
        return (g if mask is None else g * mask), beta

    def _gates_in_op(self, hidden_states, recurrent: bool) -> bool:
        """Whether the op activates the gate and beta (the Gated EFLA chunk kernels do it in their
        coefficient pass on the GPU): training and prefill on CUDA without statistics or context
        parallelism, and without padding (a mask of all ones counts as none); everything else
        activates them here, as before."""
        return (
            self.update_rule == "exact"
            and not recurrent
            and hidden_states.is_cuda
            and not self.record_stats
            and context_parallel_inactive()
        )

    def _gate_kwargs(self) -> dict:
        return dict(
            use_gate_in_kernel=True,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            use_beta_sigmoid_in_kernel=True,
            allow_neg_eigval=self.allow_neg_eigval,
        )

    def _op(self, recurrent: bool):
        if self.update_rule == "exact":
            return recurrent_gated_efla if recurrent else chunk_gated_efla
        return recurrent_gated_delta_rule if recurrent else chunk_gated_delta_rule
