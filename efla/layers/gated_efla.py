"""``GatedEFLA``: the Gated DeltaNet token mixer with the exact-flow update (or the Euler one).

Architecture and parameter names follow flash-linear-attention's ``GatedDeltaNet`` layer
(``a_proj``, ``A_log``, ``dt_bias``, ``b_proj``, short convolutions, gated output norm), so its
checkpoints load one-to-one.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from efla.distributed.context_parallel import (
    context_parallel_aware,
    context_parallel_conv_states,
    context_parallel_inactive,
)
from efla.ops import DecodeSpec, chunk_gated_delta_rule, chunk_gated_efla, recurrent_gated_delta_rule, recurrent_gated_efla

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
from .modules import RMSNorm, RMSNormGated, ShortConvolution, decay_gate, l2_normalize

__all__ = ["GatedEFLA"]

# log-uniform range of the initial discretisation step dt (Mamba-2 / Gated DeltaNet convention)
DT_MIN, DT_MAX, DT_INIT_FLOOR = 1e-3, 1e-1, 1e-4
A_INIT_RANGE = (0.0, 16.0)


class GatedEFLA(nn.Module):
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

    Example:
        >>> import torch
        >>> layer = GatedEFLA(hidden_size=64, head_dim=16, num_heads=2, expand_v=1)
        >>> layer(torch.randn(2, 10, 64))[0].shape
        torch.Size([2, 10, 64])
    """

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
        super().__init__()
        if mode not in ("chunk", "recurrent", "fused_recurrent"):
            raise ValueError(f"mode: expected 'chunk' or 'recurrent', got {mode!r}")
        if num_heads < 1 or head_dim < 1:
            raise ValueError(f"num_heads, head_dim: expected >= 1, got {num_heads}, {head_dim}")
        self.mode = "recurrent" if mode == "fused_recurrent" else mode
        self.update_rule = check_update_rule(update_rule)
        self.hidden_size = hidden_size
        self.expand_v = expand_v
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_v_heads = check_num_v_heads(num_v_heads, num_heads)
        self.use_gate, self.use_short_conv = use_gate, use_short_conv
        self.allow_neg_eigval = allow_neg_eigval
        self.conv_size, self.conv_bias = conv_size, conv_bias
        self.layer_idx = layer_idx

        self.head_k_dim = head_dim
        self.head_v_dim = int(head_dim * expand_v)
        if not math.isclose(head_dim * expand_v, self.head_v_dim, rel_tol=1e-5):
            raise ValueError(f"expand_v: head_dim * expand_v = {head_dim * expand_v} is not an integer")
        self.key_dim = num_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.a_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.reset_gate_parameters()

        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, activation="silu")
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, activation="silu")
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, bias=conv_bias, activation="silu")
        else:
            warnings.warn(
                "use_short_conv=False: the short convolutions matter for quality; keep them unless you know why not.",
                stacklevel=2,
            )
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.o_norm = RMSNormGated(self.head_v_dim, eps=norm_eps, activation=output_gate_activation)
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

    def input_projections(self, x: torch.Tensor) -> tuple:
        """``(q, k, v, a, b, g)`` projections of ``x`` (``g`` is ``None`` without the output gate)."""
        layers = [self.q_proj, self.k_proj, self.v_proj, self.a_proj, self.b_proj]
        q, k, v, a, b = project(x, layers, self.fuse_input_projections)
        # the output gate stays apart: as a slice of the fused product the gated norm would copy it
        return q, k, v, a, b, (self.g_proj(x) if self.use_gate else None)

    def log_gate(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``g = -exp(A_log) * softplus(a_proj(x) + dt_bias)``, ``[B, T, num_v_heads]``, ``<= 0``, in
        float32 (float64 for float64 inputs): the ops keep the gate's cumulative sum in that precision."""
        return decay_gate(self.a_proj(hidden_states), self.A_log, self.dt_bias)

    def prepare_qkv_beta(self, hidden_states, attention_mask=None, last_state=None, use_cache=False, cu_seqlens=None):
        """The recurrence inputs per value head, ``q, k [B, T, HV, K]`` (each q/k head repeated for
        its group of value heads, as the op does), ``v [B, T, HV, V]``, ``g, beta [B, T, HV]``
        (``g`` in float32), plus the new convolution states and the padding mask."""
        q, k, v, g, beta, conv_state, mask, _ = self._recurrence_inputs(
            hidden_states, attention_mask, last_state, use_cache, cu_seqlens
        )
        k = l2_normalize(k) if self.update_rule == "euler" else k
        q, k = per_value_head(l2_normalize(q), self.num_v_heads), per_value_head(k, self.num_v_heads)
        return q, k, v, g, beta, conv_state, mask

    def _recurrence_inputs(self, hidden_states, attention_mask, last_state, use_cache, cu_seqlens, raw_gates=False):
        # q (and the Euler rule's k) before their L2 normalisation, which the op fuses into its kernels;
        # last, the output gate's projection. ``raw_gates``: g and beta as the projections left them,
        # for the op to activate (no padding mask then: a masked step needs the gate g = 0 itself)
        B, T = hidden_states.shape[:2]
        mask = padding_mask(attention_mask, B, T, cu_seqlens)
        q, k, v, a, b, gate = self.input_projections(hidden_states)
        if mask is not None:
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
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        q = q.view(B, T, self.num_heads, self.head_k_dim)
        k = k.view(B, T, self.num_heads, self.head_k_dim)
        v = v.view(B, T, self.num_v_heads, self.head_v_dim)
        if raw_gates and mask is None:
            return q, k, v, a, b.to(q.dtype), conv_state, mask, gate
        beta = b.sigmoid()
        if self.allow_neg_eigval:
            beta = beta * 2.0
        beta = beta.to(q.dtype)
        g = decay_gate(a, self.A_log, self.dt_bias)
        if mask is not None:  # k = v = 0 and gate 1: the step is the identity
            k, v = k * mask[..., None], v * mask[..., None]
            g = g * mask
        return q, k, v, g, beta, conv_state, mask, gate

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

    def decode_spec(self) -> DecodeSpec:
        """The constants of this layer's fused decoding step (``efla.ops.fused_decode_step``)."""
        return DecodeSpec(
            num_heads=self.num_heads,
            groups=self.num_v_heads // self.num_heads,
            head_k_dim=self.head_k_dim,
            head_v_dim=self.head_v_dim,
            exact=self.update_rule == "exact",
            gated=True,
            qk_silu=True,
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
        names = ["q_proj", "k_proj", "v_proj", "a_proj", "b_proj"] + (["g_proj"] if self.use_gate else [])
        return fused_decode(self, hidden_states, cache, pool, names, {"a": "a_proj", "beta": "b_proj", "gate": "g_proj"})

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
        q, k, v, g, beta, conv_state, mask, gate = self._recurrence_inputs(
            hidden_states, attention_mask, last_state, use_cache, cu_seqlens, raw_gates
        )
        initial_state = last_state.get("recurrent_state") if last_state is not None else None
        euler = self.update_rule == "euler"
        op = context_parallel_aware(self._op(recurrent))
        gate_kwargs = self._gate_kwargs() if raw_gates and mask is None else {}
        o, state = op(
            q,
            k,
            v,
            g,
            beta,
            initial_state=initial_state,
            output_final_state=use_cache,
            cu_seqlens=cu_seqlens,
            use_q_l2norm_in_kernel=True,
            use_qk_l2norm_in_kernel=euler,
            **gate_kwargs,
        )
        if self.record_stats:
            k_seen = per_value_head(l2_normalize(k) if euler else k, self.num_v_heads)
            self.stats = stiffness_stats(k_seen, beta, g, self.update_rule)
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
